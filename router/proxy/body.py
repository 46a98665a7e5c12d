"""A client's request body, read within `listen.max_body_mb` and `listen.client_body_timeout_s`:
JSON (`read_json`) or a multipart form (`read_form`, the audio routes).

Every reader of a proxied request's body reads through `BodyStream`: past the size limit a 413, and a 408
that closes the connection when the client sends nothing for the body timeout while the
router waits for its bytes. aiohttp's server has neither: `client_max_size` binds only
`request.read()` and `post()`, and its reads of a request body have no timeout at all.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Optional

import aiohttp
from aiohttp import http_exceptions, web

from config.sections import Listen
from router.errors import APIError

TICKS = 4  # progress checks per timeout: a silence is cut between 1 and 1 + 1/TICKS timeouts


class BodyStream:
    """`request.content` as the router reads it, bounded in size and in the silence between the bytes.

    The size counts the stream's own `total_bytes` (every body byte received so far, after
    transfer and content decoding), checked after each read: a reader such as aiohttp's
    multipart parser consumes preambles, boundaries and part headers itself and pushes bytes
    back (`unread_data`), so what the reads return would both miss and double-count bytes.

    The deadline runs only while a read waits, so a body the router is slow to consume is never
    the client's fault. Like nginx's client_body_timeout it bounds the time between two arrivals,
    not the whole body: a slow client whose bytes keep coming is never cut. aiohttp gives no hook
    on each arrival, so a timer checks `total_bytes` for progress a few times per timeout."""

    def __init__(self, request: web.Request, listen: Listen):
        self._content = request.content
        self.limit = int(listen.max_body_mb * 1024 * 1024)
        self.timeout = listen.client_body_timeout_s

    def check_declared(self, request: web.Request) -> None:
        """A Content-Length over the limit is refused before a byte of the body is read."""
        if request.content_length is not None and request.content_length > self.limit:
            raise self.too_large()

    async def read(self, n: int = -1) -> bytes:
        return await self._bounded(self._content.read(n))

    async def readline(self, *, max_line_length: Optional[int] = None) -> bytes:
        return await self._bounded(self._content.readline(max_line_length=max_line_length))

    async def readany(self) -> bytes:
        return await self._bounded(self._content.readany())

    def arrived(self) -> bytes:
        """What of the body has arrived already, taken without waiting: for most requests all of it
        (a small body comes in the same segment as its head), so no timer is set at all."""
        data = self._content.read_nowait()
        if self._content.total_bytes > self.limit:
            raise self.too_large()
        return data

    # What aiohttp's multipart reader calls besides reads. Nothing else is offered: a reading method a
    # later aiohttp starts to use fails loudly (AttributeError, a logged 500), never reads past the limits.
    def at_eof(self) -> bool:
        return self._content.at_eof()

    def unread_data(self, data: bytes) -> None:
        self._content.unread_data(data)

    async def _bounded(self, read: Awaitable[bytes]) -> bytes:
        loop = asyncio.get_running_loop()
        content, timeout = self._content, self.timeout
        seen = content.total_bytes
        handle: Optional[asyncio.TimerHandle] = None
        try:
            async with asyncio.timeout(timeout) as deadline:
                def tick() -> None:
                    nonlocal seen, handle
                    if content.total_bytes != seen:  # bytes arrived since the last look: the silence starts again
                        seen = content.total_bytes
                        deadline.reschedule(loop.time() + timeout)
                    handle = loop.call_later(timeout / TICKS, tick)

                handle = loop.call_later(timeout / TICKS, tick)
                data = await read
        except TimeoutError:
            raise APIError(408, f"No byte of the request body arrived for {timeout:g} s (listen.client_body_timeout_s); "
                                "the connection is closed. Send the body without pauses.", "client_body_timeout",
                           close_connection=True) from None
        finally:
            if handle is not None:
                handle.cancel()
        if content.total_bytes > self.limit:
            raise self.too_large()
        return data

    def too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than listen.max_body_mb ({self.limit / 1024 / 1024:g} MB).",
                        "body_too_large")


async def read_json(request: web.Request, listen: Listen) -> tuple[dict[str, Any], bytes]:
    """The body of a JSON route, as an object and as the bytes received (forwarded unchanged when they can be)."""
    # vLLM refuses anything but application/json; saying so here spares a wake for a request it would refuse.
    if request.content_type != "application/json" and not request.content_type.endswith("+json"):
        raise APIError(400, f"{request.path} takes a JSON body with Content-Type: application/json "
                            f"(got {request.headers.get('Content-Type', 'none')!r}).", "invalid_content_type")
    stream = BodyStream(request, listen)
    stream.check_declared(request)
    raw = stream.arrived()
    if not stream.at_eof():
        chunks = [raw]
        while chunk := await stream.readany():
            chunks.append(chunk)
        raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:  # json's C parser recurses once per nesting level: a body of '[' exhausts the stack
        raise too_deep() from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_request")
    return body, raw


def encoded(body: dict[str, Any]) -> bytes:
    """A body the router changed, as JSON again. The encoder recurses as the parser did, from a frame or two
    deeper: a body parsed with barely any stack to spare may not encode, and is the client's 400 as well."""
    try:
        return json.dumps(body).encode()
    except RecursionError:
        raise too_deep() from None


