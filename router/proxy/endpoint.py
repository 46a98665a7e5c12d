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
from router.fleet import PEERS_KEY
from router.errors import APIError, sse_error
from router.keys import Grant
from router.live import ROUTED_MODEL, ROUTER_KEY
from router.metrics import UNKNOWN_MODEL
from router.proxy.body import read_json
from router.proxy.forward import ANSWER_END, forward, json_for
from router.proxy.responses import Pin, ResponseIds, StreamSniffer, id_in_answer
from router.scheduling import Lease

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
        if m.default and m.name in router.engines and grant.allows(router.engines[m.name], m.name):
            return m.name
    raise APIError(400, "The request names no 'model' and the roster has no default model (`default: true`). "
                        f"Name one of: {router.usable_names(grant)}", "missing_model", param="model")


def resolve(router, model: Any, grant: Grant) -> tuple[Engine, str]:
    """The engine for a request's `model` (None: the roster's default), if `grant` may use it, and the name it was asked by."""
    if model is None:
        model = default_model(router, grant)
    elif not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be a non-empty string naming a model from GET /v1/models.", "missing_model", param="model")
    if model in router.by_name:
        return router.lookup(model, grant), model
    for candidate in router.engines.values():  # a LoRA adapter (or other served name) an engine reported
        if model in candidate.other_names and not candidate.retiring and grant.allows(candidate, model):
            return candidate, model
    raise router.unknown_model(model, grant)


async def proxy_endpoint(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    route = routes.BY_PATH[request.match_info.route.resource.canonical]  # type: ignore[union-attr]
    started = time.monotonic()
    label, group, status, stream, queued_s = UNKNOWN_MODEL, "", 500, "false", None
    asked: Any = None
    lease: Optional[Lease] = None
    try:
        if route.multipart:
            form = await multipart.read_form(request, router.roster.listen)
            asked = form.value("model")
            engine, _ = resolve(router, asked, grant_of(request))
            stream = "true" if (form.value("stream") or "").lower() == "true" else "false"
        else:
            body, raw = await read_json(request, router.roster.listen)
            asked = body.get("model")
            try:
                engine, name = _engine_for(request, router, body, route)
            except APIError as exc:
                if exc.code != "model_not_found":
                    raise
                # Not a model of this node: a peer may serve it (a front that could not read `model` sent it here).
                response = await request.app[PEERS_KEY].hand_off(request, router, route.path, raw, body["model"], exc)
                status = response.status
                return response
            if body.get("model") is None and name in engine.other_names:
                # A follow-up of an adapter's conversation stays on the adapter (a key may be scoped to it alone).
                body["model"] = name
                raw = json.dumps(body).encode()
            stream = "true" if body.get("stream") is True else "false"
        label, group = engine.name, engine.spec.group or ""
        request[ROUTED_MODEL] = engine.name
        scheduler = router.placement
        prepared = None
        interval = router.roster.queue.stream_keepalive_s
        limit = max_wait(request)
        if interval and stream == "true":
            prepared, lease = await keepalive.acquire(request, scheduler, engine, interval, route.anthropic, max_wait_s=limit)
        else:
            lease = await scheduler.acquire(engine, max_wait_s=limit)
        queued_s = time.monotonic() - started
        try:
            if route.multipart:
                model = form.value("model")
                form_type, data = await form.encode(model if model in engine.served_names else engine.served_name)
                response = await forward(request, router.upstreams, engine, route.path, data, content_type=form_type,
                                         prepared=prepared, stall_s=router.roster.queue.stall_timeout_s,
                                         keep_tail=router.activity.wants_answers)
            else:
                kw = _pinning(request, engine, name, body) if route.creates_response else {}
                response = await forward(request, router.upstreams, engine, route.path, json_for(engine, body, raw),
                                         prepared=prepared, anthropic=route.anthropic,
                                         stall_s=router.roster.queue.stall_timeout_s,
                                         keep_tail=router.activity.wants_answers, **kw)
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
        first_byte_s = request.get("first_byte_at", done) - started
        router.metrics.request_done(label, group, route.endpoint, stream, status, queued_s, first_byte_s,
                                    done - started, key=grant_of(request).name)
        _record(request, router, asked, label, route.endpoint, status, lease, queued_s,
                first_byte_s if stream == "true" else None, done - started)


def _record(request: web.Request, router, asked: Any, label: str, endpoint: str, status: int, lease: Optional[Lease],
            queued_s: Optional[float], ttfb_s: Optional[float], duration_s: float) -> None:
    """The request's line in the activity log (router.admin.activity)."""
    router.activity.request_done(
        key_name=grant_of(request).name, model=asked, engine=None if label == UNKNOWN_MODEL else label, endpoint=endpoint,
        status=status, found_awake=None if lease is None else lease.found_awake, swap_id=None if lease is None else lease.swap_id,
        queue_wait_s=queued_s, ttfb_s=ttfb_s, duration_s=duration_s, answer=request.get(ANSWER_END))


def _engine_for(request: web.Request, router, body: dict[str, Any], route: routes.Route) -> tuple[Engine, str]:
    model = body.get("model")
    if model is None and route.creates_response:
        # A follow-up without a model continues where its conversation lives, under the name it was started with.
        previous = body.get("previous_response_id")
        pin = request.app[RESPONSE_IDS_KEY].pin(previous) if isinstance(previous, str) else None
        engine = _usable(router, pin, grant_of(request))
        if engine is not None and pin is not None:
            return engine, pin.model
    return resolve(router, model, grant_of(request))


def _usable(router, pin: Optional[Pin], grant: Grant) -> Optional[Engine]:
    """The engine a response was pinned to, unless it has left the roster or `grant` may not use it
    under the name the response was created with (the same check as resolution's)."""
    engine = router.engines.get(pin.engine) if pin is not None else None
    if engine is None or pin is None or engine.retiring or not grant.allows(engine, pin.model):
        return None
    return engine


def _pinning(request: web.Request, engine: Engine, name: str, body: dict[str, Any]) -> dict[str, Any]:
    ids = request.app[RESPONSE_IDS_KEY]

    def remember(response_id: str) -> None:
        ids.remember(response_id, engine.name, name)

    if body.get("stream") is True:
        return {"sniffer": StreamSniffer(remember)}
    return {"on_answer": lambda payload: (rid := id_in_answer(payload)) and remember(rid)}


async def response_pinned(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, on the engine that created it."""
    router = request.app[ROUTER_KEY]
    response_id = request.match_info["response_id"]
    started, status, label, group = time.monotonic(), 500, UNKNOWN_MODEL, ""
    lease: Optional[Lease] = None
    cancel = request.path.endswith("/cancel")
    try:
        engine = _usable(router, request.app[RESPONSE_IDS_KEY].pin(response_id), grant_of(request))
        if engine is None:
            raise APIError(404, f"Response with id '{response_id}' not found (the router pins the responses it saw "
                                "created, for a bounded time).", "response_not_found", param="response_id")
        label, group = engine.name, engine.spec.group or ""
        request[ROUTED_MODEL] = engine.name
        path = f"/v1/responses/{quote(response_id, safe='')}" + ("/cancel" if cancel else "")
        params = {k: v for k, v in request.query.items() if k in ("starting_after", "stream")}
        scheduler = router.placement
        lease = await scheduler.acquire(engine, max_wait_s=max_wait(request))
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
        _record(request, router, None, label, "responses", status, lease, None, None, done - started)
