"""The router's HTTP surface: the OpenAI proxy, health, readiness, metrics, admin.

Nothing but the routes below exists. The engines' dev endpoints (`/sleep`, `/wake_up`,
`/collective_rpc`, ...) are never forwarded, whatever the path spelling: there is no
catch-all route, and the upstream path is the route's own constant, not the client's.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hmac
import ipaddress
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp
from aiohttp import web

from config.schema import Roster
from engines.client import EngineError
from engines.engine import Engine, Observer, State
from engines.gate import Verdict
from router.errors import ProxyError, error_response
from router.metrics import UNKNOWN_MODEL, Metrics
from router import ui
from router.proxy import forward
from router.scheduler import GroupScheduler, SwapRecord

log = logging.getLogger("hotswap")

OPENAI_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
ROUTER_KEY = web.AppKey("router", "Router")


class Router(Observer):
    """The roster made live: engines, one scheduler per group, and the name -> engine table."""

    def __init__(self, roster: Roster, log_dir: Path, session: aiohttp.ClientSession, proxy_session: aiohttp.ClientSession):
        self.roster = roster
        self.session = session
        self.proxy_session = proxy_session
        self.metrics = Metrics()
        self.started = int(time.time())
        self.engines: dict[str, Engine] = {m.name: Engine(m, roster.swap, session, log_dir, self) for m in roster.models}
        self.by_name: dict[str, Engine] = {n: self.engines[m.name] for m in roster.models for n in m.names}
        self.groups: dict[str, GroupScheduler] = {
            group: GroupScheduler(group, [self.engines[m.name] for m in models], roster.swap, roster.queue, self.metrics.swap_done)
            for group, models in roster.groups().items()
        }
        self.metrics.attach(self)
        self.verdicts: dict[str, collections.deque[Verdict]] = {name: collections.deque(maxlen=10) for name in self.engines}
        self._watch: Optional[asyncio.Task[None]] = None

    def scheduler(self, engine: Engine) -> GroupScheduler:
        return self.groups[engine.spec.group]

    def lookup(self, model: str) -> Engine:
        engine = self.by_name.get(model)
        if engine is None:
            known = ", ".join(sorted(self.by_name))
            raise ProxyError(404, f"The model '{model}' does not exist. Available: {known}", "model_not_found", param="model")
        return engine

    @property
    def ready(self) -> bool:
        # Parked engines count: with idle_sleep_s every engine may be asleep, and a router that
        # reported unready then would be taken out of rotation and never woken by traffic.
        return any(e.serviceable for e in self.engines.values())

    def start(self) -> None:
        log.info("hotswap: %d engines in %d groups; engine logs in %s", len(self.engines), len(self.groups),
                 next(iter(self.engines.values())).log_dir)
        for scheduler in self.groups.values():
            scheduler.start()
        self._watch = asyncio.create_task(self._watch_acceptance(), name="acceptance-watch")

    async def _watch_acceptance(self) -> None:
        """Keep measuring acceptance on the awake engines: a collapse can also appear mid-life."""
        watched = [e for e in self.engines.values() if e.has_draft and e.spec.gate.enabled]
        if not watched:
            return
        interval = min(5.0, min(e.spec.gate.midlife_window_s for e in watched) / 4)
        while True:
            await asyncio.sleep(interval)
            for engine in watched:
                try:
                    await engine.watch_acceptance()
                except EngineError as exc:
                    log.debug("acceptance watch on %s: %s", engine.name, exc)
                if engine.needs_restart:
                    self.scheduler(engine).poke()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; give those in flight or already queued until `timeout` to finish."""
        for scheduler in self.groups.values():
            scheduler.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(e.in_flight or self.scheduler(e).queued(e) for e in self.engines.values()):
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(s.stop() for s in self.groups.values()))
        await asyncio.gather(*(e.stop() for e in self.engines.values()), return_exceptions=True)

    # -- Observer: engines report here --------------------------------------------------------

    def state_changed(self, engine: Engine, old: State, new: State) -> None:
        self.metrics.state_changed(engine, old, new)
        if new is State.FAILED:
            self.scheduler(engine).poke()
        if old is State.BOOTING and not all(s.booted for s in self.groups.values()):
            done = sum(e.baseline is not None or e.state is State.FAILED for e in self.engines.values())
            log.info("hotswap: %d/%d engines booted%s", done, len(self.engines),
                     f" ({engine.name} failed)" if new is State.FAILED else "")

    def step_done(self, engine: Engine, phase: str, seconds: float, ok: bool) -> None:
        self.metrics.step_done(engine, phase, seconds, ok)

    def verdict(self, engine: Engine, verdict: Verdict) -> None:
        self.verdicts[engine.name].append(verdict)
        self.metrics.verdict(engine, verdict)
        log.log(logging.INFO if verdict.result in ("passed", "baseline", "skipped") else logging.ERROR,
                "gate %s: %s (%s)", engine.name, verdict.result, verdict.reason)

    def restarted(self, engine: Engine, reason: str) -> None:
        self.metrics.restarted(engine, reason)

    def midlife_collapse(self, engine: Engine, observed_mal: float, reason: str) -> None:
        self.metrics.midlife_collapse(engine, observed_mal, reason)

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "groups": {
                name: {
                    "active": s.active.name if s.active else None,
                    "booted": s.booted,
                    "last_swap": _swap_dict(s.last_swap),
                    "swaps": [_swap_dict(r) for r in reversed(s.history)],
                    "engines": [self.engine_status(e) for e in s.engines],
                }
                for name, s in self.groups.items()
            },
        }

    def engine_status(self, e: Engine) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "name": e.name,
            "aliases": e.spec.aliases,
            "state": e.state.value,
            "for_s": round(now - e.since, 3),
            "sleep_level": e.sleep_level,
            "in_flight": e.in_flight,
            "queued": self.scheduler(e).queued(e),
            "port": e.port,
            "pid": e.process.pid if e.process else None,
            "boot_deadline_in_s": round(e.boot_deadline - now, 1) if e.boot_deadline else None,
            "last_phases": {k: round(v, 4) for k, v in e.last_phases.items()},
            "last_verdict": e.last_verdict.as_dict() if e.last_verdict else None,
            "verdicts": [v.as_dict() for v in reversed(self.verdicts[e.name])],
            "failures": self.scheduler(e).failures[e.name],
            "restarts": sum(e.restarts.values()),
            "restarts_by_reason": dict(e.restarts),
            "baseline_mal": e.baseline.mal if e.baseline else None,
            "observed_mal": e.observed_mal,
            "collapsed": e.collapsed,
            "failure": e.failure,
            "last_log_lines": e.last_log_lines(20),
            "log_file": str(e.process.log_path) if e.process else None,
        }


