"""One GPU group's swap scheduler: at most one engine awake, every other model's requests queued.

Requests for the awake, promoted model are leased at once. Others wait in their model's
queue. A swap to the model with the oldest waiter starts when the awake engine is idle, or
when that waiter has waited `max_hold_s` (fairness), but never before the awake engine has
been awake `min_active_s` (no thrash). One loop per group asks `decide` what to do next and
does it, so there is never more than one swap in flight in a group. Whatever goes wrong
inside an action is contained to the engine it concerns: that engine is FAILED, its waiters
get a 503, and the loop goes on serving the group's other models.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from config.schema import Queue, Swap
from engines.engine import Engine, EngineFailed, State
from router.backoff import Backoff
from router.errors import APIError
from router.tasks import spawn

log = logging.getLogger("hotswap")

# States an engine is only in while the group's loop drives it through an action.
MID_TRANSITION = frozenset({State.BOOTING, State.DRAINING, State.WAKING, State.VERIFYING})


@dataclass
class Waiter:
    engine: Engine
    since: float
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class SwapRecord:
    group: str
    from_model: Optional[str]
    to_model: str
    result: str  # "ok" | "failed"
    seconds: float
    phases: dict[str, float]
    at: float = field(default_factory=time.time)
    error: Optional[str] = None


@dataclass
class Command:
    """An admin action, run by the group's loop between decisions."""

    engine: Engine
    name: str
    action: Callable[[], Awaitable[str]]
    future: asyncio.Future[str]


@dataclass(frozen=True)
class Decision:
    """What the group's loop does next: an action on an engine, or wait (at most `wait_s`; None: until poked)."""

    action: Optional[str] = None  # "swap" | "park" | "restart" | "failed"
    engine: Optional[Engine] = None
    why: str = ""
    wait_s: Optional[float] = None


