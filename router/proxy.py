"""Forward one request to the engine that holds its lease.

Streams pass through chunk by chunk as they arrive. If the client goes away, the upstream
connection is closed at once, which makes vLLM abort the generation. When the router has
already sent a stream's headers (keep-alive comments while the request waited for a swap),
the engine's answer must travel inside that stream, errors included.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Optional

import aiohttp
from aiohttp import web

from engines import watch
from engines.engine import Engine
from router.errors import APIError, sse_error
from router.responses import StreamSniffer

UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_for(engine: Engine, body: dict[str, Any], raw: bytes) -> bytes:
    """The request body for `engine`: as received, unless the engine serves the model under another name."""
    if body.get("model") not in engine.served_names:  # only attached engines that serve other names, or no model given
        body["model"] = engine.served_name
        return json.dumps(body).encode()
    return raw


async def forward(request: web.Request, session: aiohttp.ClientSession, engine: Engine, path: str, data: Any, *,
                  method: str = "POST", content_type: Optional[str] = "application/json",
                  on_answer: Optional[Callable[[bytes], None]] = None, sniffer: Optional[StreamSniffer] = None,
                  prepared: Optional[web.StreamResponse] = None, anthropic: bool = False) -> web.StreamResponse:
    client = engine.client
    if client is None:  # a lease implies a started engine; say so rather than crash if that ever breaks
        raise APIError(502, f"engine '{engine.name}' has no address yet", "engine_unreachable")
    try:
        # The client's Authorization is never forwarded; the engine gets its own key, if it has one.
        headers = {"Content-Type": content_type, **client.headers} if content_type else client.headers
        upstream = await session.request(method, client.base_url + path, data=data, headers=headers, timeout=UPSTREAM_TIMEOUT)
    except aiohttp.ClientConnectorError as exc:
        watch.suspect(engine, f"connect: {exc.os_error or exc}")
        raise APIError(502, f"engine '{engine.name}' is unreachable: {exc.os_error or exc}", "engine_unreachable") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        watch.suspect(engine, f"before answering: {exc!r}")
        raise APIError(502, f"engine '{engine.name}' failed before answering: {exc!r}", "engine_error") from None
    try:
        answer_type = upstream.headers.get("Content-Type", "application/json")
        if answer_type.startswith("text/event-stream"):
            return await _stream(request, upstream, engine, answer_type, sniffer, prepared, anthropic)
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            watch.suspect(engine, f"while answering: {exc!r}")
            raise APIError(502, f"engine '{engine.name}' failed while answering: {exc!r}", "engine_error") from None
        request["first_byte_at"] = time.monotonic()
        if prepared is not None:
            return await _inside_stream(prepared, upstream.status, payload, anthropic)
        if on_answer is not None and upstream.status < 300:
            on_answer(payload)
        return web.Response(status=upstream.status, body=payload, headers={"Content-Type": answer_type})
    finally:
        # close(), not release(): an unfinished upstream must be cut, not returned to the pool
        upstream.close()


async def _stream(request: web.Request, upstream: aiohttp.ClientResponse, engine: Engine, content_type: str,
                  sniffer: Optional[StreamSniffer], prepared: Optional[web.StreamResponse], anthropic: bool) -> web.StreamResponse:
    response = prepared
    if response is None:
        response = web.StreamResponse(status=upstream.status, headers={**SSE_HEADERS, "Content-Type": content_type})
        await response.prepare(request)
    chunks = upstream.content.iter_any()
    try:
        first = await chunks.__anext__()
        request["first_byte_at"] = time.monotonic()  # for TTFB; kept off the per-chunk path below
        await response.write(first)
        if sniffer is not None:  # Responses only: the id is in the first event; chat streams never pay for this
            sniffer.feed(first)
            while not sniffer.done:
                chunk = await chunks.__anext__()
                sniffer.feed(chunk)
                await response.write(chunk)
        async for chunk in chunks:
            await response.write(chunk)
    except StopAsyncIteration:  # an empty stream, or one that ended while sniffing: nothing more to forward
        pass
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, asyncio.TimeoutError) as exc:
        # Headers are gone already: the error travels in the stream, where the SDK raises it.
        watch.suspect(engine, f"mid-stream: {exc!r}")
        await response.write(sse_error(f"engine '{engine.name}' failed mid-stream: {exc!r}", "engine_error", anthropic=anthropic))
    await response.write_eof()
    return response


async def _inside_stream(response: web.StreamResponse, status: int, payload: bytes, anthropic: bool) -> web.StreamResponse:
    """A JSON answer (an engine's error, typically) to a stream whose headers the router already sent."""
    if status >= 400:
        message = _engine_message(payload) or f"engine answered HTTP {status}"
        await response.write(sse_error(message, "engine_error", status=status, anthropic=anthropic))
    else:
        await response.write(b"data: " + payload + b"\n\n")
    await response.write_eof()
    return response


def _engine_message(payload: bytes) -> Optional[str]:
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else None
