"""The operators' routes: /admin/status, /admin/timeline, /admin/activity, /admin/{swap,sleep,restart}, /admin/drill,
/admin/hold, /admin/reload, /admin/lora/{load,unload} and the /ui page. `router.auth` lets only the admin key (or, without
one, loopback) reach them."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from typing import Annotated, Awaitable, Callable, Mapping, Optional, TypeVar, cast

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from config import RosterError
from engines.engine import Engine
from router.admin import lora, timeline, ui, ui_activity
from router.admin.activity import ActivityLog
from router.admin.reload import Reloads
from router.admin.status import engine_status, router_status
from router.errors import APIError, error_body, json_answer
from router.fleet import PEERS_KEY
from router.keys import HOLD_MAX_S, HeldElsewhere
from router.live import ROUTED_MODEL, ROUTER_KEY

log = logging.getLogger("hotswap")

RELOADS_KEY = web.AppKey("reloads", Reloads)


Query = TypeVar("Query", bound=BaseModel)


def parse_query(model: type[Query], query: Mapping[str, str]) -> Query:
    """A route's query parameters, validated by their pydantic model (unknown ones refused): the one way
    /admin/* reads them, and one error for all, a 400 `invalid_parameter` naming the first bad one."""
    try:
        return model.model_validate(dict(query))
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(map(str, first["loc"])) or "query"
        field = model.model_fields.get(name)
        wanted = f"; {name}: {field.description}" if field is not None and field.description else ""
        raise APIError(400, f"?{name}: {first['msg']} (found {str(first.get('input'))[:40]!r}){wanted}", "invalid_parameter",
                       param=name) from None


def _written(pattern: str, what: str):
    """Only numbers written plainly: pydantic alone would take `1_0`, ` 10` or `10.0` for a count."""
    def check(value: object) -> object:
        if isinstance(value, str) and not re.fullmatch(pattern, value):
            raise ValueError(f"{what} written in digits")
        return value
    return BeforeValidator(check)


WholeNumber = Annotated[int, _written(r"[0-9]+", "a whole number")]
Number = Annotated[float, _written(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", "a number")]


class ActivityQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = Field(None, min_length=1, description="requests for it: asked by that name, or served by that engine")
    since: Optional[Number] = Field(None, ge=0, allow_inf_nan=False, description="epoch seconds: records that ended after it")
    limit: WholeNumber = Field(100, ge=1, le=10_000, description="how many of the newest, from 1 to 10000 (default 100)")


class TimelineQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    minutes: Number = Field(timeline.UI_MINUTES, gt=0, le=timeline.MAX_MINUTES, allow_inf_nan=False,
                            description=f"a number of minutes, more than 0 and at most {timeline.MAX_MINUTES:g} (what the "
                            f"history keeps); default {timeline.UI_MINUTES:g}")


async def admin_status(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return json_answer({**router_status(router, request.app[RELOADS_KEY]), "peers": request.app[PEERS_KEY].status(router.roster)})


async def admin_timeline(request: web.Request) -> web.Response:
    minutes = parse_query(TimelineQuery, request.query).minutes
    return json_answer(timeline.window(request.app[ROUTER_KEY].history, minutes))


async def admin_activity(request: web.Request) -> web.Response:
    """GET /admin/activity?model=&since=&limit=: the newest records first (see router.admin.activity)."""
    activity = cast(ActivityLog, request.app[ROUTER_KEY].activity)  # the one app.build_router handed the Router
    query = parse_query(ActivityQuery, request.query)
    records = activity.query(query.model, query.since, query.limit)
    return json_answer({"enabled": activity.enabled, "records": [r.as_dict() for r in records]})


class SleepQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="the model to put to sleep")
    level: Optional[Annotated[int, _written(r"[0-2]", "0, 1 or 2")]] = Field(
        None, description="the rung: 0 (KV park), 1 or 2, one its sleep_level allows; unset: the router chooses")


class DrillQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a model asleep at level 2 whose wake reloads its draft")


async def admin_action(request: web.Request) -> web.Response:
    """POST /admin/{swap,sleep,restart}?model=NAME: swap a model in, put it to sleep (`&level=N`: on that rung),
    or cold-restart it."""
    router = request.app[ROUTER_KEY]
    action = request.match_info["action"]
    model = request.query.get("model")
    if not model:
        raise APIError(400, f"POST /admin/{action} needs ?model=NAME", "missing_model", param="model")
    level = parse_query(SleepQuery, request.query).level if action == "sleep" else None
    engine = router.lookup(model)
    request[ROUTED_MODEL] = engine.name
    scheduler = router.placement
    run: Callable[[Engine], Awaitable[str]] = {"swap": scheduler.swap_in, "sleep": scheduler.sleep, "restart": scheduler.restart}[action]
    if level is not None:
        _check_rung(engine, level)
        run = functools.partial(scheduler.sleep, level=level)
    log.info("admin: %s %s%s", action, engine.name, "" if level is None else f" at level {level}")
    return await _run_action(request, action, engine, run)


def _check_rung(engine: Engine, level: int) -> None:
    """409 unless `engine` may be parked at `level`: its sleep_level allows it and, for Level 2, it can reload."""
    if level not in engine.sleep_levels:
        raise APIError(409, f"{engine.name} cannot sleep at level {level}: its sleep_level ({engine.spec.sleep_level}) "
                       f"allows {', '.join(map(str, engine.sleep_levels))}", "level_unavailable", param="level")
    if level == 2 and not engine.spec.reloads_weights:
        raise APIError(409, f"{engine.name} cannot sleep at level 2: its --load-format cannot reload its weights from disk",
                       "level_unavailable", param="level")


async def admin_drill(request: web.Request) -> web.Response:
    """POST /admin/drill?model=NAME: wake a model asleep at Level 2 once without its draft reload, on purpose, so an
    operator sees vLLM #52479 happen and the gate refuse the wake (then its on_fail remediation). Admin key only, as
    every /admin/* route; it applies to this one wake: armed here, read (and disarmed) by the wake, disarmed here
    again whatever happened, so no later wake can inherit it."""
    router = request.app[ROUTER_KEY]
    engine = router.lookup(parse_query(DrillQuery, request.query).model)
    request[ROUTED_MODEL] = engine.name
    try:
        engine.arm_drill()
    except ValueError as exc:
        raise APIError(409, str(exc), "drill_unavailable") from None
    log.warning("admin: drill on %s: its next wake skips the draft reload on purpose", engine.name)
    try:
        return await _run_action(request, "drill", engine, router.placement.swap_in)
    finally:
        engine.climb.drill_armed = False


class HoldQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="the model to hold off client traffic")
    seconds: Number = Field(ge=0, le=HOLD_MAX_S, allow_inf_nan=False,
                            description=f"how long from now, at most {HOLD_MAX_S:g}; 0 releases the hold")
    token: Optional[str] = Field(None, min_length=1, description="the hold's token, to renew or release it")


async def admin_hold(request: web.Request) -> web.Response:
    """POST /admin/hold?model=NAME&seconds=S[&token=T]: hold a model off client traffic for S seconds (503 model_held
    to any request without the token in X-Hotswap-Hold), renew it (with its token), or release it (seconds=0):
    what `hotswap trial --url` does to the models it drives (router.keys)."""
    router = request.app[ROUTER_KEY]
    query = parse_query(HoldQuery, request.query)
    engine = router.lookup(query.model)
    request[ROUTED_MODEL] = engine.name
    if query.seconds == 0:
        released = router.holds.release(engine.name, query.token)
        log.info("admin: hold on %s %s", engine.name, "released" if released else "was not held by that token")
        return json_answer({"model": engine.name, "held": False, "released": released})
    try:
        token = router.holds.take(engine.name, query.seconds, query.token)
    except HeldElsewhere as exc:
        raise APIError(409, str(exc), "model_held", param="model") from None
    if query.token is None:
        log.warning("admin: %s held off client traffic for %g s (a trial)", engine.name, query.seconds)
    return json_answer({"model": engine.name, "held": True, "token": token, "seconds": query.seconds})


async def _run_action(request: web.Request, action: str, engine: Engine, run: Callable[[Engine], Awaitable[str]]) -> web.Response:
    router = request.app[ROUTER_KEY]
    try:
        async with asyncio.timeout(router.roster.queue.max_wait_s + router.roster.swap.boot_timeout_s):
            result = await run(engine)
    except TimeoutError:
        raise APIError(504, f"{action} {engine.name} is still running; watch /admin/status", "admin_timeout") from None
    return json_answer({"model": engine.name, "action": action, "result": result, "engine": engine_status(router, engine)})


async def admin_reload(request: web.Request) -> web.Response:
    """POST /admin/reload: apply the --config file as it is now, or say why not (nothing changed)."""
    router = request.app[ROUTER_KEY]
    try:
        changes = await request.app[RELOADS_KEY].reload("POST /admin/reload")
    except RosterError as exc:
        errors = [str(issue) for issue in exc.issues]
        body = error_body(422, f"{router.roster.source}: {len(errors)} error(s); nothing changed, the roster in force is "
                               f"still served. First: {errors[0]}", "invalid_roster")
        return json_answer({**body, "errors": errors}, status=422)
    return json_answer({"applied": True, "source": router.roster.source, "changes": changes.as_dict(),
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
