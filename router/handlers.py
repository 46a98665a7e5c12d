"""The router's request handlers: the OpenAI proxy, models, health, readiness, metrics, admin, /ui.

Nothing but the routes in `app.build_app` exists. The engines' dev endpoints (`/sleep`,
`/wake_up`, `/collective_rpc`, ...) are never forwarded, whatever the path spelling: there
is no catch-all route, and the upstream path is the route's own constant, not the client's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

from aiohttp import web

from router import ui
from router.errors import APIError, error_response
from router.metrics import UNKNOWN_MODEL
from router.proxy import forward
from router.status import engine_status, router_status

log = logging.getLogger("hotswap")

OPENAI_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
ROUTER_KEY = web.AppKey("router", "Router")
MAX_WAIT_HEADER = "X-Hotswap-Max-Wait"


async def openai_endpoint(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    path = request.match_info.route.resource.canonical  # type: ignore[union-attr]
    endpoint = OPENAI_ROUTES[path]
    started = time.monotonic()
    label, group = UNKNOWN_MODEL, ""
    status = 500
    stream = "false"
    queued_s = None
    try:
        body = await _json_body(request)
        engine = router.lookup(body["model"])
        label, group = engine.name, engine.spec.group or ""
        stream = "true" if body.get("stream") is True else "false"
        scheduler = router.scheduler(engine)
        await scheduler.acquire(engine, max_wait_s=_max_wait(request))
        queued_s = time.monotonic() - started
        try:
            response = await forward(request, router.proxy_session, engine, path, body, request["raw_body"])
        finally:
            scheduler.release(engine)
        status = response.status
        return response
    except APIError as exc:
        status = exc.status
        raise
    finally:
        done = time.monotonic()
        router.metrics.request_done(label, group, endpoint, stream, status, queued_s, request.get("first_byte_at", done) - started, done - started)


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    request["raw_body"] = raw
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_request")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "The request needs a 'model' (a string naming a model from GET /v1/models).", "missing_model", param="model")
    return body


def _max_wait(request: web.Request) -> Optional[float]:
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


async def list_models(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    scheduler = router.placement
    now = scheduler.clock()
    data = [
        {"id": name, "object": "model", "created": router.started, "owned_by": "hotswap",
         "root": engine.spec.model or engine.spec.url or engine.name, "parent": None if name == engine.name else engine.name,
         "state": engine.state.value, "group": engine.spec.group,
         "wake_estimate_s": round(scheduler.predicted_wait(engine, now), 2)}
        for name, engine in router.by_name.items()
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    promoted = [e.name for e in router.engines.values() if e.promoted]
    serviceable = [e.name for e in router.engines.values() if e.serviceable]
    return web.json_response({"ready": router.ready, "promoted": promoted, "serviceable": serviceable},
                             status=200 if router.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ROUTER_KEY].metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def admin_status(request: web.Request) -> web.Response:
    return web.json_response(router_status(request.app[ROUTER_KEY]))


async def admin_action(request: web.Request) -> web.Response:
    """POST /admin/{swap,sleep,restart}?model=NAME: swap a model in, put it to sleep, or cold-restart it."""
    router = request.app[ROUTER_KEY]
    action = request.match_info["action"]
    model = request.query.get("model")
    if not model:
        raise APIError(400, f"POST /admin/{action} needs ?model=NAME", "missing_model", param="model")
    engine = router.lookup(model)
    scheduler = router.scheduler(engine)
    run = {"swap": scheduler.swap_in, "sleep": scheduler.sleep, "restart": scheduler.restart}[action]
    log.info("admin: %s %s", action, engine.name)
    try:
        async with asyncio.timeout(router.roster.queue.max_wait_s + router.roster.swap.boot_timeout_s):
            result = await run(engine)
    except TimeoutError:
        raise APIError(504, f"{action} {engine.name} is still running; watch /admin/status", "admin_timeout") from None
    return web.json_response({"model": engine.name, "action": action, "result": result, "engine": engine_status(router, engine)})


async def status_page(request: web.Request) -> web.Response:
    return web.Response(text=ui.render(router_status(request.app[ROUTER_KEY])), content_type="text/html")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"The request body is larger than listen.max_body_mb ({exc.text}).", "body_too_large")
    except web.HTTPNotFound:
        return error_response(404, f"No route {request.method} {request.path}. hotswap serves /v1/chat/completions, "
                                   "/v1/completions, /v1/embeddings, /v1/models, /health, /ready, /metrics, /admin/*.", "not_found")
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"{request.method} is not allowed on {request.path} (allowed: {', '.join(sorted(exc.allowed_methods))}).", "method_not_allowed")
    except web.HTTPException as exc:
        return error_response(exc.status, exc.reason, "http_error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "Internal error in the router (logged).", "internal_error")
