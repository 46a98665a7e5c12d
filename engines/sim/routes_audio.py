"""The simulated engine's speech-to-text routes: `POST /v1/audio/transcriptions` and
`/v1/audio/translations`, multipart/form-data as in vLLM 0.33 (`file` plus form fields,
`stream=true` answers SSE `transcription.chunk` / `translation.chunk` events).

The "transcript" is generated text seeded by the audio bytes, so the same file gives the
same words and a router that mangled the upload would be caught by a comparison.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from . import lm
from .http import bad_request, error_response
from .state import GenerationAborted

if TYPE_CHECKING:
    from .server import SimServer

BYTES_PER_SECOND = 32000  # 16 kHz, 16-bit mono: what a WAV for Whisper usually is


def add_routes(app: web.Application, server: "SimServer") -> None:
    routes = AudioRoutes(server)
    app.router.add_post("/v1/audio/transcriptions", routes.transcriptions)
    app.router.add_post("/v1/audio/translations", routes.translations)


class AudioRoutes:
    def __init__(self, server: "SimServer") -> None:
        self.server = server

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "transcription")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "translation")

    async def _form(self, request: web.Request) -> tuple[dict[str, str], bytes]:
        if not request.content_type.startswith("multipart/form-data"):
            raise bad_request("Expected multipart/form-data with an audio `file`.", "file")
        fields: dict[str, str] = {}
        audio = None
        reader = await request.multipart()
        async for part in reader:
            if part.name == "file":
                audio = await part.read()
            elif part.name:
                fields[part.name] = await part.text()
        if not audio:
            raise bad_request("file: Field required (a non-empty audio file).", "file")
        return fields, audio

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        s = self.server
        fields, audio = await self._form(request)
        model = s._check_model({"model": fields["model"]} if "model" in fields else {})
        seconds = max(1, len(audio) // BYTES_PER_SECOND)
        prompt = hashlib.sha256(audio).hexdigest() + fields.get("prompt", "")
        gen = s._sampling({"max_tokens": 8 + seconds * 2, "temperature": float(fields.get("temperature", 0) or 0)},
                          prompt, lm.count_tokens(prompt), chat=False, model=model)
        await s._enter_generate(request, model)
        if fields.get("stream", "false").lower() == "true":
            return await self._stream(request, gen, model, kind)
        try:
            async with contextlib.aclosing(s.engine.generate(gen)) as tokens:
                text = "".join([t async for t in tokens]).lstrip(" ")
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        fmt = fields.get("response_format", "json")
        if fmt == "text":
            return web.Response(text=text, content_type="text/plain")
        if kind == "translation":
            return web.json_response({"text": text})
        return web.json_response({"text": text, "usage": {"type": "duration", "seconds": seconds}})

    async def _stream(self, request: web.Request, gen, model: str, kind: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid, created, first = f"trsc-{uuid.uuid4().hex}", int(time.time()), True
        try:
            async with contextlib.aclosing(self.server.engine.generate(gen)) as tokens:
                async for t in tokens:
                    chunk = {"id": rid, "object": f"{kind}.chunk", "created": created, "model": model,
                             "choices": [{"delta": {"content": t.lstrip(" ") if first else t}, "finish_reason": gen.finish_reason,
                                          "stop_reason": None}]}
                    first = False
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        except GenerationAborted as e:
            await resp.write(b"data: " + json.dumps({"error": {"message": str(e), "type": "InternalServerError",
                                                               "param": None, "code": 500}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
