"""The simulated engine's Responses API: `POST /v1/responses` (stream and not, background),
`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`, in vLLM 0.33's shapes.

As in vLLM, responses are remembered only with `VLLM_ENABLE_RESPONSES_API_STORE=1` and
`store` (default true); without the store, retrieve and cancel answer 404 for every id.
The store lives in this process: a router must send retrieve/cancel to the engine that
created the response, which is what its id pinning is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .http import APIError, bad_request, error_response, read_json
from .state import GenerationAborted

if TYPE_CHECKING:
    from .server import SimServer


def add_routes(app: web.Application, server: "SimServer") -> None:
    routes = ResponsesRoutes(server)
    app.router.add_post("/v1/responses", routes.create)
    app.router.add_get("/v1/responses/{response_id}", routes.retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", routes.cancel)


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


class ResponsesRoutes:
    def __init__(self, server: "SimServer") -> None:
        self.server = server
        self.store_enabled = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE") == "1"
        self.store: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    # ---- request -> prompt -------------------------------------------------------------

    @staticmethod
    def _messages(body: dict) -> list[dict]:
        inp = body.get("input")
        msgs: list[dict] = []
        if isinstance(body.get("instructions"), str):
            msgs.append({"role": "system", "content": body["instructions"]})
        if isinstance(inp, str):
            msgs.append({"role": "user", "content": inp})
        elif isinstance(inp, list) and inp:
            for item in inp:
                if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                    raise bad_request("each input item needs a string role.", "input")
                content = item.get("content", "")
                if isinstance(content, list):
                    if not all(isinstance(c, dict) and isinstance(c.get("text", ""), str) for c in content):
                        raise bad_request("input content parts must be objects with a text field.", "input")
                    content = " ".join(c.get("text", "") for c in content)
                elif not isinstance(content, str):
                    raise bad_request("input content must be a string or a list of parts.", "input")
                msgs.append({"role": item["role"], "content": content})
        else:
            raise bad_request("input must be a string or a non-empty list of input items.", "input")
        return msgs

    def _response(self, body: dict, rid: str, model: str, created: int, status: str, text: str | None,
                  gen=None) -> dict[str, Any]:
        output = []
        if text is not None:
            output = [{"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed", "phase": None,
                       "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}] if text else []}]
        usage = None
        if gen is not None and status in ("completed", "incomplete"):
            usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens,
                     "total_tokens": gen.prompt_tokens + gen.completion_tokens,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                             "cached_tokens_per_turn": []},
                     "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                               "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []}}
        return {
            "id": rid, "created_at": created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": model,
            "object": "response", "output": output, "parallel_tool_calls": True,
            "temperature": float(body.get("temperature", 1.0)), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": float(body.get("top_p", 1.0)),
            "background": bool(body.get("background", False)),
            "max_output_tokens": body.get("max_output_tokens") or gen.max_tokens if gen else body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"), "previous_response_id": body.get("previous_response_id"),
            "prompt": None, "reasoning": body.get("reasoning"), "service_tier": body.get("service_tier", "auto"),
            "status": status, "text": body.get("text"), "top_logprobs": body.get("top_logprobs", 0),
            "truncation": body.get("truncation", "disabled"), "usage": usage, "user": body.get("user"),
            "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None,
        }

    # ---- routes --------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        body = await read_json(request)
        model = s._check_model(body)
        msgs = self._messages(body)
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.store:
            raise not_found(prev)
        sampling = {"max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature", 1.0),
                    "seed": body.get("seed"), "stream": body.get("stream", False), "ignore_eos": body.get("ignore_eos")}
        prompt, ptoks = s._chat_prompt({"messages": msgs})
        gen = s._sampling({k: v for k, v in sampling.items() if v is not None}, prompt, ptoks, chat=True, model=model)
        store = body.get("store", True) is not False and self.store_enabled
        background = body.get("background") is True
        if background and not store:
            raise APIError(400, "This vLLM engine does not support `store=True` and therefore does not support the "
                           "background mode. To enable these features, set the environment variable "
                           "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                           "invalid_request_error", "background")
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        await s._enter_generate(request, model)
        if background:
            self.store[rid] = self._response(body, rid, model, created, "queued", None)
            self.tasks[rid] = asyncio.create_task(self._background(body, rid, model, created, gen))
            return web.json_response(self.store[rid])
        if body.get("stream") is True:
            return await self._stream(request, body, rid, model, created, gen, store)
        try:
            text = "".join([t async for t in _tokens(s, gen)]).lstrip(" ")
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        answer = self._response(body, rid, model, created, _status(gen), text, gen)
        if store:
            self.store[rid] = answer
        return web.json_response(answer)

    async def _background(self, body: dict, rid: str, model: str, created: int, gen) -> None:
        self.store[rid]["status"] = "in_progress"
        try:
            text = "".join([t async for t in _tokens(self.server, gen)]).lstrip(" ")
        except (asyncio.CancelledError, GenerationAborted):
            return  # cancel() set the status already; an abort leaves it in_progress, as vLLM does
        finally:
            self.tasks.pop(rid, None)
        if self.store[rid]["status"] == "in_progress":
            self.store[rid] = self._response(body, rid, model, created, _status(gen), text, gen)

    async def _stream(self, request: web.Request, body: dict, rid: str, model: str, created: int, gen, store: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        seq = 0

        async def send(event: dict) -> None:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            await resp.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())

        initial = self._response(body, rid, model, created, "in_progress", None)
        initial["usage"] = None
        await send({"type": "response.created", "response": initial})
        await send({"type": "response.in_progress", "response": initial})
        item_id, parts = f"msg_{uuid.uuid4().hex}", []
        try:
            async for t in _tokens(self.server, gen):
                if not parts:
                    await send({"type": "response.output_item.added", "output_index": 0,
                                "item": {"id": item_id, "type": "message", "role": "assistant", "content": [], "status": "in_progress",
                                         "phase": None}})
                    await send({"type": "response.content_part.added", "output_index": 0, "item_id": item_id, "content_index": 0,
                                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
                    t = t.lstrip(" ")
                parts.append(t)
                await send({"type": "response.output_text.delta", "content_index": 0, "output_index": 0,
                            "item_id": item_id, "delta": t, "logprobs": []})
        except GenerationAborted as e:
            await send({"type": "error", "code": "internal_error", "message": str(e), "param": None})
            await resp.write_eof()
            return resp
        text = "".join(parts)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        await send({"type": "response.output_text.done", "output_index": 0, "content_index": 0, "text": text,
                    "logprobs": [], "item_id": item_id})
        await send({"type": "response.content_part.done", "item_id": item_id, "output_index": 0, "content_index": 0, "part": part})
        await send({"type": "response.output_item.done", "output_index": 0,
                    "item": {"id": item_id, "type": "message", "role": "assistant", "content": [part], "status": "completed",
                             "phase": None}})
        final = self._response(body, rid, model, created, _status(gen), text, gen)
        final["output"][0]["id"] = item_id
        if store:
            self.store[rid] = final
        await send({"type": "response.completed", "response": final})
        await resp.write_eof()
        return resp

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        if rid not in self.store:
            raise not_found(rid)
        return web.json_response(self.store[rid])

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        response = self.store.get(rid)
        if response is None:
            raise not_found(rid)
        if response["status"] not in ("queued", "in_progress"):
            raise APIError(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
        response["status"] = "cancelled"
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return web.json_response(response)


async def _tokens(server: "SimServer", gen):
    async with contextlib.aclosing(server.engine.generate(gen)) as tokens:
        async for t in tokens:
            yield t


def _status(gen) -> str:
    return "incomplete" if gen.finish_reason == "length" else "completed"
