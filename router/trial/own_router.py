"""The router a trial drives: its own (`hotswap serve` on the roster, on a free loopback port, stopped at the
end) or one already running (--url). Every call has a timeout; waits are polls with a deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.keys import HOLD_HEADER

STATUS_TIMEOUT_S = 30.0
POLL_S = 0.2


class TrialError(Exception):
    """A step of the trial could not be done; str() says which and why."""


class AdminRefused(TrialError):
    """The router answered an admin action with an error: `status`, `code` (its error code) and its message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterClient:
    """The admin API and the OpenAI API of one router, as the trial calls them."""

    def __init__(self, url: str, session: aiohttp.ClientSession, admin_key: Optional[str], client_key: Optional[str],
                 action_timeout_s: float):
        self.url = url.rstrip("/")
        self.session = session
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.client_headers = {"Authorization": f"Bearer {client_key}"} if client_key else {}
        self.action_timeout_s = action_timeout_s
        self.hold_tokens: dict[str, str] = {}  # model -> the token of the trial's hold on it (--url: Holding)

    async def status(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/admin/status", headers=self.admin_headers,
                                    timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                raise AdminRefused(r.status, _code(body), f"GET /admin/status: {r.status} {_message(body)}")
            return body

    async def engine(self, name: str) -> dict[str, Any]:
        status = await self.status()
        for e in status["engines"]:
            if e["name"] == name:
                return e
        raise TrialError(f"the router at {self.url} has no engine {name!r}")

    async def admin(self, action: str, model: str, **params: Any) -> dict[str, Any]:
        """POST /admin/{action}?model=...: the router's answer, or AdminRefused with its error."""
        query = {"model": model, **{k: str(v) for k, v in params.items()}}
        async with self.session.post(self.url + f"/admin/{action}", params=query, headers=self.admin_headers,
                                     timeout=aiohttp.ClientTimeout(total=self.action_timeout_s)) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                raise AdminRefused(r.status, _code(body), f"POST /admin/{action} {model}: {r.status} {_message(body)}")
            return body

    async def generate(self, model: str, prompt: str, tokens: int, timeout_s: float) -> tuple[int, float]:
        """A completion of exactly `tokens` tokens (ignore_eos, temperature 0): (tokens decoded, wall seconds)."""
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        headers = {**self.client_headers, **({HOLD_HEADER: self.hold_tokens[model]} if model in self.hold_tokens else {})}
        started = time.monotonic()
        async with self.session.post(self.url + "/v1/completions", json=body, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            answer = await r.json(content_type=None)
            seconds = time.monotonic() - started
            if r.status != 200:
                raise TrialError(f"POST /v1/completions {model}: {r.status} {_message(answer)}")
        decoded = (answer.get("usage") or {}).get("completion_tokens") or tokens
        return int(decoded), seconds

    async def metric(self, name: str, **labels: str) -> Optional[float]:
        """One sample of the router's /metrics (None when absent)."""
        async with self.session.get(self.url + "/metrics", headers=self.admin_headers,
                                    timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)) as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    async def engine_version(self, port: Optional[int]) -> Optional[str]:
        """vLLM's own GET /version on an engine's loopback port (the router does not forward it); None if unanswered."""
        if not port:
            return None
        try:
            async with self.session.get(f"http://127.0.0.1:{port}/version", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return (await r.json(content_type=None)).get("version") if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None

    async def engine_versions(self, port: Optional[int]) -> dict[str, Any]:
        """The worker extension's hotswap_versions (vLLM, torch, CUDA, device), straight to an engine's loopback port
        (the router forwards no collective_rpc); {} when it does not answer (no extension, not on this host)."""
        if not port:
            return {}
        try:
            async with self.session.post(f"http://127.0.0.1:{port}/collective_rpc", json={"method": "hotswap_versions"},
                                         timeout=aiohttp.ClientTimeout(total=10)) as r:
                results = (await r.json(content_type=None)).get("results") if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return {}
        return results[0] if isinstance(results, list) and results and isinstance(results[0], dict) else {}

    async def wait_booted(self, timeout_s: float, alive: Callable[[], Optional[str]], say: Callable[[str], None]) -> dict[str, Any]:
        """Poll /admin/status until every engine has booted; `alive` names why the router is gone (None: running)."""
        deadline, last = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            gone = alive()
            if gone:
                raise TrialError(gone)
            try:
                status = await self.status()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                status = None  # not listening yet
            if status is not None:
                states = ", ".join(f"{e['name']} {e['state']}" for e in status["engines"])
                if states != last:
                    say(f"booting the roster's engines: {states}")
                    last = states
                if status.get("booted"):
                    return status
            await asyncio.sleep(POLL_S)
        raise TrialError(f"the router at {self.url} had not booted every engine after {timeout_s:.0f} s")


def _code(body: Any) -> str:
    return str((body.get("error") or {}).get("code", "")) if isinstance(body, dict) else ""


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body)[:300]


class OwnRouter:
    """`hotswap serve` on the roster, on loopback at a free port, its log in `log_path`: for the trial alone."""

    def __init__(self, roster_path: str, log_dir: Path, stop_timeout_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.log_path = log_dir / "router.log"
        self.stop_timeout_s = stop_timeout_s
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", roster_path, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-dir", str(log_dir / "engines")],
            stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy(), start_new_session=True)

    def gone(self) -> Optional[str]:
        if self.proc.poll() is None:
            return None
        tail = "\n".join(self.log_path.read_text().splitlines()[-15:])
        return f"the trial's router exited with {self.proc.returncode} (log {self.log_path}):\n{tail}"

    async def stop(self) -> Optional[int]:
        """SIGTERM, wait (in a thread) up to stop_timeout_s, then SIGKILL: its engines go with it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 10)
        self._log.close()
        return self.proc.returncode


class Holding:
    """With --url: the models the trial drives held off client traffic (POST /admin/hold, router.keys) for its
    length: taken at the start, renewed while it runs (a hold lapses HOLD_S after its last renewal, so a trial that
    dies lets go by itself), released at the end. The trial's own generations carry the hold's token."""

    HOLD_S = 60.0

    def __init__(self, client: RouterClient, names: list[str], say: Callable[[str], None]):
        self.client, self.names, self.say = client, names, say
        self._renewing: Optional[asyncio.Task[None]] = None

    async def __aenter__(self) -> "Holding":
        for name in self.names:
            answer = await self.client.admin("hold", name, seconds=self.HOLD_S)
            self.client.hold_tokens[name] = answer["token"]
        self._renewing = asyncio.create_task(self._renew())
        return self

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.HOLD_S / 3)
            for name, token in list(self.client.hold_tokens.items()):
                try:
                    await self.client.admin("hold", name, seconds=self.HOLD_S, token=token)
                except (TrialError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    self.say(f"could not renew the hold on {name}: {exc}")

    async def __aexit__(self, *exc: object) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            await asyncio.gather(self._renewing, return_exceptions=True)
        for name, token in list(self.client.hold_tokens.items()):
            try:
                await self.client.admin("hold", name, seconds=0, token=token)
            except (TrialError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.say(f"could not release the hold on {name} (it lapses within {self.HOLD_S:g} s): {exc}")
        self.client.hold_tokens.clear()
