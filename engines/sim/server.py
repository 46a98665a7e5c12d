"""HTTP surface of the simulated engine: vLLM 0.33's OpenAI server, dev API and /metrics,
plus the sim-only /sim/* control routes.

Paths, query parameters, status codes and JSON shapes follow vLLM so that a router
cannot tell the two apart. The dev endpoints (routes_dev.py) exist only with
VLLM_SERVER_DEV_MODE=1 and, like vLLM's, are not behind --api-key. Injected faults that change the answer
(http500, malformed, cut: see control.py) are carried out here, where the shape
the step promises is known.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from . import lm, numerics, tokenizer
from .lora import Adapters
from .control import Control, InjectedFault, crash
from .http import MALFORMED_METRICS_LINE, APIError, bad_request, cut, error_response, read_json, truncated_json
from .memory import EngineMemory
from .page_cache import DiskModel
from .metrics import CONTENT_TYPE, answer_metrics
from .state import Generation, GenerationAborted, SimEngine

log = logging.getLogger("vllm.sim")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimServer:
    def __init__(
        self,
        engine: SimEngine,
        control: Control,
        *,
        api_key: str | None,
        dev_mode: bool,
        crash_mid_stream: int | None,
        adapters: Adapters | None = None,
        memory: EngineMemory | None = None,
    ) -> None:
        self.engine = engine
        self.memory = memory  # the GPU memory oracle (memory.py); None: not modelled
        self.control = control
        self.api_key = api_key
        self.dev_mode = dev_mode
        self.crash_mid_stream = crash_mid_stream
        self.names = engine.cfg.served_names
        self.adapters = adapters or Adapters({}, self.names[0])
        self.lose_lora_on_level2 = False
        self.disk: DiskModel | None = None  # the disk and page cache a reload reads (page_cache.py); None: not modelled
        self.extension_from: str | None = None  # with --sim-separate-env: the file the worker extension was found in

    # ---- middleware -------------------------------------------------------------

    @web.middleware
    async def errors_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except InjectedFault as e:
            return await self.fault_answer(request, e)
        except web.HTTPNotFound:
            # FastAPI's shape, which is what vLLM answers for unknown paths.
            return web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        except web.HTTPException:
            raise
        except Exception as e:
            # A sim bug must still look like a vLLM 500, not aiohttp's HTML page.
            log.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(500, f"{type(e).__name__}: {e}", "InternalServerError")

    async def fault_answer(self, request: web.Request, fault: InjectedFault) -> web.Response:
        if fault.kind == "http500":
            return error_response(500, str(fault), "InternalServerError")
        if fault.kind == "cut":
            await cut(request)
        if fault.step == "metrics":
            body = MALFORMED_METRICS_LINE + self.engine.render_metrics()
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
        return web.Response(body=truncated_json(request.path), content_type="application/json")

    @web.middleware
    async def auth_mw(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # vLLM guards only /v1 paths with the API key; the dev API stays open.
        if (
            self.api_key
            and request.path.startswith("/v1")
            and request.method != "OPTIONS"
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # ---- OpenAI API ---------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        await self.control.enter("health")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": self.engine.cfg.model,
                "parent": None,
                "max_model_len": self.engine.cfg.max_model_len,
                "permission": [],
            }
            for name in self.names
        ]
        return web.json_response({"object": "list", "data": data + self.adapters.cards(now)})

    def _check_model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            return self.names[0]
        if not isinstance(model, str):
            raise bad_request("model: Input should be a valid string", "model")
        if model not in self.names and model not in self.adapters.paths:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model

    def _sampling(self, body: dict, prompt: str, prompt_tokens: int, *, chat: bool, model: str = "") -> Generation:
        max_tokens = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:
            max_tokens = body["max_completion_tokens"]
        if max_tokens is None:
            max_tokens = 16
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request("max_tokens must be at least 1, got {}.".format(max_tokens), "max_tokens")
        if prompt_tokens + max_tokens > self.engine.cfg.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.engine.cfg.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                "max_tokens",
            )
        n = body.get("n", 1)
        if n != 1 or isinstance(n, bool):
            raise bad_request("The simulated engine supports n=1 only.", "n")
        temperature = body.get("temperature", 1.0)  # vLLM's default when the model sets none
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            raise bad_request("temperature must be a non-negative number.", "temperature")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise bad_request("seed must be an integer.", "seed")
        for flag in ("stream", "ignore_eos"):
            if not isinstance(body.get(flag, False), bool):
                raise bad_request(f"{flag} must be a boolean.", flag)
        if not isinstance(body.get("stream_options") or {}, dict):
            raise bad_request("stream_options must be an object.", "stream_options")
        # Greedy decoding is deterministic; sampling is too only with a seed.
        if temperature == 0:
            salt = ""
        elif seed is not None:
            salt = f"seed:{seed}:{temperature}"
        else:
            salt = uuid.uuid4().hex
        salt = self.adapters.salt(model) + salt
        return Generation(prompt, prompt_tokens, max_tokens, bool(body.get("ignore_eos", False)), salt)

    @staticmethod
    def _completion_prompt(body: dict) -> tuple[str, int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p, lm.count_tokens(p)
        if _is_token_ids(p):
            return tokenizer.decode(p), len(p)
        raise bad_request("prompt must be a string, a list of token ids, or a list of one of those.", "prompt")

    @staticmethod
    def _chat_prompt(body: dict) -> tuple[str, int]:
        ids = (body.get("kv_transfer_params") or {}).get("prompt_token_ids") if isinstance(body.get("kv_transfer_params"), dict) else None
        if ids is not None:
            # vLLM takes these ids as the prompt instead of rendering the messages (online_renderer.py:105-153).
            if not _is_token_ids(ids):
                raise bad_request("kv_transfer_params.prompt_token_ids must be a list of token ids.", "kv_transfer_params")
            return tokenizer.decode(ids), len(ids)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("messages must be a non-empty list.", "messages")
        parts = []
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request("each message needs a string role.", "messages")
            content = m.get("content") or ""
            if isinstance(content, list):
                if not all(isinstance(c, dict) and isinstance(c.get("text", ""), str) for c in content):
                    raise bad_request("content parts must be objects with a text field.", "messages")
                content = " ".join(c.get("text", "") for c in content)
            elif not isinstance(content, str):
                raise bad_request("message content must be a string or a list of parts.", "messages")
            parts.append(f"<|{m['role']}|>\n{content}\n")
        rendered = "".join(parts) + "<|assistant|>\n"
        return rendered, lm.count_tokens(rendered)

    async def _enter_generate(self, request: web.Request, model: str, priority: object = None) -> None:
        # `priority` as vLLM's priority scheduling reads it (logged when the request carried one).
        extra = {} if priority is None else {"priority": priority}
        await self.control.enter("generate", path=request.path, model=model, **extra)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        model = self._check_model(body)
        prompt, ptoks = self._chat_prompt(body) if chat else self._completion_prompt(body)
        gen = self._sampling(body, prompt, ptoks, chat=chat, model=model)
        try:
            top = numerics.asked(body, chat)
        except ValueError as e:
            raise bad_request(str(e), "logprobs") from None
        if top is not None:
            gen.logprobs, gen.top_logprobs = [], top
        stream = bool(body.get("stream"))
        fault = None
        try:
            await self._enter_generate(request, model, body.get("priority"))
        except InjectedFault as e:
            # A stream promised as SSE breaks inside the stream; a 500 still comes first.
            if not stream or e.kind == "http500":
                raise
            fault = e.kind
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            opts = body.get("stream_options") or {}
            return await self._stream(request, gen, rid, created, model, chat, bool(opts.get("include_usage")), fault,
                                      body.get("return_token_ids") is True)
        texts = []
        try:
            async with contextlib.aclosing(self.engine.generate(gen)) as tokens:
                async for t in tokens:
                    texts.append(t)
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        text = "".join(texts)
        usage = usage_json(gen)
        logprobs = None if gen.logprobs is None else numerics.answer_logprobs(chat, texts, gen.logprobs, gen.top_logprobs)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None},
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": gen.finish_reason, "stop_reason": None}
            obj = "text_completion"
        return web.json_response(
            {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage,
             **answer_metrics(self.engine.cfg.per_request_spec_metrics, self.engine.k, gen.stats)}
        )

    async def _stream(
        self,
        request: web.Request,
        gen: Generation,
        rid: str,
        created: int,
        model: str,
        chat: bool,
        include_usage: bool,
        fault: str | None = None,
        token_ids: bool = False,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if fault == "malformed":
            # Well framed, so only a client that parses the event sees the fault.
            await resp.write(b"data: " + truncated_json(request.path) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = 0
        tokens_sent = 0
        cut_after = max(1, gen.max_tokens // 2) if fault == "cut" else None

        async def send(payload: dict) -> None:
            nonlocal sent
            # Compact, as vLLM's pydantic writes it (the router finds the ids fields by these bytes).
            await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
            sent += 1
            if self.crash_mid_stream is not None and sent >= self.crash_mid_stream:
                crash(f"simulated crash mid-stream after {sent} chunks")

        def chunk(choice: dict) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}

        # With return_token_ids vLLM gives the prompt's ids once (chat: on the role chunk; completions: in the first
        # choice) and each chunk's own ids (chat_completion/serving.py:560-570, 759; completion/serving.py:362-420).
        prompt_ids = tokenizer.encode(gen.prompt) if token_ids else None
        if chat:
            head = chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            if prompt_ids is not None:
                head["prompt_token_ids"] = prompt_ids
            await send(head)
        prompt_ids_due = not chat
        ids_sent = 0
        try:
            async with contextlib.aclosing(self.engine.generate(gen)) as tokens:
                async for t in tokens:
                    # A cut stream never shows a finish_reason, even when EOS comes early.
                    if cut_after is not None and tokens_sent and gen.finish_reason is not None:
                        await cut(request)
                    lp = None if gen.logprobs is None else numerics.answer_logprobs(chat, [t], gen.logprobs[-1:], gen.top_logprobs)
                    if chat:
                        c = {"index": 0, "delta": {"content": t}, "logprobs": lp}
                    else:
                        c = {"index": 0, "text": t, "logprobs": lp}
                    c["finish_reason"] = gen.finish_reason
                    c["stop_reason"] = None
                    if token_ids:
                        if prompt_ids_due:
                            c["prompt_token_ids"], prompt_ids_due = prompt_ids, False
                        c["token_ids"] = gen.token_ids[ids_sent:]
                        ids_sent = len(gen.token_ids)
                    await send(chunk(c))
                    tokens_sent += 1
                    if cut_after is not None and tokens_sent >= cut_after:
                        await cut(request)
        except GenerationAborted as e:
            await send({"error": {"message": str(e), "type": "InternalServerError", "param": None, "code": 500}})
        else:
            if include_usage:
                # vLLM puts the per-request metrics on this final usage chunk only
                # (vllm/entrypoints/openai/completion/serving.py:460).
                await send({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_json(gen),
                            **answer_metrics(self.engine.cfg.per_request_spec_metrics, self.engine.k, gen.stats)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = self._check_model(body)
        inp = body.get("input")
        if isinstance(inp, str) or _is_token_ids(inp):
            inp = [inp]
        if not isinstance(inp, list) or not inp or not all(isinstance(x, str) or _is_token_ids(x) for x in inp):
            raise bad_request("input must be a string, a list of strings, or token ids.", "input")
        texts = [x if isinstance(x, str) else " ".join(map(str, x)) for x in inp]
        ptoks = sum(lm.count_tokens(t) if isinstance(x, str) else len(x) for t, x in zip(texts, inp))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise bad_request("encoding_format must be 'float' or 'base64'.", "encoding_format")
        await self._enter_generate(request, model, body.get("priority"))
        # A pooling request still waits for the engine to be awake.
        gen = Generation("\n".join(texts), ptoks, 0, True, "")
        try:
            async with contextlib.aclosing(self.engine.generate(gen)) as it:
                async for _ in it:
                    pass
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        data = []
        for i, t in enumerate(texts):
            vec = self.engine.embed(t)
            data.append({"index": i, "object": "embedding", "embedding": lm.embedding_base64(vec) if fmt == "base64" else vec})
        return web.json_response(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks, "completion_tokens": 0, "prompt_tokens_details": None},
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        await self.control.enter("metrics")
        return web.Response(body=self.engine.render_metrics(), headers={"Content-Type": CONTENT_TYPE})

def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def usage_json(gen: Generation) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "completion_tokens": gen.completion_tokens,
        "prompt_tokens_details": None,
    }
