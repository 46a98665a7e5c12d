"""The composition root: builds the parts of a router and connects them, nothing else.

`build_router` makes the roster live (engines, their scheduler, and the connection pools the
proxy forwards on; `control` is the engines' own, for their control calls only); `build_app` puts it behind aiohttp: the middlewares, the objects each
wing's handlers read from the app, and the routes.

Nothing but the routes listed here exists. The engines' dev endpoints (`/sleep`, `/wake_up`,
`/collective_rpc`, ...) are never forwarded, whatever the path spelling: there is no
catch-all route, and the upstream path is the route's own constant, not the client's.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import aiohttp
from aiohttp import web

from config.schema import Roster
from router import admin, fleet, proxy
from router.auth import auth_middleware
from router.errors import api_errors
from router.live import ROUTER_KEY, Router
from router.metrics import METRICS_KEY, serve_metrics


def build_router(roster: Roster, log_dir: Path, control: aiohttp.ClientSession) -> Router:
    """admin.ActivityFileError when activity.path cannot be used (the start fails, saying why)."""
    activity = admin.ActivityLog(roster.activity)
    router = Router(roster, log_dir, control, proxy.Upstreams(), activity)
    # Swap ids go on from the largest the activity file holds: its rows refill the log at start and
    # link to their swap by id, so a new run's swap 1 would pose as an old row's. Without a file
    # nothing outlives the process, and ids start at 1.
    router.placement.swap_ids = itertools.count(activity.last_swap_id + 1)
    return router


def build_app(router: Router) -> web.Application:
    app = web.Application(
        middlewares=[api_errors, auth_middleware(lambda: router.keys, proxy.CLIENT_PATHS)],
        client_max_size=int(router.roster.listen.max_body_mb * 1024 * 1024),
    )
    app[ROUTER_KEY] = router
    app[METRICS_KEY] = router.metrics
    app[fleet.MODEL_SERVER_KEY] = fleet.ModelServerMetrics(router)
    app[proxy.RESPONSE_IDS_KEY] = proxy.ResponseIds()
    app[admin.RELOADS_KEY] = admin.Reloads(router)
    app[admin.LOG_FOLLOWERS_KEY] = followers = admin.LogFollowers()
    app.on_shutdown.append(followers.close)
    app[fleet.PEERS_KEY] = peers = fleet.Peers()  # with its own connections: never the engines' control pool
    app.on_cleanup.append(peers.close)
    app.on_response_prepare.append(fleet.names_its_answers(lambda: router.roster))
    add = app.router
    for route in proxy.PROXIED:
        add.add_post(route.path, proxy.proxy_endpoint)
    add.add_get("/v1/responses/{response_id}", proxy.response_pinned)
    add.add_post("/v1/responses/{response_id}/cancel", proxy.response_pinned)
    add.add_get("/v1/models", proxy.list_models)
    add.add_get("/v1/models/{model_id:.+}", proxy.get_model)
    add.add_get("/health", proxy.health)
    add.add_get("/ready", proxy.ready)
    add.add_get("/metrics", serve_metrics)
    add.add_get("/metrics/model-server", fleet.serve_model_server)
    add.add_get("/admin/status", admin.admin_status)
    add.add_get("/admin/timeline", admin.admin_timeline)
    add.add_get("/admin/activity", admin.admin_activity)
    add.add_post(r"/admin/{action:swap|sleep|restart}", admin.admin_action)
    add.add_post("/admin/drill", admin.admin_drill)
    add.add_post("/admin/hold", admin.admin_hold)
    add.add_post("/admin/reload", admin.admin_reload)
    add.add_post(r"/admin/lora/{action:load|unload}", admin.admin_lora)
    add.add_get("/admin/logs/{model:.+}", admin.engine_log)
    add.add_get("/ui", admin.status_page)
    return app
