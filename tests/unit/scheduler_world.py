"""A deterministic world for the real `Scheduler`: virtual time, simulated engines, simulated clients.

The scheduler runs as it does in the router (its own loop, its actions as tasks, `acquire` and
`release` as the proxy calls them), on an event loop whose clock is the simulation's: timers fire
when `advance` moves time past them, and no real time passes, so a run of hours takes
milliseconds and replays exactly. Nothing here decides anything: the engines do what vLLM would
(drain, sleep, wake, fail), the clients ask, hold and leave, and `tests/unit/test_scheduler_invariants.py`
judges the scheduler's decisions. In the style of FoundationDB's simulation testing.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from config.schema import ModelSpec
from engines.engine import EngineFailed, State
from engines.leases import Leases
from engines.memory import PRIOR_FACTOR
from engines.memory.host import GB, HostMemory
from engines.waking.stage import Stager

MAX_LOOP_PASSES = 20_000  # ready callbacks run back to back, with no time passing, before a run counts as a spin


class Spin(AssertionError):
    """The scheduler kept the loop busy without time passing (a decide/act cycle that never rests)."""


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is the simulation's: `advance` moves it from timer to timer."""

    def __init__(self, start: float = 1000.0) -> None:
        super().__init__()
        self.now = start
        select = self._selector.select  # type: ignore[attr-defined]

        def never_blocks(timeout: Optional[float] = None) -> Any:
            if timeout is None or timeout > 0:  # only `settle` and `advance` run the loop, and only while work is due
                raise Spin(f"the loop was asked to wait {timeout} s of real time at t={self.now:.3f}")
            return select(timeout)

        self._selector.select = never_blocks  # type: ignore[attr-defined]

    def time(self) -> float:
        return self.now

    def _next_timer(self) -> Optional[float]:
        scheduled = self._scheduled  # type: ignore[attr-defined]  # asyncio's timer heap
        while scheduled and scheduled[0]._cancelled:
            heapq.heappop(scheduled)
        return scheduled[0].when() if scheduled else None

    def settle(self) -> None:
        """Run everything that is ready now, without moving time."""
        for _ in range(MAX_LOOP_PASSES):
            due = self._next_timer()
            if not self._ready and (due is None or due > self.now):  # type: ignore[attr-defined]
                return
            self.run_until_complete(asyncio.sleep(0))
        raise Spin(f"the loop was still busy after {MAX_LOOP_PASSES} passes at t={self.now:.3f}: something spins")

    def run_virtually(self, coro: Any, limit_s: float = 3600.0) -> Any:
        """`run_until_complete`, with time moving from timer to timer: a timer it awaits would otherwise be
        waited for in real time."""
        task = self.create_task(coro)
        until = self.now + limit_s
        self.settle()
        while not task.done():
            due = self._next_timer()
            if due is None or due > until:
                raise Spin(f"{coro!r} did not end within {limit_s:g} s of simulated time")
            self.now = max(self.now, due)
            self.settle()
        return task.result()

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, stopping at every timer on the way (a discrete-event step)."""
        until = self.now + seconds
        self.settle()
        while (due := self._next_timer()) is not None and due <= until:
            self.now = max(self.now, due)
            self.settle()
        self.now = until
        self.settle()


@dataclass(frozen=True)
class Timing:
    """What one simulated engine's steps take, in seconds (drawn per engine: models differ)."""

    boot_s: float = 20.0
    wake_s: tuple[float, float, float] = (0.5, 2.0, 8.0)  # from level 0, 1, 2
    sleep_s: float = 1.0
    gate_s: float = 0.5


@dataclass(frozen=True)
class HostModel:
    """What a Level-1 sleep pins in host RAM, and whether it is measured (engines/memory/host.py). Whether a
    Level-1 wake gives the copy back follows the engine's argv, as on a GPU host: the worker extension,
    which the router loads where it reloads a draft or stages (`HostMemory.expects_extension`), empties
    PyTorch's host cache; without it the copy stays cached until the engine stops."""

    level1_factor: float = PRIOR_FACTOR  # × the checkpoint: power-of-two rounding makes it 1 to 2
    measured: bool = True  # the extension (or /proc) reports it; else the scheduler counts the prior