def too_deep() -> APIError:
    return APIError(400, "The request body is not valid JSON: it is nested too deeply.", "invalid_json")


# -- multipart/form-data ------------------------------------------------------------------
# multipart/form-data uploads (the audio routes), read with aiohttp's multipart reader.
# 
# The whole form must be read before the request can be routed, because `model` is a form
# field that may come after the file. So every byte of the body counts (boundaries, part
# headers and names as much as part data): aiohttp's multipart parser reads through
# `BodyStream`, which stops at `listen.max_body_mb` with a 413 (so the router
# never holds more than the limit, plus one read-ahead buffer) and at a client that pauses past
# `listen.client_body_timeout_s` with a 408. The form is then re-encoded for the engine, with
# `model` set to the name the engine serves.

CHUNK = 64 * 1024


@dataclass
class Part:
    name: str
    data: bytes
    filename: Optional[str] = None
    content_type: Optional[str] = None


@dataclass
class Form:
    parts: list[Part] = field(default_factory=list)

    def value(self, name: str) -> Optional[str]:
        for part in self.parts:
            if part.name == name and part.filename is None:
                return part.data.decode("utf-8", "replace")
        return None

    async def encode(self, model: str) -> tuple[str, bytes]:
        """The form for the engine (its Content-Type and body): every part as received, `model` replaced (or added)."""
        form = aiohttp.FormData(quote_fields=False)
        for part in self.parts:
            if part.name == "model" and part.filename is None:
                continue
            if part.filename is not None:
                form.add_field(part.name, part.data, filename=part.filename,
                               content_type=part.content_type or "application/octet-stream")
            else:
                form.add_field(part.name, part.data.decode("utf-8", "replace"))
        form.add_field("model", model)
        payload = form()
        return payload.content_type, await payload.as_bytes()


async def read_form(request: web.Request, listen: Listen) -> Form:
    if not request.content_type.startswith("multipart/form-data"):
        raise APIError(400, f"{request.path} takes multipart/form-data (a `file` and form fields such as `model`); "
                            f"got Content-Type {request.content_type!r}.", "invalid_content_type")
    stream = BodyStream(request, listen)
    stream.check_declared(request)
    form = Form()
    try:
        reader = aiohttp.MultipartReader(request.headers, stream)  # type: ignore[arg-type]
        async for part in reader:
            if not isinstance(part, aiohttp.BodyPartReader):
                raise APIError(400, "Nested multipart parts are not accepted.", "invalid_multipart")
            chunks = []
            while chunk := await part.read_chunk(CHUNK):
                chunks.append(chunk)
            if part.name:
                form.parts.append(Part(part.name, b"".join(chunks), part.filename,
                                       part.headers.get("Content-Type") if part.filename is not None else None))
    except APIError:
        raise
    except (ValueError, AssertionError, RuntimeError, aiohttp.ClientPayloadError, aiohttp.web.HTTPException,
            http_exceptions.HttpProcessingError) as exc:
        raise APIError(400, f"The multipart/form-data body cannot be parsed: {exc}", "invalid_multipart") from None
    return form