def _swap_dict(record: Optional[SwapRecord]) -> Optional[dict[str, Any]]:
    if record is None:
        return None
    return {"from": record.from_model, "to": record.to_model, "result": record.result, "seconds": round(record.seconds, 4),
            "phases": {k: round(v, 4) for k, v in record.phases.items()}, "error": record.error, "at": record.at}


# -- handlers ------------------------------------------------------------------------------------

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
        label, group = engine.name, engine.spec.group
        stream = "true" if body.get("stream") is True else "false"
        scheduler = router.scheduler(engine)
        await scheduler.acquire(engine)
        queued_s = time.monotonic() - started
        try:
            response = await forward(request, router.proxy_session, engine, path, body, request["raw_body"])
        finally:
            scheduler.release(engine)
        status = response.status
        return response
    except ProxyError as exc:
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
        raise ProxyError(400, f"The request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "The request body must be a JSON object.", "invalid_request")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError(400, "The request needs a 'model' (a string naming a model from GET /v1/models).", "missing_model", param="model")
    return body


async def list_models(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    data = [
        {"id": name, "object": "model", "created": router.started, "owned_by": "hotswap",
         "root": engine.spec.model or engine.spec.url or engine.name, "parent": None if name == engine.name else engine.name,
         "state": engine.state.value, "group": engine.spec.group}
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
    return web.json_response(request.app[ROUTER_KEY].status())


async def admin_action(request: web.Request) -> web.Response:
    """POST /admin/{swap,sleep,restart}?model=NAME: pre-warm, park, or cold-restart one model."""
    router = request.app[ROUTER_KEY]
    action = request.match_info["action"]
    model = request.query.get("model")
    if not model:
        raise ProxyError(400, f"POST /admin/{action} needs ?model=NAME", "missing_model", param="model")
    engine = router.lookup(model)
    scheduler = router.scheduler(engine)
    run = {"swap": scheduler.pre_warm, "sleep": scheduler.park, "restart": scheduler.restart}[action]
    log.info("admin: %s %s", action, engine.name)
    try:
        async with asyncio.timeout(router.roster.queue.max_wait_s + router.roster.swap.boot_timeout_s):
            result = await run(engine)
    except TimeoutError:
        raise ProxyError(504, f"{action} {engine.name} is still running; watch /admin/status", "admin_timeout") from None
    return web.json_response({"model": engine.name, "action": action, "result": result, "engine": router.engine_status(engine)})


async def status_page(request: web.Request) -> web.Response:
    return web.Response(text=ui.render(request.app[ROUTER_KEY].status()), content_type="text/html")


# -- middlewares --------------------------------------------------------------------------------

@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as exc:
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


def _auth_middleware(roster: Roster):
    client_keys = [k.encode() for k in roster.auth.api_keys]
    admin_key = roster.auth.admin_key.encode() if roster.auth.admin_key else None

    def presented(request: web.Request) -> bytes:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return value.strip().encode()
        if scheme.lower() == "basic":  # a browser on /ui: any user name, the admin key as password
            try:
                return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except ValueError:
                return b""
        return b""

    def matches(key: bytes, keys: list[bytes]) -> bool:
        # Compare against every key, so the time taken does not say which one was close.
        return bool(key) and sum(hmac.compare_digest(key, k) for k in keys) > 0

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") and client_keys and not matches(presented(request), client_keys):
            return error_response(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.", "invalid_api_key")
        if request.path.startswith("/admin/") or request.path == "/ui":
            if admin_key is not None:
                if not matches(presented(request), [admin_key]):
                    response = error_response(401, "Missing or invalid admin key.", "invalid_admin_key")
                    if request.path == "/ui":
                        response.headers["WWW-Authenticate"] = 'Basic realm="hotswap"'
                    return response
            elif not _is_loopback(request.remote):
                return error_response(403, f"{request.path} is loopback-only until auth.admin_key is set.", "admin_loopback_only")
        return await handler(request)

    return auth


def _is_loopback(remote: Optional[str]) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def build_app(router: Router) -> web.Application:
    roster = router.roster
    app = web.Application(
        middlewares=[openai_errors, _auth_middleware(roster)],
        client_max_size=int(roster.listen.max_body_mb * 1024 * 1024),
    )
    app[ROUTER_KEY] = router
    for path in OPENAI_ROUTES:
        app.router.add_post(path, openai_endpoint)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/status", admin_status)
    app.router.add_post(r"/admin/{action:swap|sleep|restart}", admin_action)
    app.router.add_get("/ui", status_page)
    return app
