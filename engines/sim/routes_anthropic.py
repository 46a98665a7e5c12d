"""The simulated engine's Anthropic Messages API: `POST /v1/messages` (stream and not) and
`POST /v1/messages/count_tokens`, in vLLM 0.33's shapes.

vLLM serves these by translating to chat completions; its errors keep the OpenAI error's
`type` (e.g. `BadRequestError`) inside Anthropic's envelope, and so does this.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from .http import APIError, read_json
from .state import GenerationAborted

if TYPE_CHECKING:
    from .server import SimServer

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def add_routes(app: web.Application, server: "SimServer") -> None:
    routes = AnthropicRoutes(server)
    app.router.add_post("/v1/messages", routes.messages)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)


def error(status: int, type_: str, message: str) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": type_, "message": message}}, status=status)


class AnthropicRoutes:
    def __init__(self, server: "SimServer") -> None:
        self.server = server

    def _chat(self, body: dict) -> dict:
        """The chat request vLLM derives from a Messages request (system first)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages: Field required (a non-empty list)", "BadRequestError", "messages")
        system = body.get("system")
        if isinstance(system, list):
            system = " ".join(b.get("text", "") for b in system if isinstance(b, dict))
        chat = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
        return {"messages": chat + messages}

    async def _guarded(self, request: web.Request, call) -> web.StreamResponse:
        try:
            return await call(request)
        except APIError as e:  # vLLM translates its ErrorResponse into Anthropic's envelope
            return error(e.status, e.type, e.message)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._guarded(request, self._messages)

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        return await self._guarded(request, self._count_tokens)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        body = await read_json(request)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise APIError(400, "model: Field required", "BadRequestError", "model")
        model = s._check_model(body)
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise APIError(400, "max_tokens: Field required (an integer)", "BadRequestError", "max_tokens")
        prompt, ptoks = s._chat_prompt(self._chat(body))
        gen = s._sampling({"max_tokens": max_tokens, "temperature": body.get("temperature", 1.0)}, prompt, ptoks,
                          chat=True, model=model)
        await s._enter_generate(request, model)
        mid = f"chatcmpl-{uuid.uuid4().hex}"  # vLLM keeps the chat completion's id
        if body.get("stream") is True:
            return await self._stream(request, gen, mid, model)
        try:
            async with contextlib.aclosing(s.engine.generate(gen)) as tokens:
                text = "".join([t async for t in tokens]).lstrip(" ")
        except GenerationAborted as e:
            return error(500, "InternalServerError", str(e))
        # vLLM serializes this answer with exclude_none: no null fields at all
        return web.json_response({
            "id": mid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": model, "stop_reason": STOP_REASONS.get(gen.finish_reason or "stop", "end_turn"),
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens},
        })

    async def _stream(self, request: web.Request, gen, mid: str, model: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(event: dict) -> None:
            await resp.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())

        await send({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "content": [], "model": model, "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}})
        first = True
        try:
            async with contextlib.aclosing(self.server.engine.generate(gen)) as tokens:
                async for t in tokens:
                    if first:
                        await send({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
                        t, first = t.lstrip(" "), False
                    await send({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}})
        except GenerationAborted as e:
            await send({"type": "error", "error": {"type": "internal_error", "message": str(e)}})
            await resp.write_eof()
            return resp
        if not first:
            await send({"type": "content_block_stop", "index": 0})
        await send({"type": "message_delta", "delta": {"stop_reason": STOP_REASONS.get(gen.finish_reason or "stop", "end_turn"),
                                                        "stop_sequence": None},
                    "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}})
        await send({"type": "message_stop"})
        await resp.write_eof()
        return resp

    async def _count_tokens(self, request: web.Request) -> web.Response:
        s = self.server
        body = await read_json(request)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise APIError(400, "model: Field required", "BadRequestError", "model")
        s._check_model(body)
        _, ptoks = s._chat_prompt(self._chat(body))
        return web.json_response({"input_tokens": ptoks, "context_management": {"original_input_tokens": ptoks}})
