"""The proxied routes (see `router.proxy.routes`): pick the engine, take a lease, forward, release.

Every route goes through the same queue, lease and gate as chat completions: a request for
a parked model wakes it. The engine comes from `router.lookup` (roster names and aliases),
from the LoRA adapters the engines serve, from the roster's default model when the request
names none, or, for Responses follow-ups, retrieve and cancel, from the engine that created
the response.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional
from urllib.parse import quote

from aiohttp import web

from engines.engine import Engine
from router.proxy import keepalive, multipart, routes
from router.auth import grant_of
from router.errors import APIError, sse_error
from router.keys import Grant
from router.live import ROUTER_KEY
from router.metrics import UNKNOWN_MODEL
from router.proxy.forward import forward, json_for
from router.proxy.responses import ResponseIds, StreamSniffer, id_in_answer

RESPONSE_IDS_KEY = web.AppKey("response_ids", ResponseIds)
MAX_WAIT_HEADER = "X-Hotswap-Max-Wait"


def max_wait(request: web.Request) -> Optional[float]:
    """The client's X-Hotswap-Max-Wait: answer 503 at once rather than wait longer than this for a wake."""
    text = request.headers.get(MAX_WAIT_HEADER)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise APIError(400, f"{MAX_WAIT_HEADER} must be a number of seconds >= 0 (found {text[:40]!r})", "invalid_header")
    return seconds


def default_model(router, grant: Grant) -> str:
    for m in router.roster.models:
        if m.default and grant.may_use(m.names):
            return m.name
    raise APIError(400, "The request names no 'model' and the roster has no default model (`default: true`). "
                        f"Name one of: {router.usable_names(grant)}", "missing_model", param="model")


def resolve(router, model: Any, grant: Grant) -> Engine:
    """The engine for a request's `model` (None: the roster's default), if `grant` may use it."""
    if model is None:
        model = default_model(router, grant)
    elif not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be a non-empty string naming a model from GET /v1/models.", "missing_model", param="model")
    if model in router.by_name:
        return router.lookup(model, grant)
    for candidate in router.engines.values():  # a LoRA adapter (or other served name) an engine reported
        if model in candidate.other_names and not candidate.retiring and (grant.may_use([model]) or grant.may_use(candidate.spec.names)):
            return candidate
    raise router.unknown_model(model, grant)


