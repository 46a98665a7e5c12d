"""One engine's lifecycle as an explicit state machine (see DESIGN.md, "Engine states").

    COLD -> BOOTING -> AWAKE -> DRAINING -> SLEEPING -> WAKING -> VERIFYING -> AWAKE
    any step that fails, times out, or finds the process dead -> FAILED

Only an AWAKE engine may be leased to client traffic: a vLLM engine that is asleep accepts
generation requests and hangs them. Every transition goes through `_enter`, and every step
of a sleep or wake through `_step`, so both are visible in one place (and to the observer).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import aiohttp

from config.schema import ModelSpec, Swap
from engines import gate, wake
from engines.client import EngineError, EngineRefused, VLLMClient
from engines.process import EngineProcess, free_port

HEALTH_POLL_S = 0.25
log = logging.getLogger("hotswap")


class State(str, enum.Enum):
    COLD = "cold"
    BOOTING = "booting"
    AWAKE = "awake"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    WAKING = "waking"
    VERIFYING = "verifying"
    FAILED = "failed"


class EngineFailed(Exception):
    """A lifecycle step failed; the engine is FAILED. The message names engine, step and cause."""


class Observer:
    """Receives what an engine does (the router's metrics and logs implement this)."""

    def state_changed(self, engine: "Engine", old: State, new: State) -> None: ...

    def step_done(self, engine: "Engine", phase: str, seconds: float, ok: bool) -> None: ...

    def verdict(self, engine: "Engine", verdict: gate.Verdict) -> None: ...

    def restarted(self, engine: "Engine", reason: str) -> None: ...

    def midlife_collapse(self, engine: "Engine", observed_mal: float, reason: str) -> None: ...


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        swap: Swap,
        session: aiohttp.ClientSession,
        log_dir: Path,
        observer: Optional[Observer] = None,
    ):
        self.spec = spec
        self.name = spec.name
        self.swap = swap
        self.session = session
        self.log_dir = log_dir
        self.observer = observer or Observer()
        self.state = State.COLD
        self.since = time.monotonic()
        self.failure: Optional[str] = None
        self.sleep_level: Optional[int] = None
        self.served_name = spec.name
        self.served_names: frozenset[str] = frozenset([spec.name])
        self.process: Optional[EngineProcess] = None
        self.client: Optional[VLLMClient] = VLLMClient(spec.url, session, spec.engine_api_key) if spec.url else None
        self.port: Optional[int] = spec.port
        self.boot_deadline: Optional[float] = None
        self.last_phases: dict[str, float] = {}
        self.last_verdict: Optional[gate.Verdict] = None
        self.baseline: Optional[gate.Canary] = None  # from the first cold boot; kept across restarts
        self.restarts: collections.Counter[str] = collections.Counter()
        self.needs_restart: Optional[str] = None  # set by the mid-life watch; the scheduler acts when idle
        self.collapsed = False
        self.observed_mal: Optional[float] = None
        self._acceptance: collections.deque[tuple[float, float, float]] = collections.deque()
        self.in_flight = 0
        self.last_used = time.monotonic()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._watch: Optional[asyncio.Task[None]] = None

    # -- what the router reads -----------------------------------------------------------

    @property
    def promoted(self) -> bool:
        return self.state is State.AWAKE

    @property
    def serviceable(self) -> bool:
        """Booted and gated: awake, or parked and wakeable on demand."""
        return self.state in (State.AWAKE, State.DRAINING, State.SLEEPING, State.WAKING, State.VERIFYING)

    def last_log_lines(self, n: int = 20) -> list[str]:
        return self.process.last_lines(n) if self.process else []

    # -- leases: client traffic on an AWAKE engine ----------------------------------------

    def try_lease(self) -> bool:
        if self.state is not State.AWAKE:
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no lease is held (True), or `timeout` (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def release(self) -> None:
        self.in_flight -= 1
        self.last_used = time.monotonic()
        if self.in_flight == 0:
            self._idle.set()

    # -- transitions ---------------------------------------------------------------------

    def _enter(self, new: State, failure: Optional[str] = None) -> None:
        old, self.state, self.since = self.state, new, time.monotonic()
        self.failure = failure
        if new is State.AWAKE:
            self.sleep_level = None
        self.observer.state_changed(self, old, new)

    async def _step(self, phase: str, action: Callable[[float], Awaitable[Any]], timeout: Optional[float] = None) -> Any:
        """Run one named step under its own timeout; record its duration; FAILED on any error."""
        timeout = timeout if timeout is not None else getattr(self.swap.timeouts, phase)
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                result = await action(timeout)
        except (EngineError, TimeoutError, OSError) as exc:
            seconds = time.monotonic() - started
            self.last_phases[phase] = seconds
            self.observer.step_done(self, phase, seconds, False)
            cause = f"no answer within {timeout:.3g} s" if isinstance(exc, TimeoutError) else str(exc)
            if isinstance(exc, EngineRefused):
                await self._reap_briefly()  # so the message can say how the process ended
            raise self._fail(f"{phase} failed: {cause}") from None
        seconds = time.monotonic() - started
        self.last_phases[phase] = seconds
        self.observer.step_done(self, phase, seconds, True)
        return result

    async def _reap_briefly(self, timeout: float = 2.0) -> None:
        if self.process is not None and self.process.proc is not None:
            await asyncio.wait({asyncio.ensure_future(self.process.wait())}, timeout=timeout)

    def _fail(self, what: str) -> EngineFailed:
        message = f"engine {self.name}: {what}"
        code = self.process.returncode if self.process else None
        if code is not None:
            message += f" (process exited with code {code})"
            lines = self.last_log_lines(8)
            if lines:
                message += "; last log lines:\n  " + "\n  ".join(lines)
        self._enter(State.FAILED, message)
        return EngineFailed(message)

    # -- boot --------------------------------------------------------------------------------

    async def boot(self) -> None:
        """Start (or attach), wait until healthy, learn the served name, record the baseline."""
        started = time.monotonic()
        try:
            await self._boot()
        except EngineFailed:
            self.boot_deadline = None  # a FAILED engine has no boot deadline to show
            self.observer.step_done(self, "boot", time.monotonic() - started, False)
            raise

    async def _boot(self) -> None:
        self.last_phases = {}
        self._enter(State.BOOTING)
        self.boot_deadline = time.monotonic() + self.swap.boot_timeout_s
        started = time.monotonic()
        if self.spec.managed:
            await self._start_process()
        assert self.client is not None
        await self._wait_healthy()
        try:
            served = await self.client.served_models(timeout=30)
        except EngineError as exc:
            raise self._fail(f"boot failed: {exc}") from None
        self.served_names = frozenset(served)
        self.served_name = self.spec.name if self.spec.name in served or not served else served[0]
        self.last_phases["boot"] = time.monotonic() - started
        self.observer.step_done(self, "boot", self.last_phases["boot"], True)
        self.boot_deadline = None
        verdict = await self._judged_canary()
        if not verdict.passed:
            raise self._fail(f"gate refused promotion after a cold boot: {verdict.reason}")
        self._reset_acceptance_watch()
        self._enter(State.AWAKE)

    async def _start_process(self) -> None:
        if self.process is not None:
            await self.process.stop()
        self.port = self.spec.port or free_port()
        self.process = EngineProcess(self.spec, self.port, self.log_dir)
        self.client = VLLMClient(f"http://127.0.0.1:{self.port}", self.session, self.spec.engine_api_key)
        self._stopping = False
        try:
            await self.process.start()
        except OSError as exc:
            raise self._fail(f"cannot start {self.process.argv[0]!r}: {exc}") from None
        self._watch = asyncio.create_task(self._watch_process(self.process), name=f"watch:{self.name}")

    async def _wait_healthy(self) -> None:
        assert self.client is not None and self.boot_deadline is not None
        last_error = "no answer yet"
        while time.monotonic() < self.boot_deadline:
            if self.process is not None and self.process.returncode is not None:
                await self.process.wait()  # the last log lines explain why
                raise self._fail("exited during boot")
            try:
                await self.client.health(timeout=min(5.0, max(0.1, self.boot_deadline - time.monotonic())))
                return
            except EngineError as exc:
                last_error = str(exc)
            await asyncio.sleep(HEALTH_POLL_S)
        raise self._fail(f"not healthy within boot_timeout_s={self.swap.boot_timeout_s:g} s (last: {last_error})")

    async def _watch_process(self, process: EngineProcess) -> None:
        await process.wait()
        if process is self.process and not self._stopping and self.state is not State.FAILED:
            self._fail(f"process died unexpectedly in state {self.state.value}")

    # -- sleep ---------------------------------------------------------------------------

    async def sleep(self, level: Optional[int] = None) -> None:
        """Stop leasing, let in-flight requests finish (bounded), then put vLLM to sleep."""
        level = level or self.spec.sleep_level
        self._enter(State.DRAINING)
        self.last_phases = {}
        started = time.monotonic()
        # past the drain deadline the stragglers are cut, not waited on
        mode = "wait" if await self.wait_idle(self.swap.drain_timeout_s) else "abort"
        self.last_phases["drain"] = time.monotonic() - started
        self.observer.step_done(self, "drain", self.last_phases["drain"], True)
        await self._step("sleep", lambda t: self.client.sleep(level, mode, timeout=t))
        self.sleep_level = level
        self._enter(State.SLEEPING)

    # -- wake ----------------------------------------------------------------------------

    async def wake(self) -> None:
        """The staged wake (engines.wake), then the promotion gate. AWAKE on success; FAILED (raised) otherwise."""
        if self.state is not State.SLEEPING:
            raise self._fail(f"wake asked in state {self.state.value}, not sleeping (internal error)")
        self.last_phases = {}
        self._enter(State.WAKING)
        for step in wake.steps(self.sleep_level or 2, self.spec.draft_restore):
            await self._step(step.phase, lambda t, run=step.run: run(self.client, t))
        self._enter(State.VERIFYING)
        verdict = await self._judged_canary()
        if verdict.passed:
            self._reset_acceptance_watch()
            self._enter(State.AWAKE)
        elif self.spec.gate.on_fail == "restart":
            log.warning("engine %s: gate refused promotion (%s); cold restart, then verify against the cold-boot baseline",
                        self.name, verdict.reason)
            wake_phases, started = dict(self.last_phases), time.monotonic()
            await self.restart("gate")
            self.last_phases = {**wake_phases, "restart": time.monotonic() - started}
        else:
            raise self._fail(f"gate refused promotion: {verdict.reason}")

    # -- the promotion gate ------------------------------------------------------------------

    @property
    def phases(self) -> list[str]:
        """The steps this engine's sleep and wake go through (for metrics that must exist up front)."""
        return ["sleep", *wake.phases(self.spec.sleep_level, self.spec.draft_restore), "gate"]

    @property
    def has_draft(self) -> bool:
        return self.spec.speculative is not None

    async def _judged_canary(self) -> gate.Verdict:
        """Run the canary; the first one on a cold engine is its baseline, every later one is judged against it."""
        verdict = await self._step("gate", self._run_gate)
        if verdict.result == "refused" and self.spec.gate.on_fail == "allow":
            verdict = verdict.allowed()
            log.error("engine %s: PROMOTED DESPITE A REFUSED GATE (gate.on_fail: allow): %s", self.name, verdict.reason)
        self.last_verdict = verdict
        if verdict.observed_mal is not None:
            self.observed_mal = verdict.observed_mal
        self.observer.verdict(self, verdict)
        return verdict

    async def _run_gate(self, timeout: float) -> gate.Verdict:
        if not self.spec.gate.enabled:
            return gate.skipped("gate.enabled is false: promoted without a canary")
        canary = await gate.run_canary(self.client, self.served_name, self.spec.gate, self.has_draft, timeout)
        if self.baseline is None:
            verdict = gate.baseline_verdict(canary)
            if verdict.passed:
                self.baseline = canary
            return verdict
        return gate.judge(self.baseline, canary, self.spec.gate)

    # -- mid-life acceptance watch ----------------------------------------------------------

    def _reset_acceptance_watch(self) -> None:
        self._acceptance.clear()
        self.collapsed = False
        self.needs_restart = None

    async def watch_acceptance(self) -> None:
        """Sample the spec-decode counters; flag a collapse over the sliding window (served traffic only)."""
        if self.state is not State.AWAKE or not self.has_draft or self.baseline is None or self.baseline.mal is None:
            return
        counters = gate.read_counters(await self.client.metrics(timeout=5))
        now = time.monotonic()
        window = self._acceptance
        window.append((now, counters.drafts, counters.accepted))
        while window and window[0][0] < now - self.spec.gate.midlife_window_s:
            window.popleft()
        _, drafts0, accepted0 = window[0]
        drafts = counters.drafts - drafts0
        if drafts < self.spec.gate.midlife_min_drafts:
            return
        mal = 1 + (counters.accepted - accepted0) / drafts
        self.observed_mal = mal
        problems = gate.acceptance_problems(self.baseline.mal, mal, self.spec.gate)
        if problems and not self.collapsed:
            self.collapsed = True
            reason = "; ".join(problems)
            log.error("engine %s: acceptance collapsed while serving: %s", self.name, reason)
            self.observer.midlife_collapse(self, mal, reason)
            if self.spec.gate.on_midlife == "restart":
                self.needs_restart = reason
        elif not problems:
            self.collapsed = False

    # -- stop and restart -------------------------------------------------------------------

    async def stop(self) -> None:
        self._stopping = True
        self._enter(State.COLD)  # first: no lease may be handed out to a process that is going away
        if self.process is not None:
            await self.process.stop()
        if self._watch is not None:
            await asyncio.wait({self._watch}, timeout=2)

    async def stop_after_failure(self) -> None:
        """Kill a FAILED engine's process (a broken engine must not hold GPU memory); stay FAILED."""
        self._stopping = True
        if self.process is not None:
            await self.process.stop()

    async def restart(self, reason: str) -> None:
        """Cold restart; the boot's canary is judged against the original baseline."""
        self.restarts[reason] += 1
        self.observer.restarted(self, reason)
        await self.stop()
        await self.boot()
