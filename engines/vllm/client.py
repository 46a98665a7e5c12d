"""An async client for one vLLM server's HTTP API: one method per endpoint, each with a timeout.

Failures are classified so that callers (and operators reading the message) can tell a
dead engine (`EngineRefused`), a stuck one (`EngineTimeout`) and one that answered with an
error (`EngineHTTPError`, with status and body) apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ssl
from typing import Any, Iterator, Optional, Sequence
from urllib.parse import urlsplit

import aiohttp

from config.schema import ModelSpec
from config.secrets import split_userinfo


class EngineError(Exception):
    """A call to an engine failed. `str()` names the endpoint and the cause."""

    def __init__(self, endpoint: str, cause: str):
        self.endpoint = endpoint
        self.cause = cause
        super().__init__(f"{endpoint}: {cause}")


class EngineRefused(EngineError):
    """Nothing listens (not started yet, or dead)."""


class EngineTimeout(EngineError):
    """No answer within the call's timeout."""


class EngineTLSError(EngineError):
    """The TLS handshake failed (an untrusted or mismatched certificate): no retry mends it."""


def tls_context(url: str, ca_file: Optional[str] = None) -> Optional[ssl.SSLContext]:
    """How to verify an `https://` engine: against `ca_file` (`tls_ca_file:`) if given, else the
    system store; the host name is checked. None for `http://`. One context per engine, shared by
    its control client and its proxied connections (router.proxy.upstream), so both trust the same."""
    if urlsplit(url).scheme != "https":
        return None
    return ssl.create_default_context(cafile=ca_file)


class EngineHTTPError(EngineError):
    def __init__(self, endpoint: str, status: int, body: str):
        self.status = status
        self.body = body
        super().__init__(endpoint, f"HTTP {status}: {body[:500]}")


# The calls a caller's task (and the tasks it starts) has outstanding, when it asked to know (`outstanding`):
# an engine step's own deadline can fire before the call's (equal timeouts race), and its message should
# still name the call it was waiting on.
_OUTSTANDING: contextvars.ContextVar[Optional[list[str]]] = contextvars.ContextVar("outstanding_calls", default=None)


@contextlib.contextmanager
def outstanding() -> Iterator[list[str]]:
    """Within it, the endpoints of the calls this task has sent and not had answered, oldest first;
    a call cut off by its caller's cancellation (a deadline) stays listed."""
    calls: list[str] = []
    token = _OUTSTANDING.set(calls)
    try:
        yield calls
    finally:
        _OUTSTANDING.reset(token)