class SimEngine:
    """An engine as the scheduler sees it (the attributes `engines.engine.Engine` has), whose actions
    take virtual time and can be made to fail. `faults`: the next actions that fail ("boot", "wake",
    "sleep"), or take a step's whole timeout first ("slow")."""

    def __init__(self, world: "World", spec: ModelSpec, timing: Timing, host: HostModel, weights_gb: Optional[float]):
        self.world = world
        self.name = spec.name
        self.spec = spec
        self.timing = timing
        self.host_model = host
        self.weights_gb = weights_gb
        self.state = State.COLD
        self.since = world.loop.now
        self.last_used = world.loop.now
        self.sleep_level: Optional[int] = None
        self.leases = Leases(spec.name, lambda: world.swap.demand_tau_s)  # the real count, and its mean time held
        self.gate = SimpleNamespace(needs_restart=None)
        self.retiring = False
        self.failure: Optional[str] = None
        self.process: Optional[object] = None
        self.alive = False  # its process runs (and may hold GPU memory)
        self.host = HostMemory(spec)
        self.stager = Stager(spec.name, enabled=False)
        self.client = None
        self.last_phases: dict[str, float] = {}
        self.progress = SimpleNamespace(gates=[])
        self.restarts: collections.Counter[str] = collections.Counter()
        self.observer = SimpleNamespace(restarted=lambda engine, reason: None)
        self.faults: list[str] = []
        self.failed_from: tuple[State, Optional[int]] = (State.COLD, None)
        self.pinned_gb = 0.0  # the truth of what its process pins in host RAM (the measurement may not see it)
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()
        self.cut_reason = "drain_deadline"  # why its last streams were cut
        self.preempted = 0  # streams cut by preemptions, in all

    # -- what placement and the scheduler read ------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self.leases.count

    @property
    def holds_process(self) -> bool:
        return self.alive

    def try_lease(self) -> bool:
        if self.state is not State.AWAKE:
            return False
        self.leases.take()
        self._idle.clear()
        return True

    def release(self) -> None:
        self.last_used = self.leases.give_back()
        if self.leases.count == 0:
            self._idle.set()

    async def serve(self, seconds: float) -> bool:
        """A leaseholder's request: True if it ran to its end, False if it was cut (drain deadline, a death)."""
        cut = self._cut
        try:
            async with asyncio.timeout(seconds):
                await cut.wait()
            return False
        except TimeoutError:
            return True

    # -- transitions ----------------------------------------------------------------------------------

    def _enter(self, state: State) -> None:
        if self.state is State.FAILED and state is not State.COLD:
            raise EngineFailed(self.failure or f"engine {self.name} failed")
        self.state, self.since = state, self.world.loop.now
        if state in (State.AWAKE, State.COLD):
            self.sleep_level = None
        if state is State.AWAKE:
            self._cut = asyncio.Event()  # what serves now was not there when the last streams were cut

    def fail(self, what: str) -> EngineFailed:
        if self.state is not State.FAILED:
            self.failed_from = (self.state, self.sleep_level)  # what its dying process still holds on the GPU
            self.state, self.since, self.failure = State.FAILED, self.world.loop.now, f"engine {self.name}: {what}"
            self.cut_reason = "engine_failed"
            self._cut.set()  # its streams end with it
        return EngineFailed(self.failure or what)

    async def _take(self, seconds: float, step: str) -> None:
        """One step: its time, then the fault planted for it, if any; a death meanwhile fails it."""
        if "slow" in self.faults:
            self.faults.remove("slow")
            await asyncio.sleep(seconds + self.world.step_timeout_s)
            raise self.fail(f"{step} timed out after {self.world.step_timeout_s:g} s")
        await asyncio.sleep(seconds)
        if self.state is State.FAILED:
            raise EngineFailed(self.failure or f"engine {self.name} failed during {step}")
        if step in self.faults:
            self.faults.remove(step)
            raise self.fail(f"{step} failed (planted fault)")

    async def boot(self, reason: Optional[str] = None) -> None:
        self._enter(State.BOOTING)
        self.alive, self.failure, self.gate.needs_restart = True, None, None
        self.host.reset(self.spec)
        await self._take(self.timing.boot_s, "boot")
        self._enter(State.AWAKE)

    async def drain(self, preempt: Optional[str] = None) -> bool:
        # The streams it cuts wait on the event of this awake period (a fresh one made here would reach none).
        self._enter(State.DRAINING)
        if preempt is not None:  # batch work yields at once: cut now, not at the deadline
            busy = self.leases.count > 0
            self.preempted += self.leases.count
            self.cut_reason = "preempted"
            self._cut.set()
            await self._idle.wait()
            return not busy
        self.cut_reason = "drain_deadline"
        try:
            async with asyncio.timeout(self.world.swap.drain_timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            self._cut.set()  # the streams past the deadline are cut; their clients give the leases back
            await self._idle.wait()
            return False

    async def sleep(self, level: Optional[int] = None, preempt: Optional[str] = None) -> None:
        level = 2 if level is None else level
        await self.drain(preempt)
        await self._take(self.timing.sleep_s, "sleep")
        self._enter(State.SLEEPING)
        self.sleep_level = level
        self._after_sleep(level)

    async def park_further(self, level: int) -> None:
        if self.state is not State.SLEEPING or self.sleep_level != 0:
            raise self.fail(f"park_further from {self.state.value} level {self.sleep_level}")
        await self._take(self.timing.sleep_s, "sleep")
        self.sleep_level = level
        self._after_sleep(level)

    async def wake(self) -> None:
        if self.state is not State.SLEEPING:
            raise self.fail(f"wake from {self.state.value}")
        level = 2 if self.sleep_level is None else self.sleep_level
        self._enter(State.WAKING)
        await self._take(self.timing.wake_s[level], "wake")
        self._after_wake(level)
        self._enter(State.VERIFYING)
        await self._take(self.timing.gate_s, "gate")
        self._enter(State.AWAKE)

    async def demote(self) -> None:
        if self.state is not State.SLEEPING or self.sleep_level != 1:
            raise self.fail(f"demote from {self.state.value} level {self.sleep_level}")
        self._enter(State.WAKING)
        await self._take(self.timing.wake_s[1], "wake")
        self._after_wake(1)
        self._enter(State.DRAINING)
        await self._take(self.timing.sleep_s, "sleep")
        self._enter(State.SLEEPING)
        self.sleep_level = 2
        self._after_sleep(2)

    async def stop(self) -> None:
        self._enter(State.COLD)
        self._gone()

    async def stop_after_failure(self) -> None:
        self._gone()

    def _gone(self) -> None:
        self.alive, self.pinned_gb = False, 0.0
        self._cut.set()
        self.host.reset(self.spec)

    async def restart(self, reason: str) -> None:
        self.restarts[reason] += 1
        if self.state is State.AWAKE:
            await self.drain()
        await self.stop()
        await self.boot(reason)

    def adopt(self, spec: ModelSpec) -> None:
        self.spec = spec

    def respec(self, spec: ModelSpec) -> None:
        if self.state is not State.COLD:
            raise self.fail(f"respec while {self.state.value}")
        self.spec = spec
        self.host = HostMemory(spec)

    # -- host RAM: what engines/memory/host.py would measure ------------------------------------------

    def _level1_gb(self) -> float:
        return (self.weights_gb or 0.0) * self.host_model.level1_factor

    def _after_sleep(self, level: int) -> None:
        if level == 1:  # the caching host allocator reuses a cached block of the copy's size
            self.pinned_gb = max(self.pinned_gb, self._level1_gb())
            self.host.level1_copy = True
        self._measure()
        if level == 1 and self.host.held is not None:
            self.host.level1 = self.host.held

    def _after_wake(self, level: int) -> None:
        if level != 1:
            self._measure()
            return
        self.host.release_ok = self.host.expects_extension
        if self.host.release_ok:
            self.pinned_gb = 0.0
        self._measure()
        if self.host.release_ok and self.host.held is not None:
            self.host.level1_copy = False

    def _measure(self) -> None:
        if self.host_model.measured:
            self.host.held, self.host.source = int(self.pinned_gb * GB), "extension"
        else:
            self.host.held, self.host.source = None, "unmeasured"


@dataclass
class Client:
    """One request: who it asked for, in which class, and how it ended."""

    id: int
    engine: SimEngine
    klass: str
    hold_s: float
    asked: float
    outcome: Optional[str] = None  # None while waiting or served; granted | refused: REASON | left | cut
    served: bool = False  # holds its lease now
    resumed: int = 0  # times it was preempted and waited again for the rest (as the proxy does)
    waits_since: Optional[float] = None  # when its current wait began (a preempted client waits again, with a new deadline)
    task: Optional[asyncio.Task[None]] = field(default=None, repr=False)


class World:
    """The loop, the engines and the clients of one simulated run; the scheduler is attached by the test."""

    def __init__(self, swap: object, step_timeout_s: float = 120.0) -> None:
        self.loop = VirtualLoop()
        self.swap = swap
        self.step_timeout_s = step_timeout_s
        self.gpus: dict[int, float] = {}
        self.engines: dict[str, SimEngine] = {}
        self.clients: list[Client] = []

    def waiting(self) -> list[Client]:
        return [c for c in self.clients if c.outcome is None and not c.served]