class GroupScheduler:
    def __init__(self, name: str, engines: list[Engine], swap: Swap, limits: Queue, on_swap=None,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.engines = engines
        self.swap = swap
        self.limits = limits
        self.on_swap = on_swap or (lambda record: None)
        self.clock = clock
        self.waiting: dict[str, collections.deque[Waiter]] = {e.name: collections.deque() for e in engines}
        self.active: Optional[Engine] = None
        self.booted = False
        self.boot_done = asyncio.Event()
        self.backoff = Backoff([e.name for e in engines], clock)
        self.history: collections.deque[SwapRecord] = collections.deque(maxlen=20)
        self._commands: collections.deque[Command] = collections.deque()
        self._poke = asyncio.Event()
        self._closing = False  # shutting down: no new requests; the queued ones are still served
        self._stopping = False
        self._task: Optional[asyncio.Task[None]] = None

    # -- what handlers call ----------------------------------------------------------------

    async def acquire(self, engine: Engine) -> None:
        """Return with a lease on `engine` (AWAKE, promoted), or raise an APIError."""
        if self._closing:
            raise APIError(503, "the router is shutting down; retry on another instance", "shutting_down", retry_after=5)
        if engine is self.active and engine.try_lease():
            return
        if self.backoff.waiting(engine, self.clock()):
            raise self.backoff.unavailable(engine)
        queue = self.waiting[engine.name]
        if len(queue) >= self.limits.max_waiting:
            raise APIError(429, f"model '{engine.name}' has {len(queue)} requests waiting (queue.max_waiting); retry later",
                           "queue_full", retry_after=self._expected_wait())
        waiter = Waiter(engine, self.clock())
        queue.append(waiter)
        self.poke()
        try:
            await asyncio.wait({waiter.future}, timeout=self.limits.max_wait_s)
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(engine)
            self._forget(waiter)
            raise
        if not waiter.future.done():
            self._forget(waiter)
            raise APIError(503, f"model '{engine.name}' did not become ready within queue.max_wait_s={self.limits.max_wait_s:g} s "
                           f"(engine state: {engine.state.value})", "model_not_ready", retry_after=self._expected_wait())
        waiter.future.result()  # raises the APIError a failed engine left for its waiters

    def release(self, engine: Engine) -> None:
        engine.release()
        if engine.in_flight == 0:
            self.poke()

    def poke(self) -> None:
        self._poke.set()

    @property
    def last_swap(self) -> Optional[SwapRecord]:
        return self.history[-1] if self.history else None

    def queued(self, engine: Engine) -> int:
        return len(self.waiting[engine.name])

    def close(self) -> None:
        """Refuse new requests (they may still arrive over kept-alive connections); serve those queued."""
        self._closing = True

    # -- admin actions: run by the group's loop between decisions, never beside a swap -------------

    async def swap_in(self, engine: Engine) -> str:
        async def action() -> str:
            if engine is self.active and engine.state is State.AWAKE:
                return "already awake"
            await self._swap_to(engine)
            return self._outcome(engine)
        return await self._command(engine, "swap", action)

    async def sleep(self, engine: Engine) -> str:
        async def action() -> str:
            if engine is not self.active or engine.state is not State.AWAKE:
                return f"not awake ({engine.state.value})"
            await self._park(engine, "on request")
            return self._outcome(engine)
        return await self._command(engine, "sleep", action)

    async def restart(self, engine: Engine) -> str:
        async def action() -> str:
            if engine is self.active and engine.state is State.AWAKE:
                await self._restart_in_place(engine, "admin")  # drains first, like a sleep
            else:
                await self._swap_to(engine, restart="admin")  # a cold boot needs the group's GPU: it becomes the active one
            return self._outcome(engine)
        return await self._command(engine, "restart", action)

    def _outcome(self, engine: Engine) -> str:
        if engine.state is State.FAILED:
            raise APIError(503, f"model '{engine.name}' failed: {engine.failure}", "engine_failed")
        return engine.state.value

    async def _command(self, engine: Engine, name: str, action: Callable[[], Awaitable[str]]) -> str:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._commands.append(Command(engine, name, action, future))
        self.poke()
        return await future

    async def _run_command(self, command: "Command") -> None:
        if command.future.done():  # the admin client gave up before its turn
            return
        try:
            result = await command.action()
        except APIError as exc:
            command.future.set_exception(exc)
        except Exception as exc:  # a defect: the admin caller hears of it now, not at its own timeout
            log.exception("group %s: internal error in admin %s %s", self.name, command.name, command.engine.name)
            await self._defect(f"admin {command.name}", exc, command.engine)
            if not command.future.done():
                command.future.set_exception(APIError(500, f"admin {command.name} {command.engine.name} failed on an internal "
                                                      f"error: {exc!r} (traceback in the router log)", "internal_error"))
        else:
            if not command.future.done():
                command.future.set_result(result)

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = spawn(self._run(), f"scheduler:{self.name}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for queue in self.waiting.values():
            while queue:
                self._fail(queue.popleft(), APIError(503, "the router is shutting down; retry on another instance",
                                                     "shutting_down", retry_after=5))

    async def _run(self) -> None:
        await self._boot_all()
        while not self._stopping:
            self._poke.clear()
            if self._commands:
                await self._run_command(self._commands.popleft())
                continue
            decision = self.decide(self.clock())
            if decision.action is not None:
                await self._act(decision)
                continue
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that
                # lands as the poke completes, and stop() would then wait on this loop forever.
                async with asyncio.timeout(decision.wait_s):
                    await self._poke.wait()
            except TimeoutError:
                pass

    def decide(self, now: float) -> Decision:
        """What to do next. Grants leases to the awake engine's waiters on the way (no awaiting)."""
        active = self.active
        if active is not None and active.state is not State.AWAKE:  # e.g. its process died while serving
            return Decision("failed", active, active.failure or f"engine {active.name} left the awake state")
        if active is not None:
            if active.needs_restart:
                return Decision("restart", active, active.needs_restart)
            self._grant(active)
        target, oldest = self._next_target(now)
        if target is None:
            idle = self.swap.idle_sleep_s
            if active is not None and idle is not None and active.in_flight == 0:
                idle_for = now - active.last_used
                if idle_for >= idle and now - active.since >= self.swap.min_active_s:
                    return Decision("park", active, f"idle for {idle_for:.0f} s")
                return Decision(wait_s=max(idle - idle_for, self.swap.min_active_s - (now - active.since), 0.01))
            return Decision()
        if active is None:
            return Decision("swap", target)
        awake_for = now - active.since
        if awake_for < self.swap.min_active_s:
            return Decision(wait_s=self.swap.min_active_s - awake_for)
        if active.in_flight == 0 or now - oldest >= self.swap.max_hold_s:
            return Decision("swap", target)
        return Decision(wait_s=oldest + self.swap.max_hold_s - now)

    async def _act(self, decision: Decision) -> None:
        engine = decision.engine
        try:
            if decision.action == "swap":
                await self._swap_to(engine)
            elif decision.action == "park":
                await self._park(engine, decision.why)
            elif decision.action == "restart":
                log.warning("group %s: restarting %s now (mid-life acceptance collapse: %s); its requests wait",
                            self.name, engine.name, decision.why)
                await self._restart_in_place(engine, "midlife")
            else:
                await self._handle_failure(engine, decision.why)
        except Exception as exc:  # a defect: contained to the engine the action concerned
            log.exception("group %s: internal error during %s %s", self.name, decision.action, engine.name)
            await self._defect(decision.action or "", exc, engine)

    def _next_target(self, now: float) -> tuple[Optional[Engine], float]:
        """The model (other than the awake one) whose oldest waiter has waited longest."""
        best: Optional[Engine] = None
        best_since = float("inf")
        for engine in self.engines:
            queue = self.waiting[engine.name]
            if engine is self.active or not queue:
                continue
            if self.backoff.waiting(engine, now):
                self._fail_waiters(engine, self.backoff.unavailable(engine))
                continue
            if queue[0].since < best_since:
                best, best_since = engine, queue[0].since
        return best, best_since

    def _grant(self, engine: Engine) -> None:
        queue = self.waiting[engine.name]
        while queue and engine.try_lease():
            waiter = queue.popleft()
            if waiter.future.done():  # its client left; give the lease back
                engine.release()
            else:
                waiter.future.set_result(None)

    # -- boot, swap, park ----------------------------------------------------------------------

    async def _boot_all(self) -> None:
        """Boot one engine at a time, so each sees the whole GPU; the group's default boots last and stays awake."""
        default = next((e for e in self.engines if e.spec.default), self.engines[0])
        order = [e for e in self.engines if e is not default] + [default]
        for i, engine in enumerate(order, 1):
            log.info("group %s: booting %s (%d/%d)", self.name, engine.name, i, len(order))
            started = time.monotonic()
            try:
                await engine.boot()
                if engine is not default:
                    await engine.sleep()
            except EngineFailed as exc:
                await self._handle_failure(engine, str(exc))
                continue
            except Exception as exc:  # a defect: this engine fails, the others still boot
                log.exception("group %s: internal error while booting %s", self.name, engine.name)
                await self._defect("boot", exc, engine)
                continue
            log.info("group %s: %s booted in %.1f s%s", self.name, engine.name, time.monotonic() - started,
                     "" if engine is default else f", asleep at level {engine.sleep_level}")
        self.active = default if default.state is State.AWAKE else None
        self.booted = True
        self.boot_done.set()
        self.poke()

    async def _swap_to(self, target: Engine, restart: Optional[str] = None) -> None:
        old = self.active
        started = time.monotonic()
        phases: dict[str, float] = {}
        log.info("group %s: swap %s -> %s (%d waiting)", self.name, old.name if old else "(none)", target.name, self.queued(target))
        if old is not None:
            try:
                await old.sleep()
            except EngineFailed as exc:
                await self._handle_failure(old, str(exc))
            phases.update(old.last_phases)
        self.active = None
        try:
            if restart is not None:
                await target.restart(restart)
            elif target.state is State.SLEEPING:
                await target.wake()
            else:
                await target.restart("failed")
        except EngineFailed as exc:
            phases.update(target.last_phases)
            await self._handle_failure(target, str(exc))
            self._record(SwapRecord(self.name, old.name if old else None, target.name, "failed", time.monotonic() - started, phases, error=str(exc)))
            return
        phases.update(target.last_phases)
        self.backoff.succeeded(target.name)
        self.active = target
        self._grant(target)
        self._record(SwapRecord(self.name, old.name if old else None, target.name, "ok", time.monotonic() - started, phases))

    async def _restart_in_place(self, engine: Engine, reason: str) -> None:
        try:
            await engine.restart(reason)
        except EngineFailed as exc:
            await self._handle_failure(engine, str(exc))

    async def _park(self, engine: Engine, why: str) -> None:
        log.info("group %s: parking %s (%s), sleep level %d", self.name, engine.name, why, engine.spec.sleep_level)
        self.active = None
        try:
            await engine.sleep()
        except EngineFailed as exc:
            await self._handle_failure(engine, str(exc))

    def _record(self, record: SwapRecord) -> None:
        self.history.append(record)
        steps = ", ".join(f"{k} {v:.2f}" for k, v in record.phases.items())
        if record.result == "ok":
            log.info("group %s: swap %s -> %s took %.2f s: %s", self.name, record.from_model, record.to_model, record.seconds, steps)
        else:  # the engine has logged its failure in full; one line here ties it to the swap
            log.error("group %s: swap %s -> %s failed after %.2f s: %s", self.name, record.from_model, record.to_model,
                      record.seconds, (record.error or "").splitlines()[0])
        self.on_swap(record)

    # -- failures ------------------------------------------------------------------------------

    async def _handle_failure(self, engine: Engine, reason: str) -> None:
        self._count_failure(engine, reason)
        await engine.stop_after_failure()  # a broken engine must not keep holding the GPU

    def _count_failure(self, engine: Engine, reason: str) -> None:
        """One failure, counted once: the engine leaves the group's GPU, its waiters hear why at once."""
        if engine is self.active:
            self.active = None
        delay = self.backoff.failed(engine.name)
        self._fail_waiters(engine, APIError(503, f"model '{engine.name}' is unavailable: {reason}", "engine_failed",
                                            retry_after=max(1.0, delay)))

    async def _defect(self, what: str, exc: Exception, engine: Engine) -> None:
        """After an unexpected exception (its traceback already logged): `engine`, and any engine
        left mid-transition with nothing driving it any more, end FAILED, and their waiters get a 503."""
        cause = f"internal error during {what}: {exc!r} (traceback in the router log)"
        for e in self.engines:
            if e.state is not State.FAILED and (e is engine or e.state in MID_TRANSITION):
                self._count_failure(e, str(e.fail(cause)))
                try:
                    await e.stop_after_failure()
                except Exception:
                    log.exception("group %s: could not stop %s after an internal error", self.name, e.name)
        if self.active is not None and self.active.state is not State.AWAKE:
            self.active = None

    def _fail_waiters(self, engine: Engine, error: APIError) -> None:
        queue = self.waiting[engine.name]
        while queue:
            self._fail(queue.popleft(), error)

    @staticmethod
    def _fail(waiter: Waiter, error: APIError) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def _forget(self, waiter: Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
        try:
            self.waiting[waiter.engine.name].remove(waiter)
        except ValueError:
            pass

    def _expected_wait(self) -> float:
        return self.last_swap.seconds + 1 if self.last_swap else self.swap.max_hold_s
