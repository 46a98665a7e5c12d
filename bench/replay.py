"""Replaying a request trace against a router that runs in the bench's own process, on simulated
engines it launches: what bench/placement.py and bench/wake_trace.py share.

The router is built as router/daemon.py builds it (`router.app.build_router` + `build_app` on a
loopback port), so a bench can set the scheduler's cost function on the instance (`lru_cost`, the
baseline) and read its events (`Recorder`). Whatever `router` is first on sys.path is the one run:
a bench A/Bs a tree by running this in a child process with PYTHONPATH at that tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import harness as h


class Failed(Exception):
    """A run that cannot go on: the message says why and where the logs are."""


def lru_cost(scheduler: Any):
    """Least recently requested first. The scheduler picks the set of victims with the least total
    cost; 2**rank makes that the shortest prefix of the LRU order that makes room (skipping any
    victim the room does not need)."""
    def cost(engine: Any, action: str, now: float) -> float:
        order = sorted(scheduler.engines, key=lambda e: scheduler.demand.last(e.name))
        return float(2 ** next(i for i, e in enumerate(order) if e.name == engine.name))
    return cost


class Recorder:
    """The scheduler's events (wakes with their phases, evictions), passed on to the router's metrics."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.wakes: list[Any] = []
        self.ended: list[float] = []  # time.monotonic() at each of `wakes`' end
        self.evictions: dict[str, int] = {}

    def swap_done(self, record: Any) -> None:
        self.wakes.append(record)
        self.ended.append(time.monotonic())
        self.inner.swap_done(record)

    def evicted(self, engine: Any, reason: str) -> None:
        self.evictions[reason] = self.evictions.get(reason, 0) + 1
        self.inner.evicted(engine, reason)

    def __getattr__(self, name: str) -> Any:  # events a newer scheduler sends that this bench does not count
        return getattr(self.inner, name)

    def spans(self) -> dict[str, list[tuple[float, float, dict[str, float]]]]:
        """Per model, its successful wakes as (start, end, phases) in time.monotonic(), in order of their end."""
        out: dict[str, list[tuple[float, float, dict[str, float]]]] = {}
        for rec, end in zip(self.wakes, self.ended):
            if rec.result == "ok":
                out.setdefault(rec.to_model, []).append((end - rec.seconds, end, dict(rec.phases)))
        return out

    def moves(self) -> list[tuple[str, list[str], float, float]]:
        """Each successful wake as (its model, the models parked or stopped for it, start, end), time.monotonic()."""
        return [(rec.to_model, list(rec.from_models), end - rec.seconds, end)
                for rec, end in zip(self.wakes, self.ended) if rec.result == "ok"]

    def phase_seconds(self, time_scale: float) -> dict[str, float]:
        """Real-time seconds the successful wakes spent in each phase, summed (the parks made for them too)."""
        out: dict[str, float] = {}
        for rec in self.wakes:
            if rec.result == "ok":
                for phase, s in rec.phases.items():
                    out[phase] = out.get(phase, 0.0) + s / time_scale
        return out

    def wake_kinds(self, time_scale: float) -> tuple[dict[str, int], dict[str, float]]:
        """Successful wakes by kind (level1 / level2 / boot) and their real-time seconds."""
        count: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for rec in self.wakes:
            if rec.result != "ok":
                continue
            kind = "boot" if "boot" in rec.phases else "level2" if "wake_weights" in rec.phases else "level1"
            count[kind] = count.get(kind, 0) + 1
            seconds[kind] = seconds.get(kind, 0.0) + rec.seconds / time_scale
        return count, seconds


@dataclass
class Running:
    router: Any
    scheduler: Any
    recorder: Recorder
    base_url: str


@contextlib.asynccontextmanager
async def running_router(roster_text: str, name: str, log_dir: Path, deadline: float,
                         setup: Any = None) -> AsyncIterator[Running]:
    """A router on `roster_text`, booted (every engine's first boot ended), stopped with its engines
    on the way out. `setup(scheduler)`: called before the start, to set what the bench changes."""
    import aiohttp
    from aiohttp import web

    from config import parse_roster
    from engines.engine import State
    from router.app import build_app, build_router

    spec = parse_roster(roster_text, f"<{name}>")
    log_dir.mkdir(parents=True, exist_ok=True)
    async with aiohttp.ClientSession() as session:
        router = build_router(spec, log_dir, session)
        scheduler = router.placement
        if setup is not None:
            setup(scheduler)
        recorder = Recorder(scheduler.events)
        scheduler.events = recorder
        runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, spec.listen.host, spec.listen.port).start()
        try:
            router.start()
            try:
                async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                    await scheduler.boot_done.wait()
            except TimeoutError:
                raise Failed(f"{name}: engines not booted within --max-seconds; logs in {log_dir}") from None
            failed = [f"{e.name}: {e.failure}" for e in router.engines.values() if e.state is State.FAILED]
            if failed:
                raise Failed(f"{name}: engines failed to boot (logs in {log_dir}):\n" + "\n".join(failed))
            yield Running(router, scheduler, recorder, f"http://{spec.listen.host}:{spec.listen.port}")
        finally:
            await router.stop()
            await runner.cleanup()
            for e in router.engines.values():  # the router stops its engines; this is the backstop
                if e.process is not None and e.process.pid and e.process.returncode is None:
                    h.killpg(e.process.pid, signal.SIGKILL)


async def at_arrival_times(arrivals: list[tuple[float, Any]], scale: float, deadline: float, name: str,
                           progress: int = 200) -> tuple[list[float], float]:
    """Start each `(t, make)` job (`make()` returns a coroutine) at t × `scale` wall seconds from now, then
    wait for all of them, at most until `deadline`. Returns each job's send lag (how late it was started,
    wall) and the replay's wall seconds."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Any]] = []
    lag: list[float] = []
    t0 = loop.time() + 0.05
    try:
        for i, (t, make) in enumerate(arrivals):
            at = t0 + t * scale
            if time.monotonic() > deadline:
                raise Failed(f"{name}: --max-seconds reached while replaying (request {i})")
            await asyncio.sleep(max(0.0, at - loop.time()))  # the trace's arrival time, not a readiness wait
            lag.append(loop.time() - at)
            tasks.append(asyncio.create_task(make()))
            if i % progress == progress - 1:
                print(f"  {name}: {i + 1}/{len(arrivals)} sent", flush=True)
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                await asyncio.gather(*tasks)
        except TimeoutError:
            raise Failed(f"{name}: requests still open at --max-seconds") from None
        return lag, loop.time() - t0
    finally:
        for task in tasks:  # only after a failure or an interruption are any left
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def first_errors(per_run: list[list[str]], each: int = 2) -> list[str]:
    """Report lines quoting the first errors of each run (none: no lines)."""
    errs = [e for errors in per_run for e in errors[:each]]
    return ["", "First errors: " + "; ".join(f"`{e[:160]}`" for e in errs)] if errs else []