class VLLMClient:
    """Talks to one engine at `base_url`, on a session the caller owns and shares."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, api_key: Optional[str] = None,
                 tls: Optional[ssl.SSLContext] = None):
        # Credentials in the url (`http://user:pw@host`, an engine behind a proxy that wants Basic auth)
        # travel as a header, never in `base_url`: that is printed in every error, keys the proxy's
        # connection pool and becomes the proxied requests' Host header.
        base_url, userinfo = split_userinfo(base_url)
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.tls = tls  # for https: what verifies the engine's certificate (tls_context)
        if api_key:  # the engine's own key wins: one Authorization header only
            self.headers = {"Authorization": f"Bearer {api_key}"}
        elif userinfo is not None:
            self.headers = {"Authorization": aiohttp.encode_basic_auth(*userinfo, encoding="utf-8")}  # latin-1 cannot carry every password
        else:
            self.headers = {}
        self.model_cards: dict[str, dict[str, Any]] = {}  # the last GET /v1/models, by id

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        params: Any = None,
        json: Any = None,
        expect_json: bool = True,
        close: bool = False,
    ) -> Any:
        """`close`: not over a pooled connection, and not pooled after (`Connection: close`)."""
        endpoint = f"{method} {path}"
        calls = _OUTSTANDING.get()
        if calls is not None:
            calls.append(endpoint)
        try:
            async with self.session.request(
                method,
                self.base_url + path,
                params=params,
                json=json,
                headers={**self.headers, "Connection": "close"} if close else self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                ssl=self.tls if self.tls is not None else True,
            ) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise EngineHTTPError(endpoint, resp.status, body.decode("utf-8", "replace"))
                if not expect_json:
                    return body.decode("utf-8", "replace")
                if not body:
                    return None
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    raise EngineHTTPError(endpoint, resp.status, "answer is not JSON: " + body[:200].decode("utf-8", "replace")) from None
        except asyncio.TimeoutError:
            raise EngineTimeout(endpoint, f"no answer within {timeout:.3g} s") from None
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
            cause = getattr(exc, "certificate_error", None) or exc.os_error
            raise EngineTLSError(endpoint, f"TLS with {self.base_url} failed: {cause} (is tls_ca_file the CA that "
                                           "signed the engine's certificate, and is the url's host name in it?)") from None
        except aiohttp.ClientConnectorError as exc:
            raise EngineRefused(endpoint, f"cannot connect to {self.base_url} ({exc.os_error or exc})") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
            raise EngineRefused(endpoint, f"connection to {self.base_url} lost ({exc})") from None
        finally:
            if calls is not None and not asyncio.current_task().cancelling():
                calls.remove(endpoint)

    # -- serving -----------------------------------------------------------------------

    async def health(self, timeout: float = 5) -> None:
        await self.request("GET", "/health", timeout=timeout, expect_json=False)

    async def served_models(self, timeout: float = 10) -> list[str]:
        answer = await self.request("GET", "/v1/models", timeout=timeout)
        cards = answer.get("data", []) if isinstance(answer, dict) else []
        # Kept whole: a LoRA adapter's card says which base model it belongs to (`parent`) and where it lives (`root`).
        self.model_cards = {m["id"]: m for m in cards if isinstance(m, dict) and "id" in m}
        return list(self.model_cards)

    async def completion(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await self.request("POST", "/v1/completions", json=body, timeout=timeout)

    async def metrics(self, timeout: float = 10) -> str:
        return await self.request("GET", "/metrics", timeout=timeout, expect_json=False)

    # -- dev endpoints (VLLM_SERVER_DEV_MODE=1) ------------------------------------------

    async def sleep(self, level: int, mode: str = "wait", timeout: float = 120) -> Any:
        return await self.request("POST", "/sleep", params={"level": str(level), "mode": mode}, timeout=timeout)

    async def wake_up(self, tags: Sequence[str] = (), timeout: float = 120) -> Any:
        return await self.request("POST", "/wake_up", params=[("tags", t) for t in tags], timeout=timeout)

    async def release_kv_cache_memory(self, timeout: float = 60) -> Any:
        """vLLM 0.32: frees the KV cache of an engine paused at `/sleep?level=0` (engines/waking/ladder.py).
        Not pooled, as collective_rpc: a refusal raises through vLLM's ASGI app (api_router.py:37-41 does
        not catch it), uvicorn then closes the connection unannounced, and the next call on it was reset
        (seen on the CPU tier)."""
        return await self.request("POST", "/release_kv_cache_memory", timeout=timeout, close=True)

    async def is_sleeping(self, timeout: float = 10) -> bool:
        answer = await self.request("GET", "/is_sleeping", timeout=timeout)
        return bool(answer["is_sleeping"])

    async def collective_rpc(self, method: str, timeout: float, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> list[Any]:
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout}
        # Not pooled: a method the worker lacks (or one that fails) raises through vLLM's ASGI app, after which
        # uvicorn closes the connection without a word, and the next call sent on it (a sleep) is reset.
        answer = await self.request("POST", "/collective_rpc", json=body, timeout=timeout + 5, close=True)
        return answer.get("results", []) if isinstance(answer, dict) else []

    async def reset_prefix_cache(self, timeout: float = 30) -> bool:
        answer = await self.request("POST", "/reset_prefix_cache", timeout=timeout)
        # vLLM 0.32 and 0.33 answer {"success": bool} (entrypoints/serve/dev/cache/api_router.py:44); older ones an empty 200.
        return True if answer is None else bool(answer.get("success", True))


def attached_client(spec: ModelSpec, session: aiohttp.ClientSession) -> Optional[VLLMClient]:
    """The client of an engine attached by `url:` (None for one the router starts)."""
    if spec.url is None:
        return None
    return VLLMClient(spec.url, session, spec.engine_api_key, tls_context(spec.url, spec.tls_ca_file))
