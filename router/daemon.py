"""`hotswap serve`: listen, boot the engines, serve until SIGTERM/SIGINT, then drain and stop."""

from __future__ import annotations

import asyncio
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

from config.schema import Roster
from router.app import Router, build_app

log = logging.getLogger("hotswap")


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


def run(roster: Roster, host: Optional[str] = None, port: Optional[int] = None, log_dir: Optional[Path] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    raise_open_file_limit()
    return uvloop.run(serve(roster, host or roster.listen.host, port or roster.listen.port, log_dir or default_log_dir()))


async def serve(roster: Roster, host: str, port: int, log_dir: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, log_tasks)

    # Control calls carry their own per-call timeouts; proxied generations may run long,
    # so their session has no total limit (proxy.UPSTREAM_TIMEOUT bounds connect and read gaps).
    async with aiohttp.ClientSession() as session, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as proxy_session:
        router = Router(roster, log_dir, session, proxy_session)
        runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s (is another router running? set listen.port or --port)", host, port, exc.strerror)
            await runner.cleanup()
            return 1
        log.info("hotswap: listening on http://%s:%d (roster %s)", host, port, roster.source)
        router.start()
        await stop.wait()

        log.info("hotswap: stopping: no new connections or requests; draining in-flight and queued ones (up to %g s)",
                 roster.swap.drain_timeout_s)
        await site.stop()
        await router.drain(roster.swap.drain_timeout_s)
        await router.stop()
        await runner.cleanup()
        log.info("hotswap: stopped")
    return 0
