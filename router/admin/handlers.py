"""The operators' routes: /admin/status, /admin/timeline, /admin/{swap,sleep,restart}, /admin/reload,
/admin/lora/{load,unload} and the /ui page. `router.auth` lets only the admin key (or, without
one, loopback) reach them."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from config import RosterError
from router.admin import lora, timeline, ui
from router.admin.reload import Reloads
from router.admin.status import engine_status, router_status
from router.errors import APIError, error_body
from router.live import ROUTED_MODEL, ROUTER_KEY

log = logging.getLogger("hotswap")

RELOADS_KEY = web.AppKey("reloads", Reloads)


async def admin_status(request: web.Request) -> web.Response:
    return web.json_response(router_status(request.app[ROUTER_KEY], request.app[RELOADS_KEY]))


async def admin_timeline(request: web.Request) -> web.Response:
    return web.json_response(timeline.timeline(request.app[ROUTER_KEY].history, request.query))


async def admin_action(request: web.Request) -> web.Response:
    """POST /admin/{swap,sleep,restart}?model=NAME: swap a model in, put it to sleep, or cold-restart it."""
    router = request.app[ROUTER_KEY]
    action = request.match_info["action"]
    model = request.query.get("model")
    if not model:
        raise APIError(400, f"POST /admin/{action} needs ?model=NAME", "missing_model", param="model")
    engine = router.lookup(model)
    request[ROUTED_MODEL] = engine.name
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
        changes = await request.app[RELOADS_KEY].reload("POST /admin/reload")
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
    router = request.app[ROUTER_KEY]
    page = ui.render(router_status(router, request.app[RELOADS_KEY]), timeline.window(router.history, timeline.UI_MINUTES))
    return web.Response(text=page, content_type="text/html")
