"""Forward one OpenAI request to the engine that holds its lease.

Streams pass through chunk by chunk as they arrive. If the client goes away, the upstream
connection is closed at once, which makes vLLM abort the generation.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from engines import watch
from engines.engine import Engine
from router.errors import APIError, sse_error

UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)


async def forward(request: web.Request, session: aiohttp.ClientSession, engine: Engine, path: str, body: dict[str, Any], raw: bytes) -> web.StreamResponse:
    if body["model"] not in engine.served_names:  # only attached engines that serve other names
        body["model"] = engine.served_name
        raw = json.dumps(body).encode()
    client = engine.client
    if client is None:  # a lease implies a started engine; say so rather than crash if that ever breaks
        raise APIError(502, f"engine '{engine.name}' has no address yet", "engine_unreachable")
    try:
        # The client's Authorization is never forwarded; the engine gets its own key, if it has one.
        headers = {"Content-Type": "application/json", **client.headers}
        upstream = await session.post(client.base_url + path, data=raw, headers=headers, timeout=UPSTREAM_TIMEOUT)
    except aiohttp.ClientConnectorError as exc:
        watch.suspect(engine, f"connect: {exc.os_error or exc}")
        raise APIError(502, f"engine '{engine.name}' is unreachable: {exc.os_error or exc}", "engine_unreachable") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        watch.suspect(engine, f"before answering: {exc!r}")
        raise APIError(502, f"engine '{engine.name}' failed before answering: {exc!r}", "engine_error") from None
    try:
        content_type = upstream.headers.get("Content-Type", "application/json")
        if content_type.startswith("text/event-stream"):
            return await _stream(request, upstream, engine, content_type)
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            watch.suspect(engine, f"while answering: {exc!r}")
            raise APIError(502, f"engine '{engine.name}' failed while answering: {exc!r}", "engine_error") from None
        request["first_byte_at"] = time.monotonic()
        return web.Response(status=upstream.status, body=payload, headers={"Content-Type": content_type})
    finally:
        # close(), not release(): an unfinished upstream must be cut, not returned to the pool
        upstream.close()


async def _stream(request: web.Request, upstream: aiohttp.ClientResponse, engine: Engine, content_type: str) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, headers={
        "Content-Type": content_type, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await response.prepare(request)
    chunks = upstream.content.iter_any()
    try:
        first = await chunks.__anext__()
        request["first_byte_at"] = time.monotonic()  # for TTFB; kept off the per-chunk path below
        await response.write(first)
        async for chunk in chunks:
            await response.write(chunk)
    except StopAsyncIteration:  # an empty stream: nothing to forward
        pass
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, asyncio.TimeoutError) as exc:
        # Headers are gone already: the error travels in the stream, where the SDK raises it.
        watch.suspect(engine, f"mid-stream: {exc!r}")
        await response.write(sse_error(f"engine '{engine.name}' failed mid-stream: {exc!r}", "engine_error"))
    await response.write_eof()
    return response
