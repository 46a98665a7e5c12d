"""The operators' routes: /admin/status, /admin/timeline, /admin/activity, /admin/{swap,sleep,restart}, /admin/reload,
/admin/lora/{load,unload} and the /ui page. `router.auth` lets only the admin key (or, without
one, loopback) reach them."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, cast

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from config import RosterError
from router.admin import lora, timeline, ui, ui_activity
from router.admin.activity import ActivityLog
from router.admin.reload import Reloads
from router.admin.status import engine_status, router_status
from router.errors import APIError, error_body
from router.fleet import PEERS_KEY
from router.live import ROUTED_MODEL, ROUTER_KEY

log = logging.getLogger("hotswap")

RELOADS_KEY = web.AppKey("reloads", Reloads)


class ActivityQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = Field(None, min_length=1)  # asked by that name, or served by that engine
    since: Optional[float] = Field(None, ge=0, allow_inf_nan=False)  # epoch seconds: records that ended after it
    limit: int = Field(100, ge=1, le=10_000)


async def admin_status(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return web.json_response({**router_status(router, request.app[RELOADS_KEY]), "peers": request.app[PEERS_KEY].status(router.roster)})


async def admin_timeline(request: web.Request) -> web.Response:
    return web.json_response(timeline.timeline(request.app[ROUTER_KEY].history, request.query))


async def admin_activity(request: web.Request) -> web.Response:
    """GET /admin/activity?model=&since=&limit=: the newest records first (see router.admin.activity)."""
    activity = cast(ActivityLog, request.app[ROUTER_KEY].activity)  # the one app.build_router handed the Router
    try:
        query = ActivityQuery.model_validate(dict(request.query))
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(map(str, first["loc"]))
        raise APIError(400, f"?{name}: {first['msg']} (found {str(first.get('input'))[:40]!r})", "invalid_parameter",
                       param=name) from None
    records = activity.query(query.model, query.since, query.limit)
    return web.json_response({"enabled": activity.enabled, "records": [r.as_dict() for r in records]})


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
    """GET /ui[?model=NAME]: the status page; `model` filters its recent requests."""
    router = request.app[ROUTER_KEY]
    activity = cast(ActivityLog, router.activity)
    model = request.query.get("model") or None
    recent = ui_activity.recent_requests(activity.query(model, limit=ui_activity.ROWS), sorted(router.engines), model,
                                         activity.enabled)
    page = ui.render(router_status(router, request.app[RELOADS_KEY]), timeline.window(router.history, timeline.UI_MINUTES), recent)
    return web.Response(text=page, content_type="text/html")
