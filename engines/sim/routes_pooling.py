"""The simulated engine's pooling and tokenizer routes, in vLLM 0.33's shapes:
`/score` `/v1/score`, `/rerank` `/v1/rerank` `/v2/rerank`, `/pooling`, `/classify`,
`/v2/embed` (Cohere's shape), `/tokenize`, `/detokenize`.

Scores come from the simulated embedding (cosine similarity), so they are deterministic
per model and move when the weights are junk, like every other output of the simulator.
The tokenizer is the simulated model's own (tokenizer.py): detokenize is the exact inverse of tokenize.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from . import lm, tokenizer
from .http import bad_request, error_response, read_json
from .state import Generation, GenerationAborted

if TYPE_CHECKING:
    from .server import SimServer

LABELS = ("negative", "positive")


def add_routes(app: web.Application, server: "SimServer") -> None:
    routes = PoolingRoutes(server)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, routes.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, routes.rerank)
    app.router.add_post("/pooling", routes.pooling)
    app.router.add_post("/classify", routes.classify)
    app.router.add_post("/v2/embed", routes.cohere_embed)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)


def _texts(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise bad_request(f"{param} must be a string or a non-empty list of strings.", param)


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


class PoolingRoutes:
    def __init__(self, server: "SimServer") -> None:
        self.server = server

    async def _pass(self, request: web.Request, model: str, texts: list[str], priority: object = None) -> int:
        """Wait for an awake engine, as vLLM's pooling requests do; the prompt token count. `priority`: the
        body's, which vLLM 0.32's pooling requests take (entrypoints/pooling/base/protocol.py:70)."""
        await self.server._enter_generate(request, model, priority)
        tokens = sum(lm.count_tokens(t) for t in texts)
        gen = Generation("\n".join(texts), tokens, 0, True, "")
        async with contextlib.aclosing(self.server.engine.generate(gen)) as it:
            async for _ in it:
                pass
        return tokens

    def _score(self, a: str, b: str) -> float:
        ea, eb = self.server.engine.embed(a), self.server.engine.embed(b)
        return round((1 + sum(x * y for x, y in zip(ea, eb))) / 2, 6)  # cosine mapped to [0, 1]

    async def score(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = self.server._check_model(body)
        for left, right in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
            if left in body and right in body:
                break
        else:
            raise bad_request("score needs queries and documents (or text_1 and text_2).", "queries")
        one, two = _texts(body[left], left), _texts(body[right], right)
        if len(one) != 1 and len(one) != len(two):
            raise bad_request(f"{left} must be one text or as many as {right}.", left)
        pairs = [(one[0] if len(one) == 1 else one[i], t) for i, t in enumerate(two)]
        try:
            tokens = await self._pass(request, model, [x for p in pairs for x in p], body.get("priority"))
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        return web.json_response({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": self._score(a, b)} for i, (a, b) in enumerate(pairs)],
            "usage": _usage(tokens),
        })

    async def rerank(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = self.server._check_model(body)
        query = body.get("query")
        if not isinstance(query, str):
            raise bad_request("query must be a string.", "query")
        docs = _texts(body.get("documents"), "documents")
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise bad_request("top_n must be an integer >= 0.", "top_n")
        try:
            tokens = await self._pass(request, model, [query, *docs], body.get("priority"))
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        results = sorted(({"index": i, "document": {"text": d, "multi_modal": None}, "relevance_score": self._score(query, d)}
                          for i, d in enumerate(docs)), key=lambda r: -r["relevance_score"])
        return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                                  "results": results[:top_n] if top_n else results})

    async def pooling(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = self.server._check_model(body)
        texts = _texts(body.get("input"), "input")
        try:
            tokens = await self._pass(request, model, texts, body.get("priority"))
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        return web.json_response({
            "id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "pooling", "data": self.server.engine.embed(t)} for i, t in enumerate(texts)],
            "usage": _usage(tokens),
        })

    async def classify(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = self.server._check_model(body)
        texts = _texts(body.get("input"), "input")
        try:
            tokens = await self._pass(request, model, texts, body.get("priority"))
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        data = []
        for i, t in enumerate(texts):
            p = self._score(t, "positive")
            probs = [round(1 - p, 6), p]
            data.append({"index": i, "label": LABELS[probs.index(max(probs))], "probs": probs, "num_classes": 2})
        return web.json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                                  "model": model, "data": data, "usage": _usage(tokens)})

    async def cohere_embed(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = self.server._check_model(body)
        texts = _texts(body.get("texts"), "texts")
        types = body.get("embedding_types") or ["float"]
        if not isinstance(types, list) or any(t not in ("float", "base64") for t in types):
            raise bad_request("embedding_types: the simulator serves 'float' and 'base64'.", "embedding_types")
        try:
            tokens = await self._pass(request, model, texts, body.get("priority"))
        except GenerationAborted as e:
            return error_response(500, str(e), "InternalServerError")
        vectors = [self.server.engine.embed(t) for t in texts]
        embeddings: dict[str, Any] = {"float": None, "binary": None, "ubinary": None, "base64": None}
        if "float" in types:
            embeddings["float"] = vectors
        if "base64" in types:
            embeddings["base64"] = [lm.embedding_base64(v) for v in vectors]
        return web.json_response({
            "id": f"embd-{uuid.uuid4().hex}", "embeddings": embeddings, "texts": texts,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens, "image_tokens": None}},
            "response_type": "embeddings_by_type",
        })

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.server._check_model(body)
        if "messages" in body:
            text, _ = self.server._chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise bad_request("tokenize needs a string prompt or chat messages.", "prompt")
        ids = ([1] if body.get("add_special_tokens", True) and "messages" not in body else []) + tokenizer.encode(text)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.server.engine.cfg.max_model_len, "tokens": ids,
                                  "token_strs": None}
        if body.get("return_token_strs"):
            answer["token_strs"] = ["<s>" if i == 1 else tokenizer.decode([i]) for i in ids]
        return web.json_response(answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.server._check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad_request("tokens must be a list of non-negative integers.", "tokens")
        return web.json_response({"prompt": tokenizer.decode(ids)})
