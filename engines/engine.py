"""One engine's lifecycle as an explicit state machine (see DESIGN.md, "Engine states").

Only an AWAKE engine may be leased to client traffic: a vLLM engine that is asleep accepts generation
requests and hangs them. Every transition goes through `_enter`, which refuses any that `TRANSITIONS`
does not list, so all are visible in one place (and to the observer). What runs between two of them,
step by step, is the engine's climb (engines.waking.climb: the ladder down, the staged wake back up,
the gate step, each timed and bounded). A failure, expected or not, leaves the engine FAILED with a
message naming the step and the cause; the first failure's message is the one kept.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import Callable, ContextManager, Optional

import aiohttp

from config.schema import ModelSpec, Swap
from engines.gate import GateRecord, Verdict
from engines.leases import DRAIN_DEADLINE, RESTART, Leases
from engines.memory import HostMemory
from engines.process import EngineProcess, free_port, loads_extension, log_file
from engines.progress import ROSTER, Progress
from engines.states import TRANSITIONS, EngineFailed, Observer, State
from engines.vllm import VLLMClient, attached_client
from engines.waking import Stager, handshake, ladder
from engines.waking.climb import Climb

__all__ = ["Engine", "EngineFailed", "Observer", "State", "TRANSITIONS"]

log = logging.getLogger("hotswap")


class Engine:
    def __init__(self, spec: ModelSpec, swap: Swap, session: aiohttp.ClientSession, log_dir: Path,
                 observer: Optional[Observer] = None):
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
        self.boot_names: frozenset[str] = frozenset(spec.names)  # the roster names it was started with (it serves them)
        self.process: Optional[EngineProcess] = None
        self.client: Optional[VLLMClient] = attached_client(spec, session)
        self.port: Optional[int] = spec.port
        self.progress = Progress()  # why it boots, the step it is in, the gate's story (engines.progress)
        self.last_phases: dict[str, float] = {}
        self.gate = GateRecord(spec.gate)  # baseline, verdicts, the acceptance watch (engines.gate.record)
        self.restarts: collections.Counter[str] = collections.Counter()
        self.retiring = False  # left the roster in a reload: no new requests; stopped once its own are done
        self.leases = Leases(self.name, lambda: self.swap.demand_tau_s)
        self.last_used = time.monotonic()
        self._stopping = False
        self._watch: Optional[asyncio.Task[None]] = None
        self.probe: Optional[asyncio.Task[None]] = None  # engines.watch's health probe, one at a time
        self.host = HostMemory(spec)  # what it holds in host RAM for sleep (engines.memory.host)
        self.stager = Stager(spec.name, loads_extension(spec))  # its checkpoint into the page cache (engines.waking.stage)
        self.climb = Climb(self)  # its steps between transitions, run one by one; the drill (engines.waking.climb)

    # -- what the router reads -----------------------------------------------------------

    @property
    def promoted(self) -> bool:
        return self.state is State.AWAKE

    @property
    def serviceable(self) -> bool:
        """Booted and gated: awake, or parked and wakeable on demand."""
        return self.state in (State.AWAKE, State.DRAINING, State.SLEEPING, State.WAKING, State.VERIFYING)

    @property
    def other_names(self) -> frozenset[str]:
        """Names it serves besides those the roster gave it: LoRA adapters, an attached engine's
        extra served names. An alias a reload removed is served until a restart, but is not one."""
        return self.served_names - self.boot_names

    @property
    def has_draft(self) -> bool:
        return self.spec.speculative is not None

    @property
    def phases(self) -> list[str]:
        """The steps this engine's sleep and wake go through (for metrics that must exist up front)."""
        return self.climb.phases()

    def wake_phases(self, level: int) -> list[str]:
        return self.climb.wake_phases(level)

    @property
    def sleep_levels(self) -> tuple[int, ...]:
        """The rungs this engine may be parked on (engines.waking.ladder; `auto`: all, chosen per park)."""
        return ladder.rungs(self.spec.sleep_level)

    @property
    def holds_process(self) -> bool:
        """Its process may still hold GPU memory (a FAILED engine's, until it is stopped; an attached one's always)."""
        if not self.spec.managed:
            return True
        return self.process is not None and self.process.returncode is None

    @property
    def log_path(self) -> Optional[Path]:
        """The file its process writes (it may not exist yet); None for an attached (`url:`) engine."""
        return log_file(self.log_dir, self.name) if self.spec.managed else None

    def last_log_lines(self, n: int = 20) -> list[str]:
        return self.process.last_lines(n) if self.process else []

    # -- leases: client traffic on an AWAKE engine ----------------------------------------

    @property
    def in_flight(self) -> int:
        return self.leases.count

    def try_lease(self) -> bool:
        if self.state is not State.AWAKE:
            return False
        self.leases.take()
        return True

    def release(self) -> None:
        self.last_used = self.leases.give_back()

    def cuttable(self, cut: Callable[[str, str], None], tokens: Optional[Callable[[], int]] = None) -> ContextManager[None]:
        """While a leaseholder's request runs: how to end it early, and what it would cost to compute again (`engines.leases`)."""
        return self.leases.cuttable(cut, tokens)

    # -- transitions ---------------------------------------------------------------------

    def _enter(self, new: State, failure: Optional[str] = None) -> None:
        old = self.state
        if new not in TRANSITIONS[old]:
            raise self._refuse_transition(old, new)
        self.state, self.since, self.failure = new, time.monotonic(), failure
        if new in (State.AWAKE, State.COLD):  # nothing of it is parked any more
            self.sleep_level = None
        self.observer.state_changed(self, old, new)

    def _refuse_transition(self, old: State, new: State) -> "EngineFailed":
        cause = f"internal error: transition {old.value} -> {new.value} is not allowed"
        if old is State.FAILED:  # e.g. the process died while a boot or wake was finishing: it stays FAILED
            log.error("engine %s: %s; it stays failed: %s", self.name, cause, self.failure)
            return EngineFailed(self.failure or f"engine {self.name}: {cause}")
        log.error("engine %s: %s", self.name, cause, stack_info=True)
        return self.fail(cause)

    def fail(self, what: str) -> "EngineFailed":
        """Enter FAILED with a message naming the engine, the step and the cause; log it once.
        Public: the scheduler's guard against its own defects, engines.watch and the climb's steps use it too.

        An engine that is already FAILED keeps its first message: later errors are echoes of it."""
        if self.state is State.FAILED:
            return EngineFailed(self.failure or f"engine {self.name}: {what}")
        message = f"engine {self.name}: {what}{self.process.how_it_ended() if self.process else ''}"
        log.error("%s", message)
        self._enter(State.FAILED, message)
        return EngineFailed(message)

    # -- boot --------------------------------------------------------------------------------

    async def boot(self, reason: Optional[str] = None) -> None:
        """Start (or attach), wait until healthy, learn the served name, record the baseline. Why: `reason`, see engines.progress."""
        started = time.monotonic()
        try:
            await self._boot(reason)
        except EngineFailed:
            self.progress.boot_over()  # a FAILED engine has no boot deadline or step to show
            self.observer.step_done(self, "boot", time.monotonic() - started, False)
            raise

    async def _boot(self, reason: Optional[str]) -> None:
        self.last_phases = {}
        self.host.reset(self.spec)  # a new process holds nothing for sleep
        self.stager.booting(loads_extension(self.spec))  # as the argv this boot composes from the entry in force
        deadline = self.progress.booting(reason, self.swap.boot_timeout_s)
        self._enter(State.BOOTING)
        started = time.monotonic()
        client = await self._start_process() if self.spec.managed else self.client
        if client is None:
            raise self.fail("boot failed: no engine URL (internal error)")
        self.progress.step = "load"  # until it answers /health and /v1/models
        try:
            served = await handshake.served_names(client, self.process, self.spec, self.port, deadline, self.swap.boot_timeout_s)
        except handshake.BootFailed as exc:
            if exc.exited and self.process is not None:
                await self.process.reap_briefly()  # the last log lines explain why
            raise self.fail(str(exc)) from None
        self.served_names = frozenset(served)
        self.boot_names = frozenset(self.spec.names)
        self.served_name = self.spec.name if self.spec.name in served or not served else served[0]
        self.stager.reloaded()  # the model's load read its checkpoint
        self.last_phases["boot"] = time.monotonic() - started
        self.observer.step_done(self, "boot", self.last_phases["boot"], True)
        self.progress.boot_over()
        verdict = await self._judged_canary()
        if not verdict.passed:
            raise self.fail(f"gate refused promotion after a cold boot: {verdict.reason}")
        self.gate.promoted()
        self._enter(State.AWAKE)

    async def _start_process(self) -> VLLMClient:
        if self.process is not None:
            await self.process.stop()
        self.port = self.spec.port or free_port()
        self.process = EngineProcess(self.spec, self.port, self.log_dir, kill_grace_s=self.swap.kill_grace_s)
        self.client = VLLMClient(f"http://127.0.0.1:{self.port}", self.session, self.spec.engine_api_key)
        self._stopping = False
        try:
            await self.process.start()
        except OSError as exc:
            raise self.fail(f"cannot start {self.process.argv[0]!r}: {exc}") from None
        self._watch = asyncio.create_task(self._watch_process(self.process), name=f"watch:{self.name}")
        return self.client

    async def _watch_process(self, process: EngineProcess) -> None:
        """Notice a death at once, in any state: a dead AWAKE engine must stop getting leases."""
        await process.wait()
        await self.climb.quiet.wait()  # a step in progress reports the death itself, naming the step
        if process is not self.process or self._stopping:
            return
        if self.state is State.FAILED:
            log.error("engine %s: process exited with code %s (it had already failed)", self.name, process.returncode)
            return
        self.fail("exited during boot" if self.state is State.BOOTING else f"process died unexpectedly in state {self.state.value}")

    # -- sleep ---------------------------------------------------------------------------

    async def drain(self, reason: str = DRAIN_DEADLINE, preempt: Optional[str] = None) -> bool:
        """Stop leasing; let in-flight requests finish, up to drain_timeout_s, then cut the rest
        (engines.leases). Before a sleep, and before a stop that takes a sleep's place. True if all finished.
        `preempt`: why its requests (batch work only, the scheduler has checked) are cut at once instead."""
        self._enter(State.DRAINING)
        started = time.monotonic()
        if preempt is not None:
            idle = not self.leases.count
            await self.leases.preempt(preempt)
        else:
            idle = await self.leases.drain(self.swap.drain_timeout_s, reason)
        self.climb.done("drain", started, True)
        return idle

    async def sleep(self, level: Optional[int] = None, preempt: Optional[str] = None) -> None:
        """Drain (or preempt: `drain`), then park vLLM on rung `level` (engines.waking.ladder; stragglers past the drain
        deadline are aborted)."""
        level = self.sleep_levels[-1] if level is None else level
        self.last_phases = {}
        mode = "wait" if await self.drain(preempt=preempt) else "abort"
        await self.host.before_sleep(self.client, self.process)
        await self.climb.down(level, mode)
        self.sleep_level = level
        self._enter(State.SLEEPING)
        await self.host.after_sleep(self.client, self.process, level)

    async def park_further(self, level: int) -> None:
        """A KV-parked engine down to Level 1 or 2 without waking it (engines.waking.ladder.further): its
        weights leave the GPU. It stays SLEEPING throughout; the observer hears SLEEPING -> SLEEPING
        once it is on its new rung."""
        if self.state is not State.SLEEPING or self.sleep_level != ladder.KV_PARKED or level <= ladder.KV_PARKED:
            raise self._refuse_transition(self.state, State.SLEEPING)
        self.last_phases = {}
        await self.climb.further(level)
        self.sleep_level = level
        self.observer.state_changed(self, State.SLEEPING, State.SLEEPING)
        await self.host.after_sleep(self.client, self.process, level)

    # -- wake ----------------------------------------------------------------------------

    async def wake(self) -> None:
        """The staged wake (engines.waking.steps), then the promotion gate. AWAKE on success; FAILED (raised) otherwise."""
        if self.state is not State.SLEEPING:
            raise self._refuse_transition(self.state, State.WAKING)
        self.last_phases = {}
        self.progress.waking()
        self._enter(State.WAKING)
        level = 2 if self.sleep_level is None else self.sleep_level
        await self.climb.up(level, drill=self.climb.take_drill())  # a drill is one wake's, whatever becomes of it
        await self.host.after_wake(self.client, self.process, level)
        self._enter(State.VERIFYING)
        verdict = await self._judged_canary(level)
        if verdict.passed:
            self.gate.promoted()
            self._enter(State.AWAKE)
        elif self.spec.gate.on_fail == "restart":
            log.warning("engine %s: gate refused promotion (%s); cold restart, then verify against the cold-boot baseline",
                        self.name, verdict.reason)
            wake_phases, started = dict(self.last_phases), time.monotonic()
            await self.restart("gate")
            self.last_phases = {**wake_phases, "restart": time.monotonic() - started}
        else:
            raise self.fail(f"gate refused promotion: {verdict.reason}")

    def arm_drill(self) -> None:
        """POST /admin/drill: the next wake leaves out the draft reload, once (engines.waking.climb; ValueError if it cannot)."""
        self.climb.arm_drill()

    async def demote(self) -> None:
        """Level 1 -> Level 2 without serving, to give host RAM back: vLLM can only drop the host copy
        of the weights by waking them into the GPU and sleeping at Level 2."""
        if self.state is not State.SLEEPING or self.sleep_level != 1:
            raise self._refuse_transition(self.state, State.WAKING)
        self.last_phases = {}
        self._enter(State.WAKING)
        await self.climb.up(1)
        await self.host.after_wake(self.client, self.process, 1)  # the host copy is what a demotion is for
        self._enter(State.DRAINING)
        await self.climb.down(2, "wait")
        self.sleep_level = 2
        self._enter(State.SLEEPING)
        await self.host.after_sleep(self.client, self.process, 2)

    # -- the promotion gate ------------------------------------------------------------------

    async def _judged_canary(self, woke_from: Optional[int] = None) -> Verdict:
        """The gate step (engines.gate.record): the first canary on a cold engine is its baseline, every later one
        is judged against it. `woke_from`: the level of the wake before it (None: a boot)."""
        each = self.swap.timeouts.gate
        verdict = self.gate.judged(await self.climb.step(
            "gate", lambda _: self.gate.run(self.client, self.served_name, self.served_names, self.has_draft, each, woke_from),
            timeout=each * self.gate.canaries))
        if verdict.result == "allowed":
            log.error("engine %s: PROMOTED DESPITE A REFUSED GATE (gate.on_fail: allow): %s", self.name, verdict.reason)
        self.progress.gates.append(verdict.result)
        self.observer.verdict(self, verdict)
        return verdict

    # -- stop and restart -------------------------------------------------------------------

    async def stop(self) -> None:
        self._stopping = True
        self.stager.forget()
        if self.state is not State.COLD:
            self._enter(State.COLD)  # first: no lease may be handed out to a process that is going away
        if self.process is not None:
            await self.process.stop()
        self.host.reset(self.spec)  # the process and what it held are gone
        if self._watch is not None:
            await asyncio.gather(self._watch, return_exceptions=True)

    async def stop_after_failure(self) -> None:
        """Kill a FAILED engine's process (a broken engine must not hold GPU memory); stay FAILED."""
        self._stopping = True
        if self.process is not None:
            await self.process.stop()

    def adopt(self, spec: ModelSpec) -> None:
        """A roster entry that differs from the running one only in what the router reads (aliases,
        placement, gate thresholds): in force at once, no restart."""
        self.spec = spec
        self.gate.adopt(spec.gate)

    def respec(self, spec: ModelSpec) -> None:
        """Take a new roster entry while COLD: the next boot starts from it and, since it may be
        another model or other flags, records a new baseline."""
        if self.state is not State.COLD:
            raise self._refuse_transition(self.state, State.COLD)
        self.spec = spec
        self.port = spec.port
        self.client = attached_client(spec, self.session)
        self.served_name, self.served_names = spec.name, frozenset([spec.name])
        self.gate.forget(spec.gate)
        self.progress.next_boot = ROSTER

    async def restart(self, reason: str) -> None:
        """Cold restart, after a drain when awake; the boot's canary is judged against the original baseline."""
        self.restarts[reason] += 1
        self.observer.restarted(self, reason)
        if self.state is State.AWAKE:
            await self.drain(RESTART)  # in-flight requests finish (bounded) before their process goes
        await self.stop()
        await self.boot(reason)