async def proxy_endpoint(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    route = routes.BY_PATH[request.match_info.route.resource.canonical]  # type: ignore[union-attr]
    started = time.monotonic()
    label, group, status, stream, queued_s = UNKNOWN_MODEL, "", 500, "false", None
    try:
        if route.multipart:
            form = await multipart.read_form(request, int(router.roster.listen.max_body_mb * 1024 * 1024))
            engine = resolve(router, form.value("model"), grant_of(request))
            stream = "true" if (form.value("stream") or "").lower() == "true" else "false"
        else:
            body = await _json_body(request)
            engine = _engine_for(request, router, body, route)
            stream = "true" if body.get("stream") is True else "false"
        label, group = engine.name, engine.spec.group or ""
        scheduler = router.scheduler(engine)
        prepared = None
        interval = router.roster.queue.stream_keepalive_s
        limit = max_wait(request)
        if interval and stream == "true":
            prepared = await keepalive.acquire(request, scheduler, engine, interval, route.anthropic, max_wait_s=limit)
        else:
            await scheduler.acquire(engine, max_wait_s=limit)
        queued_s = time.monotonic() - started
        try:
            if route.multipart:
                model = form.value("model")
                form_type, data = await form.encode(model if model in engine.served_names else engine.served_name)
                response = await forward(request, router.upstreams, engine, route.path, data, content_type=form_type,
                                         prepared=prepared, stall_s=router.roster.queue.stall_timeout_s)
            else:
                kw = _pinning(request, engine, body) if route.creates_response else {}
                response = await forward(request, router.upstreams, engine, route.path, json_for(engine, body, request["raw_body"]),
                                         prepared=prepared, anthropic=route.anthropic, stall_s=router.roster.queue.stall_timeout_s, **kw)
        except APIError as exc:
            if prepared is None:
                raise
            await prepared.write(sse_error(exc.message, exc.code, status=exc.status, anthropic=route.anthropic))
            await prepared.write_eof()
            raise keepalive.AnsweredInStream(prepared, exc.status) from None
        finally:
            scheduler.release(engine)
        status = response.status
        return response
    except keepalive.AnsweredInStream as exc:
        status = exc.status
        return exc.response
    except APIError as exc:
        status = exc.status
        raise
    finally:
        done = time.monotonic()
        router.metrics.request_done(label, group, route.endpoint, stream, status, queued_s, request.get("first_byte_at", done) - started,
                                    done - started, key=grant_of(request).name)


def _engine_for(request: web.Request, router, body: dict[str, Any], route: routes.Route) -> Engine:
    model = body.get("model")
    if model is None and route.creates_response:
        # A follow-up without a model continues where its conversation lives.
        previous = body.get("previous_response_id")
        pinned = request.app[RESPONSE_IDS_KEY].engine_of(previous) if isinstance(previous, str) else None
        engine = _usable(router, pinned, grant_of(request))
        if engine is not None:
            return engine
    return resolve(router, model, grant_of(request))


def _usable(router, name: Optional[str], grant: Grant) -> Optional[Engine]:
    """The engine a response was pinned to, unless it has left the roster or `grant` may not use it."""
    engine = router.engines.get(name) if name is not None else None
    if engine is None or engine.retiring or not grant.may_use(engine.spec.names):
        return None
    return engine


def _pinning(request: web.Request, engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    ids = request.app[RESPONSE_IDS_KEY]

    def remember(response_id: str) -> None:
        ids.remember(response_id, engine.name)

    if body.get("stream") is True:
        return {"sniffer": StreamSniffer(remember)}
    return {"on_answer": lambda payload: (rid := id_in_answer(payload)) and remember(rid)}


async def response_pinned(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, on the engine that created it."""
    router = request.app[ROUTER_KEY]
    response_id = request.match_info["response_id"]
    started, status, label, group = time.monotonic(), 500, UNKNOWN_MODEL, ""
    cancel = request.path.endswith("/cancel")
    try:
        engine = _usable(router, request.app[RESPONSE_IDS_KEY].engine_of(response_id), grant_of(request))
        if engine is None:
            raise APIError(404, f"Response with id '{response_id}' not found (the router pins the responses it saw "
                                "created, for a bounded time).", "response_not_found", param="response_id")
        label, group = engine.name, engine.spec.group or ""
        path = f"/v1/responses/{quote(response_id, safe='')}" + ("/cancel" if cancel else "")
        params = {k: v for k, v in request.query.items() if k in ("starting_after", "stream")}
        scheduler = router.scheduler(engine)
        await scheduler.acquire(engine, max_wait_s=max_wait(request))
        try:
            response = await forward(request, router.upstreams, engine, path + ("?" + "&".join(
                f"{k}={quote(v, safe='')}" for k, v in params.items()) if params else ""),
                method="POST" if cancel else "GET", content_type=None, stall_s=router.roster.queue.stall_timeout_s)
        finally:
            scheduler.release(engine)
        status = response.status
        return response
    except APIError as exc:
        status = exc.status
        raise
    finally:
        done = time.monotonic()
        router.metrics.request_done(label, group, "responses", "false", status, None, request.get("first_byte_at", done) - started,
                                    done - started, key=grant_of(request).name)


async def _json_body(request: web.Request) -> dict[str, Any]:
    # vLLM refuses anything but application/json; saying so here spares a wake for a request it would refuse.
    if request.content_type != "application/json" and not request.content_type.endswith("+json"):
        raise APIError(400, f"{request.path} takes a JSON body with Content-Type: application/json "
                            f"(got {request.headers.get('Content-Type', 'none')!r}).", "invalid_content_type")
    raw = await request.read()
    request["raw_body"] = raw
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_request")
    return body

