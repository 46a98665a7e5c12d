"""The simulated engine's aiohttp app: `SimServer`'s own routes (generation, /health, /v1/models,
/metrics) and the route families that live in their own modules, each given the server."""

from __future__ import annotations

from aiohttp import web

from . import lora, routes_anthropic, routes_audio, routes_dev, routes_pooling, routes_responses, routes_sim
from .host_memory import HostModel
from .http import error_response, read_json
from .server import SimServer


MAX_BODY_BYTES = 1 << 30


def build_app(server: SimServer, host: HostModel | None = None) -> web.Application:
    """`host`: the Level-1 host-memory model (host_memory.py); None: not modelled."""
    # vLLM's server takes a body of any size (the router bounds it: listen.max_body_mb); aiohttp's default is 1 MB.
    app = web.Application(middlewares=[routes_dev.doomed_connections_mw, server.errors_mw, server.auth_mw],
                          client_max_size=MAX_BODY_BYTES)
    r = app.router
    r.add_get("/health", server.health)
    r.add_get("/v1/models", server.models)
    r.add_post("/v1/completions", server.completions)
    r.add_post("/v1/chat/completions", server.chat_completions)
    r.add_post("/v1/embeddings", server.embeddings)
    r.add_get("/metrics", server.metrics)
    # Route families beyond the three generation routes live in their own modules.
    for family in (routes_responses, routes_anthropic, routes_pooling, routes_audio):
        family.add_routes(app, server)
    if lora.runtime_updates_allowed():
        lora.add_routes(app, server.adapters, server.names, read_json, error_response)
    if server.dev_mode:
        routes_dev.add_routes(app, server, host)
    routes_sim.add_routes(app, server)
    return app
