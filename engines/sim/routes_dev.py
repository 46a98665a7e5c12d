"""The simulated engine's dev API (vLLM serves it only with VLLM_SERVER_DEV_MODE=1, not behind
--api-key): `/sleep`, `/release_kv_cache_memory`, `/wake_up`, `/is_sleeping`, `/reset_prefix_cache`,
`/collective_rpc`, with the memory oracle's charges at sleep, release and wake (memory.py).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any

from aiohttp import web

from config.argv import NO_RELOAD_FORMATS

from .host_memory import NOT_MODELLED, HostModel
from .memory import OutOfMemory
from .http import bad_request, error_response, query_json, read_json
from .state import SCHEDULING, WAKE_TAGS, ReleaseRefused

if TYPE_CHECKING:
    from .server import SimServer

log = logging.getLogger("vllm.sim")

RPC_STEPS = {"reload_weights": "reload_weights", "hotswap_reload_draft": "reload_draft", "hotswap_stage_weights": "stage"}
EXTENSION_METHODS = ("hotswap_reload_draft", "hotswap_draft_digest", "hotswap_discard_draft", "hotswap_perturb_target",
                     "hotswap_target_digest", "hotswap_host_memory", "hotswap_empty_host_cache", "hotswap_stage_weights")
# Without a disk model (page_cache.py) reads cost nothing: as if every page were resident.
UNMODELLED_STAGE = {"files": 1, "bytes": 0, "read_bytes": 0, "seconds": 0.0, "resident_before": 1.0}


# Connections uvicorn would close after an unhandled exception: the next request on one gets no answer.
DOOMED: "weakref.WeakSet[asyncio.BaseTransport]" = weakref.WeakSet()


@web.middleware
async def doomed_connections_mw(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.transport is not None and request.transport in DOOMED:
        request.transport.close()
        raise web.HTTPServiceUnavailable()  # never sent: the connection is gone
    return await handler(request)


def add_routes(app: web.Application, server: "SimServer", host: HostModel | None = None) -> None:
    """`host`: the Level-1 host-memory model, charged at sleep and wake and reported by the extension's RPCs."""
    async def sleep(request: web.Request) -> web.Response:
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            raise bad_request("level must be an integer", "level") from None
        mode = request.query.get("mode", "abort")
        if level not in (0, 1, 2):
            raise bad_request(f"Invalid sleep level {level}; must be 0, 1 or 2", "level")
        if mode not in ("abort", "wait", "keep"):
            raise bad_request(f"Invalid mode {mode!r}; must be abort, wait or keep", "mode")
        await server.control.enter("sleep", query=query_json(request), variant=f"sleep_level{level}")
        await server.engine.sleep(level, mode)
        if level == 2 and server.lose_lora_on_level2:
            server.adapters.lost = True
        # Levels 1 and 2 unmap weights and KV cache; level 0 only pauses scheduling.
        if server.memory is not None and level > 0:
            server.memory.sleep()
        if host is not None:
            host.sleep(level)
        return web.json_response({"status": "sleeping", "level": level})

    async def release_kv_cache_memory(request: web.Request) -> web.Response:
        await server.control.enter("release_kv_cache_memory", query=query_json(request))
        try:
            server.engine.release_kv_cache()
        except ReleaseRefused as e:
            # The engine core's utility call raising, as vLLM's API server answers it (seen on the CPU tier).
            log.error("Invocation of release_kv_cache_memory method failed: %s", e)
            if request.transport is not None:  # raised through vLLM's ASGI app: uvicorn drops the connection after
                DOOMED.add(request.transport)
            return error_response(500, f"Call to release_kv_cache_memory method failed: {e}", "InternalServerError")
        if server.memory is not None:
            server.memory.release_kv()  # the weights (and the residual) stay mapped
        return web.json_response({"status": "kv_cache_released"})

    async def wake_up(request: web.Request) -> web.Response:
        tags = request.query.getall("tags", [])
        bad = [t for t in tags if t not in (*WAKE_TAGS, SCHEDULING)]
        if bad:
            raise bad_request(f"Unknown wake_up tags {bad}; valid tags: {[*WAKE_TAGS, SCHEDULING]}", "tags")
        mapped = [t for t in tags if t != SCHEDULING]
        step = "wake" if not mapped or set(mapped) == set(WAKE_TAGS) else f"wake_{mapped[0]}"
        await server.control.enter(step, query=query_json(request), tags=list(tags))
        if server.memory is not None and server.engine.maps_memory(list(tags)):
            # The first tag woken maps the whole share back; later ones find it mapped.
            try:
                server.memory.wake()
            except OutOfMemory as e:
                msg = e.wake_message(len(server.memory.devices))
                log.error("Invocation of wake_up method failed (GPU %d: %s GiB free, %s GiB asked): %s",
                          e.device, round(e.free / 2**30, 2), round(e.requested / 2**30, 2), msg)
                return error_response(500, msg, "InternalServerError")
        if host is not None:
            host.wake(list(tags))
        result = server.engine.wake(list(tags))
        log.info("wake_up(tags=%s): %s", tags or "all", result["status"])
        return web.json_response(result)

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": server.engine.is_sleeping})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        await server.control.enter("reset_prefix_cache", query=query_json(request))
        ok = server.engine.reset_prefix_cache()
        log.info("reset_prefix_cache: success=%s", ok)
        return web.json_response({"success": ok})

    async def collective_rpc(request: web.Request) -> web.Response:
        body = await read_json(request)
        method = body.get("method")
        if not isinstance(method, str) or not method:
            raise bad_request("method must be a non-empty string", "method")
        step = RPC_STEPS.get(method, "collective_rpc")
        if step == "collective_rpc":
            server.control.record(step, method=method)
        else:
            await server.control.enter(step, method=method)
        known = method == "reload_weights" or (method in EXTENSION_METHODS and server.engine.cfg.worker_extension)
        if not known:
            # What a worker raises for a method neither it nor its extension defines.
            msg = f"AttributeError: 'CPUWorker' object has no attribute '{method}'"
            log.error("collective_rpc(%s) failed: %s", method, msg)
            # vLLM raises through its ASGI app here: uvicorn answers 500 and then closes the connection,
            # without a `Connection: close` and without answering what arrives on it meanwhile (seen on
            # the vLLM 0.32 CPU tier: the router's next call, a /sleep, was reset). DOOMED does that.
            if request.transport is not None:
                DOOMED.add(request.transport)
            return error_response(500, msg, "InternalServerError")
        e = server.engine
        if method in ("reload_weights", "hotswap_reload_draft") and e.cfg.load_format in NO_RELOAD_FORMATS:
            # vLLM 0.32's reload/inplace.py:75 for a loader without get_all_weights; the draft's reload uses the same loaders.
            msg = f"NotImplementedError: Model reloading with `{e.cfg.load_format}` format"
            log.error("collective_rpc(%s) failed: %s", method, msg)
            return error_response(500, msg, "InternalServerError")
        result: object
        if method == "reload_weights":
            if server.disk is not None:
                await server.disk.reload()  # from the page cache or the disk, at its speed
            e.reload_weights()
            result = None
        elif method == "hotswap_stage_weights":
            kwargs = body.get("kwargs") or {}
            looks = isinstance(kwargs, dict) and kwargs.get("read") is False  # a wake's look (engines/waking/stage.py)
            result = await server.disk.stage(read=not looks) if server.disk is not None else UNMODELLED_STAGE
        elif method == "hotswap_reload_draft":
            result = e.reload_draft()
        elif method == "hotswap_draft_digest":
            result = e.draft_digest()
        elif method == "hotswap_perturb_target":
            try:
                result = e.numerics.perturb(_scale(body))
            except ValueError as exc:  # what the worker raises, as vLLM answers it
                log.error("collective_rpc(%s) failed: %s", method, exc)
                return error_response(500, f"ValueError: {exc}", "InternalServerError")
        elif method == "hotswap_target_digest":
            result = e.numerics.digest()
        elif method == "hotswap_host_memory":
            result = host.stats() if host is not None else NOT_MODELLED
        elif method == "hotswap_empty_host_cache":
            result = host.empty_cache() if host is not None else NOT_MODELLED
        else:
            result = {"discarded": e.discard_draft()}
        log.info("collective_rpc(%s) -> %s", method, result)
        return web.json_response({"results": [result]})

    def _scale(body: dict) -> float:
        """The test method's one argument, positional (`args`) or by name (`kwargs`), as vLLM passes them."""
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        value = kwargs.get("scale", args[0] if isinstance(args, list) and args else 1.05) if isinstance(kwargs, dict) else None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad_request(f"hotswap_perturb_target: scale must be a number, got {value!r}", "args") from None

    r = app.router
    r.add_post("/sleep", sleep)
    r.add_post("/release_kv_cache_memory", release_kv_cache_memory)
    r.add_post("/wake_up", wake_up)
    r.add_get("/is_sleeping", is_sleeping)
    r.add_post("/collective_rpc", collective_rpc)
    r.add_post("/reset_prefix_cache", reset_prefix_cache)
