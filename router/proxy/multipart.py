"""multipart/form-data uploads (the audio routes), read with aiohttp's multipart reader.

The whole form must be read before the request can be routed, because `model` is a form
field that may come after the file. So every byte of the body counts (boundaries, part
headers and names as much as part data): aiohttp's multipart parser reads through
`router.proxy.body.BodyStream`, which stops at `listen.max_body_mb` with a 413 (so the router
never holds more than the limit, plus one read-ahead buffer) and at a client that pauses past
`listen.client_body_timeout_s` with a 408. The form is then re-encoded for the engine, with
`model` set to the name the engine serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import aiohttp
from aiohttp import http_exceptions, web

from config.sections import Listen
from router.errors import APIError
from router.proxy.body import BodyStream

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
