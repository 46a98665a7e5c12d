"""The router's own request handlers: models, health, readiness, metrics, admin, /ui, and the
error middleware. The proxied routes are in `router.proxy.endpoint` (table: `router.proxy.routes`).

Nothing but the routes in `app.build_app` exists. The engines' dev endpoints (`/sleep`,
`/wake_up`, `/collective_rpc`, ...) are never forwarded, whatever the path spelling: there
is no catch-all route, and the upstream path is the route's own constant, not the client's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from aiohttp import web

from router import node
from router.admin import lora, ui
from router.auth import grant_of
from config import RosterError
from router.errors import APIError, anthropic_path, error_body, error_response
from router.keys import Grant
from router.admin.status import engine_status, router_status

log = logging.getLogger("hotswap")

ROUTER_KEY = web.AppKey("router", "Router")
MAX_WAIT_HEADER = "X-Hotswap-Max-Wait"
DRAINING_RETRY_AFTER_S = 5  # what the scheduler tells refused requests while shutting down, too


def _model_cards(router, grant: Grant) -> list[dict]:
    """Every name `grant` may use: roster names and aliases, then the engines' LoRA adapters."""
    scheduler = router.placement
    now = scheduler.clock()
    where = node.card(router.roster)

    def card(name: str, engine, parent, root) -> dict:
        return {"id": name, "object": "model", "created": router.started, "owned_by": "hotswap", "root": root,
                "parent": parent, "state": engine.state.value, "group": engine.spec.group,
                "wake_estimate_s": round(scheduler.predicted_wait(engine, now), 2), "node": where}

    cards = [card(name, engine, None if name == engine.name else engine.name, engine.spec.model or engine.spec.url or engine.name)
             for name, engine in router.by_name.items() if grant.may_use(engine.spec.names)]
    # An adapter's parent is its engine's roster name: the name clients use (vLLM's card says the served name).
    return cards + [card(name, engine, engine.name, root) for name, engine, root in lora.adapters(router)
                    if grant.may_use([name]) or grant.may_use(engine.spec.names)]


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


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_cards(request.app[ROUTER_KEY], grant_of(request))})


async def get_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    for card in _model_cards(request.app[ROUTER_KEY], grant_of(request)):
        if card["id"] == model_id:
            return web.json_response(card)
    raise APIError(404, f"The model '{model_id}' does not exist.", "model_not_found", param="model")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    promoted = [e.name for e in router.engines.values() if e.promoted]
    serviceable = [e.name for e in router.engines.values() if e.serviceable]
    body = {"ready": router.ready and not router.draining, "draining": router.draining, "promoted": promoted,
            "serviceable": serviceable}
    # Draining for shutdown: a front that polls /ready takes the node out of rotation now,
    # while it still answers (new work gets 503 + Retry-After, in-flight work finishes).
    headers = {"Retry-After": str(DRAINING_RETRY_AFTER_S)} if router.draining else None
    return web.json_response(body, status=200 if body["ready"] else 503, headers=headers)


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


async def admin_reload(request: web.Request) -> web.Response:
    """POST /admin/reload: apply the --config file as it is now, or say why not (nothing changed)."""
    router = request.app[ROUTER_KEY]
    try:
        changes = await router.reloads.reload("POST /admin/reload")
    except RosterError as exc:
        errors = [str(issue) for issue in exc.issues]
        body = error_body(422, f"{router.roster.source}: {len(errors)} error(s); nothing changed, the roster in force is "
                               f"still served. First: {errors[0]}", "invalid_roster")
        return web.json_response({**body, "errors": errors}, status=422)
    return web.json_response({"applied": True, "source": router.roster.source, "changes": changes.as_dict(),
                              "summary": changes.summary()})


async def admin_lora(request: web.Request) -> web.Response:
    return await lora.admin_lora(request, request.app[ROUTER_KEY])


async def status_page(request: web.Request) -> web.Response:
    return web.Response(text=ui.render(router_status(request.app[ROUTER_KEY])), content_type="text/html")


@web.middleware
async def api_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error the router produces, in the shape of the route (Anthropic's on /v1/messages*)."""
    anthropic = anthropic_path(request.path)
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response(anthropic)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"The request body is larger than listen.max_body_mb ({exc.text}).", "body_too_large", anthropic=anthropic)
    except web.HTTPNotFound:
        return error_response(404, f"No route {request.method} {request.path}. See README's HTTP surface table for the routes "
                                   "hotswap serves.", "not_found", anthropic=anthropic)
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"{request.method} is not allowed on {request.path} (allowed: {', '.join(sorted(exc.allowed_methods))}).",
                              "method_not_allowed", anthropic=anthropic)
    except web.HTTPException as exc:
        return error_response(exc.status, exc.reason, "http_error", anthropic=anthropic)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "Internal error in the router (logged).", "internal_error", anthropic=anthropic)
