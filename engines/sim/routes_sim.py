"""The sim-only control routes: `/sim/state` (engine and GPU-memory state), `/sim/log` (the
calls the router made, in order), `/sim/faults` (inject or clear faults at runtime)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web

from .control import FAULT_KINDS, Fault
from .http import bad_request, read_json

if TYPE_CHECKING:
    from .server import SimServer

log = logging.getLogger("vllm.sim")


def add_routes(app: web.Application, server: "SimServer") -> None:
    async def sim_state(request: web.Request) -> web.Response:
        gpu = server.memory.state_json() if server.memory is not None else None
        disk = server.disk.state_json() if server.disk is not None else None
        return web.json_response({**server.engine.state_json(), "gpu_memory": gpu, "disk": disk,
                                  "worker_extension_from": server.extension_from})

    async def sim_log(request: web.Request) -> web.Response:
        return web.json_response(list(server.control.calls))

    async def sim_log_clear(request: web.Request) -> web.Response:
        n = len(server.control.calls)
        server.control.calls.clear()
        return web.json_response({"cleared": n})

    async def sim_faults(request: web.Request) -> web.Response:
        return web.json_response(server.control.faults_json())

    async def sim_faults_add(request: web.Request) -> web.Response:
        body = await read_json(request)
        try:
            fault = Fault(step=body.get("step"), kind=body.get("kind"), times=body.get("times"))
        except ValueError as e:
            raise bad_request(f"{e} (kinds: {', '.join(FAULT_KINDS)})") from None
        server.control.faults.append(fault)
        log.info("sim: fault added: %s", fault)
        return web.json_response(server.control.faults_json())

    async def sim_faults_clear(request: web.Request) -> web.Response:
        n = len(server.control.faults)
        server.control.faults.clear()
        return web.json_response({"cleared": n})

    r = app.router
    r.add_get("/sim/state", sim_state)
    r.add_get("/sim/log", sim_log)
    r.add_delete("/sim/log", sim_log_clear)
    r.add_get("/sim/faults", sim_faults)
    r.add_post("/sim/faults", sim_faults_add)
    r.add_delete("/sim/faults", sim_faults_clear)
