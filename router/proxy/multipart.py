"""multipart/form-data uploads (the audio routes), read with aiohttp's multipart reader.

The whole form must be read before the request can be routed, because `model` is a form
field that may come after the file. So every byte of the body counts (boundaries, part
headers and names as much as part data): the reader reads through `_Bounded`, which stops
at `listen.max_body_mb` with a 413, so the router never holds more than the limit (plus one
read-ahead buffer). The form is then re-encoded for the engine, with `model` set to the name
the engine serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import aiohttp
from aiohttp import StreamReader, http_exceptions, web

from router.errors import APIError

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


async def read_form(request: web.Request, limit: int) -> Form:
    if not request.content_type.startswith("multipart/form-data"):
        raise APIError(400, f"{request.path} takes multipart/form-data (a `file` and form fields such as `model`); "
                            f"got Content-Type {request.content_type!r}.", "invalid_content_type")
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    form = Form()
    try:
        reader = aiohttp.MultipartReader(request.headers, _Bounded(request.content, limit))  # type: ignore[arg-type]
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


class _Bounded:
    """The request's body stream as the multipart reader sees it, refusing to go past `limit` bytes.

    Counting what the reader hands back would miss what aiohttp's reader consumes itself (a
    preamble, boundaries, part headers: 4000 parts of 8 kB names and no data are 32 MB of
    "empty" parts) and would count twice what it pushes back (`unread_data`). The stream's own
    `total_bytes` is every body byte received so far, after transfer and content decoding, so
    it is checked after each read the parser makes; past the limit the next read raises."""

    def __init__(self, content: StreamReader, limit: int):
        self._content, self._limit = content, limit

    def _checked(self, data: bytes) -> bytes:
        if self._content.total_bytes > self._limit:
            raise _too_large(self._limit)
        return data

    async def read(self, n: int = -1) -> bytes:
        return self._checked(await self._content.read(n))

    async def readline(self, *, max_line_length: Optional[int] = None) -> bytes:
        return self._checked(await self._content.readline(max_line_length=max_line_length))

    # What aiohttp's reader calls, and nothing else: a reading method a later aiohttp starts to use
    # fails loudly (AttributeError, a logged 500) rather than read past the limit unnoticed.
    def at_eof(self) -> bool:
        return self._content.at_eof()

    def unread_data(self, data: bytes) -> None:
        self._content.unread_data(data)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The upload is larger than listen.max_body_mb ({limit / 1024 / 1024:g} MB).", "body_too_large")
