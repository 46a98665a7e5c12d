"""`hotswap serve`: listen, boot the engines, serve until SIGTERM/SIGINT, then drain and stop;
SIGHUP re-reads the roster (`router.admin.reload`)."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Optional

import aiohttp
import uvloop
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from config.schema import Roster
from config.simulate import NOT_MODELLED
from router import admin, fleet
from router.app import build_app, build_router
from router.auth import KEY_NAME
from router.live import ROUTED_MODEL, Router
from router.scheduling import simulated_roster

# Clients that open hundreds of connections at once (an agent fleet, a load balancer's warm-up)
# overflow a short accept queue; past it Linux answers with SYN cookies, the client's request is
# dropped by our kernel and sits in TCP retransmission for seconds. uvicorn's (so vLLM's) 2048;
# the kernel caps it at net.core.somaxconn.
BACKLOG = 2048

log = logging.getLogger("hotswap")
ACCESS_LOG = logging.getLogger("hotswap.access")


class AccessLog(AbstractAccessLogger):
    """`listen.access_log: true`: a line per request, written by aiohttp once the answer is sent, so
    refused keys, unknown routes and models, bad input, /admin/* and /metrics leave one too:
    `access 127.0.0.1 POST /v1/chat/completions 200 0.412s 1893B key=api_keys[0] model=chat`.
    The path is as sent, without its query (where a careless client may put a key); `key=` is the
    name of the key presented (`router.keys`; `unknown` for a key no grant has), never the key."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info("access %s %s %s %d %.3fs %dB key=%s model=%s", request.remote or "-", request.method,
                         request.raw_path.partition("?")[0], response.status, time, response.body_length,
                         request.get(KEY_NAME) or "-", request.get(ROUTED_MODEL) or "-")


def log_tasks() -> None:
    """SIGUSR1: log what every task is waiting on (`kill -USR1 <router pid>` when it seems stuck)."""
    for task in asyncio.all_tasks():
        stack = io.StringIO()
        task.print_stack(limit=8, file=stack)
        log.warning("task %s:\n%s", task.get_name(), stack.getvalue().rstrip())


def default_log_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hotswap" / "logs"


def raise_open_file_limit() -> None:
    """Each proxied request holds two sockets; 1024, a common default, caps the router near 500 clients."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < 4096:
        log.warning("open file limit is %d: about %d concurrent requests at most (raise it with `ulimit -n`)", soft, soft // 2 - 50)


# A proxied request leaves no cyclic garbage (bench/peers.py found the one it did), but at CPython's
# default threshold (700 net new objects) the in-flight requests' own objects trigger a young collection
# every few requests and a full one now and then: measured under bench/peers.py, 0.85x the router's CPU
# per non-stream request with this threshold and the start-up heap frozen, against the defaults.
GC_THRESHOLD = (50_000, 20, 20)


def quiet_gc() -> None:
    """Once serving: what start-up made (modules, the roster, the app) is never scanned again, and
    collections run at GC_THRESHOLD."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def run(roster: Roster, host: Optional[str] = None, port: Optional[int] = None, log_dir: Optional[Path] = None,
        simulate: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    raise_open_file_limit()
    if simulate:
        roster = simulated(roster)
    return uvloop.run(serve(roster, host or roster.listen.host, port or roster.listen.port, log_dir or default_log_dir(),
                            simulate))


def simulated(roster: Roster) -> Roster:
    """`--simulate`: the roster run by the simulator; what it cannot model and what it assumed, said once."""
    roster, notes = simulated_roster(roster)
    log.warning("hotswap: %s", NOT_MODELLED)
    for note in notes:
        log.info("hotswap: simulated: %s", note)
    return roster


async def serve(roster: Roster, host: str, port: int, log_dir: Path, simulate: bool = False) -> int:
    """Serve until SIGTERM/SIGINT; then drain and stop. A second signal while draining stops at
    once: engines get SIGTERM, then SIGKILL after swap.kill_grace_s, and the exit code is 128+signal."""
    loop = asyncio.get_running_loop()
    signals: list[int] = []
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal(sig: int) -> None:
        signals.append(sig)
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR1, log_tasks)

    # The engines' control calls, with their own per-call timeouts, and nothing else: requests go to engines
    # through router.upstreams and to peers on fleet.Peers' own pool, so no load can starve a wake.
    async with aiohttp.ClientSession() as control:
        try:
            router = build_router(roster, log_dir, control)
            router.simulated = simulate
        except admin.ActivityFileError as exc:
            log.error("hotswap: %s", exc)
            return 1
        app = build_app(router)
        # aiohttp's keep-alive timer is armed when a connection opens and after each answer, and closes the
        # connection if no complete request head has arrived when it fires: that is the header timeout.
        # shutdown_timeout: what a handler still running after the drain (a request passed on to a peer, which
        # holds no engine's lease; a straggler the drain did not see) gets before it is cut, instead of aiohttp's
        # 60 s: the drain already gave every request swap.drain_timeout_s.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=ACCESS_LOG if roster.listen.access_log else None,
                               access_log_class=AccessLog,
                               keepalive_timeout=roster.listen.client_header_timeout_s,
                               shutdown_timeout=roster.swap.drain_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=BACKLOG)
        try:
            await site.start()
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s (is another router running? set listen.port or --port)", host, port, exc.strerror)
            await runner.cleanup()
            return 1
        agent = fleet.Agent(router, host, roster.node.agent_port) if roster.node.agent_port else None
        if agent is not None:
            try:
                await agent.start()
            except OSError as exc:
                log.error("cannot listen for HAProxy's agent-check on %s:%d (node.agent_port): %s", host, agent.port, exc.strerror)
                await runner.cleanup()
                return 1
            log.info("hotswap: agent-check on %s:%d", host, agent.port)
        log.info("hotswap: listening on http://%s:%d (roster %s%s)", host, port, roster.source,
                 ", simulated: no engine is real" if simulate else "")
        router.start()
        quiet_gc()
        loop.add_signal_handler(signal.SIGHUP, app[admin.RELOADS_KEY].on_signal)
        await stop.wait()

        log.info("hotswap: draining: /ready and new requests answer 503 (Retry-After); in-flight and queued ones finish "
                 "(up to %g s); the listener closes after that and at least listen.drain_notice_s=%g s; a second signal "
                 "stops at once", roster.swap.drain_timeout_s, roster.listen.drain_notice_s)
        graceful = asyncio.create_task(_stop_gracefully(router, site, runner, roster.swap.drain_timeout_s,
                                                        roster.listen.drain_notice_s))
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({graceful, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not graceful.done():
            graceful.cancel()
            await asyncio.gather(graceful, return_exceptions=True)
            log.warning("hotswap: second %s: stopping now; in-flight requests are cut, engines get SIGTERM "
                        "and SIGKILL after %g s", signal.Signals(signals[-1]).name, roster.swap.kill_grace_s)
            await router.stop()
            await _stop_agent(agent)
            await app[fleet.PEERS_KEY].close()  # the app is not cleaned up on this path
            log.info("hotswap: stopped")
            return 128 + signals[-1]
        await graceful
        await _stop_agent(agent)
        log.info("hotswap: stopped")
    return 0


async def _stop_agent(agent: Optional[fleet.Agent]) -> None:
    """After the listener: while draining, the agent tells HAProxy `drain`, which moves traffic sooner than /ready."""
    if agent is not None:
        await agent.stop()


async def _stop_gracefully(router: Router, site: web.TCPSite, runner: web.AppRunner, drain_s: float, notice_s: float) -> None:
    """Drain while still listening, then close the port. A front that polls /ready sees 503 and
    moves traffic away, and one that still sends gets a 503 it can retry elsewhere, not a
    refused connection; `notice_s` covers the front's (or Kubernetes endpoints') reaction time."""
    notice = asyncio.create_task(asyncio.sleep(notice_s))
    try:
        await router.drain(drain_s)
        await notice
    finally:
        notice.cancel()
    log.info("hotswap: drained; closing the listener")
    await site.stop()
    await router.stop()
    await runner.cleanup()
