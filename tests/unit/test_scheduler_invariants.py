"""The scheduler's promises (shared/DESIGN.md, "The scheduler's promises"), checked on every decision
of many random runs of the real `Scheduler` in a simulated world (tests/unit/scheduler_world.py:
virtual time, simulated engines and clients).

A run draws a roster (1-3 GPUs, 2-8 models, groups, pins, virtual models, levels, host budgets),
then Hypothesis' stateful testing drives it: requests (interactive and batch, bursts, streams of
random lengths, clients that leave while queued), time passing, faults (a boot, wake, gate or
sleep step failing or timing out, an engine dying, a mid-life collapse), an operator's sleep, and
hot reloads (a model added, removed or changed mid-swap). After every `decide`, every action
started and every step, the checker below judges what the scheduler did against an oracle of
its own, computed from the simulated engines and clients, not from the scheduler's books. A
failure prints the shortest run Hypothesis could shrink it to, and the last decisions.

CI runs a fixed budget (`HOTSWAP_SIM_EXAMPLES`, default below); a long run is
`HOTSWAP_SIM_EXAMPLES=3000 .venv/bin/python -m pytest tests/unit/test_scheduler_invariants.py`
(docs/contributors.md: how to run it long and replay a failure). Each promise is shown to catch a
bug planted for it at the end of this file.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from config.placement_check import check_placement
from config.schema import ModelSpec, Queue, Swap
from config.sections import BATCH, INTERACTIVE
from config.virtual import VirtualModel
from engines import leases as leases_module
from engines.engine import State
from engines.memory import PRIOR_FACTOR
from router import virtuals
from router.errors import APIError
from router.scheduling import Capacity, Scheduler
from router.scheduling import actions as actions_module
from router.scheduling.history import Events
from router.scheduling.placement import HOLDS_SHARE
from router.scheduling.state import Decision
from tests.unit.scheduler_world import Client, HostModel, SimEngine, Timing, World

EXAMPLES = int(os.environ.get("HOTSWAP_SIM_EXAMPLES", "300"))
STEPS = int(os.environ.get("HOTSWAP_SIM_STEPS", "50"))
GPU_GB = 80.0
EPS = 1e-6
TAKES_ROOM = frozenset({"park", "deepen", "stop", "demote"})  # actions that move an engine out of the way


class Broken(AssertionError):
    """A promise broken: `promise` is its number in DESIGN.md."""

    def __init__(self, promise: int, what: str, log: list[str]):
        super().__init__(f"promise {promise} broken: {what}\nlast decisions:\n  " + "\n  ".join(log[-15:]))
        self.promise = promise


# -- the draw --------------------------------------------------------------------------------------------

@st.composite
def entries(draw: Any, name: str, gpus: int) -> tuple[dict[str, Any], Timing, HostModel]:
    """One model as a roster writes it (so a failing run prints as one), how long its steps take, and its host RAM."""
    share = draw(st.sampled_from([0.2, 0.3, 0.4, 0.5, 0.6, 0.9]))
    first = draw(st.integers(0, gpus - 1))
    devices = [first] if gpus == 1 or draw(st.integers(0, 3)) else sorted({first, (first + 1) % gpus})
    entry = {"name": name, "model": f"/m/{name}", "args": ["--gpu-memory-utilization", str(share)], "devices": devices,
             "group": draw(st.sampled_from([None, None, "g1", "g2"])), "pin": draw(st.integers(0, 11)) == 0,
             "sleep_level": draw(st.sampled_from(["auto", "auto", 1, 2, 0])),
             "weights_gb": draw(st.sampled_from([None, 2.0, 8.0, 12.0]))}
    timing = Timing(boot_s=draw(st.sampled_from([5.0, 30.0, 90.0])),
                    wake_s=(0.3, draw(st.sampled_from([0.5, 2.0])), draw(st.sampled_from([3.0, 10.0, 40.0]))),
                    sleep_s=draw(st.sampled_from([0.2, 1.0, 4.0])))
    # The prior (PRIOR_FACTOR × the checkpoint) is what the scheduler sizes a first Level-1 sleep by; a
    # copy measured above it is corrected after the fact (over_budget), so here it is an upper bound.
    host = HostModel(level1_factor=draw(st.sampled_from([1.0, 1.2, PRIOR_FACTOR])),
                     measured=draw(st.integers(0, 3)) > 0)
    return {k: v for k, v in entry.items() if v not in (None, False)}, timing, host


def placeable(roster: dict[str, Any]) -> bool:
    """What `hotswap check` accepts (and so a reload): no placement that no scheduling can satisfy (pins that
    overcommit a GPU, ...)."""
    return fits_check([m[0] for m in roster["models"]], roster["gpus"])


def fits_check(models: list[dict[str, Any]], gpus: int) -> bool:
    problems: list[str] = []
    check_placement(lambda where, message: problems.append(message), models, {}, list(range(gpus)))
    return not problems


def entry_of(spec: ModelSpec) -> dict[str, Any]:
    return spec.model_dump(include={"name", "args", "devices", "pin", "group"})


@st.composite
def rosters(draw: Any) -> dict[str, Any]:
    gpus = draw(st.integers(1, 3))
    n = draw(st.integers(2, 8))
    models = [draw(entries(f"m{i}", gpus)) for i in range(n)]
    virtual = None
    if n >= 3 and draw(st.booleans()):
        virtual = {"name": "any", "models": ["m0", "m1"], "pick": draw(st.sampled_from(["awake", "first", "balance"]))}
    swap = {"min_active_s": draw(st.sampled_from([0.0, 5.0, 30.0])), "max_hold_s": draw(st.sampled_from([5.0, 30.0, 120.0])),
            "drain_timeout_s": draw(st.sampled_from([0.0, 10.0, 30.0])),
            "idle_sleep_s": draw(st.sampled_from([None, 20.0, 120.0])),
            "interactive_hold_s": draw(st.sampled_from([0.0, 10.0, 60.0])),
            "reuse_horizon_s": draw(st.sampled_from([10.0, 60.0])), "wake_ahead": draw(st.booleans()),
            "demand_tau_s": draw(st.sampled_from([60.0, 300.0]))}
    queue = {"max_wait_s": draw(st.sampled_from([30.0, 300.0])), "batch_max_wait_s": draw(st.sampled_from([60.0, 600.0])),
             "max_waiting": draw(st.sampled_from([2, 8, 256]))}
    return {"gpus": gpus, "models": models, "virtual": virtual, "swap": swap, "queue": queue,
            "ram_gb": draw(st.sampled_from([0.0, 5.0, 20.0, 100.0]))}


# -- the scheduler under test, and what it reports --------------------------------------------------

class Recorder(Events):
    def __init__(self, checker: "Checker"):
        self.checker = checker

    def woke_ahead(self, engine: Any, outcome: str) -> None:
        if outcome == "woken":
            self.checker.woken_ahead(engine)


class Checked(Scheduler):
    """The real scheduler, with the checker looking at each plan and each action as it starts."""

    checker: "Checker"

    def decide(self, now: float) -> Any:
        plan = super().decide(now)
        self.checker.after_decide(plan)
        return plan

    def _start(self, decision: Any) -> None:
        self.checker.starting(decision)
        super()._start(decision)


class InternalErrors(logging.Handler):
    """An error the router logs with a traceback is a defect here: the simulated engines only ever fail as engines do."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


# -- the oracle -----------------------------------------------------------------------------------------

class Checker:
    """Each promise, judged from the simulated world (engines, clients), never from the scheduler's books."""

    def __init__(self, world: World, s: Scheduler, ram_gb: float):
        self.world, self.s, self.ram_gb = world, s, ram_gb
        self.log: list[str] = []
        self.broken: list[Broken] = []
        self.ahead_since_asked: collections.Counter[str] = collections.Counter()  # promise 6
        self.slept_by_operator: set[str] = set()  # promise 7
        self.interactive_seen: dict[str, float] = {}  # promise 4: an interactive request arrived or ended
        self.user_arrivals: collections.defaultdict[str, list[float]] = collections.defaultdict(list)  # promise 4

    only: Optional[int] = None  # judge this promise alone (a planted bug's test)

    def breaks(self, promise: int, what: str) -> None:
        if self.only in (None, promise):
            self.broken.append(Broken(promise, what, self.log))

    # -- hooks ----------------------------------------------------------------------------------------

    def asked(self, engine: SimEngine, klass: str) -> None:
        self.ahead_since_asked.pop(engine.name, None)
        self.slept_by_operator.discard(engine.name)
        if klass == INTERACTIVE:
            self.interactive_seen[engine.name] = self.world.loop.now
            self.user_arrivals[engine.name].append(self.world.loop.now)

    def ended(self, client: Client) -> None:
        if client.klass == INTERACTIVE and client.outcome in ("granted", "cut"):
            self.interactive_seen[client.engine.name] = self.world.loop.now

    def woken_ahead(self, engine: Any) -> None:
        self.ahead_since_asked[engine.name] += 1
        if self.ahead_since_asked[engine.name] > 1:
            self.breaks(6, f"{engine.name} woken ahead {self.ahead_since_asked[engine.name]} times with no request for "
                           "it in between (a wake/park cycle without demand)")

    def starting(self, decision: Any) -> None:
        engine, action = decision.engine, decision.action
        self.check_preemption(decision)
        if action in TAKES_ROOM and (demand := self.interactive_demand(engine)):
            users = [c for c in self.world.waiting() if c.klass == INTERACTIVE and c.engine is not engine]
            if not users and not decision.why.startswith(("idle", "host RAM over")):
                self.breaks(4, f"{action} {engine.name} ({decision.why}) while it has interactive demand ({demand}) "
                               "and no interactive request waits for anything")
        self.check_batch_room(decision)
        if action in ("wake", "boot") and engine.name in self.slept_by_operator:
            if not self.s.waiting[engine.name]:
                self.breaks(7, f"{action} {engine.name}, which an operator put to sleep, with no request for it ({decision.why})")
            self.slept_by_operator.discard(engine.name)  # a request waiting through the sleep woke it: the sleep is over

    def check_preemption(self, decision: Any) -> None:
        """Promise 8 (the new one beside DESIGN.md's seven): an interactive waiter never waits behind an engine whose
        in-flight work is batch only (its park for that waiter preempts, it does not drain); an interactive stream
        is never preempted. And promise 4's part of it: only a user's waiter preempts."""
        engine, action = decision.engine, decision.action
        served = [c for c in self.world.clients if c.engine is engine and c.served]
        if decision.preempt:
            if any(c.klass != BATCH for c in served):
                self.breaks(8, f"{action} {engine.name} preempts an interactive stream ({decision.why})")
            users = [c for c in self.world.waiting() if c.klass == INTERACTIVE and c.engine is not engine
                     and (set(c.engine.spec.devices) & set(engine.spec.devices)
                          or (c.engine.spec.group and c.engine.spec.group == engine.spec.group))]
            if not users:
                self.breaks(4, f"{action} {engine.name} preempts its batch streams with no user waiting ({decision.why})")
        elif action in ("park", "stop") and engine.state is State.AWAKE and served and all(c.klass == BATCH for c in served) \
                and decision.why.startswith("room for "):
            target = decision.why[len("room for "):].split(";")[0].split(" ")[0]
            if any(c.klass == INTERACTIVE and c.engine.name == target for c in self.world.waiting()):
                self.breaks(8, f"{action} {engine.name} drains batch-only work while a user waits for {target} "
                               f"({decision.why})")

    def check_batch_room(self, decision: Any) -> None:
        """Promise 4's forecast: room made for a model only batch requests wait for is never taken from an engine
        its users are more likely than not to ask for before that model's wake would end (the wake as the scheduler
        predicts it; the users' rate counted here from their arrivals, each weighing exp(-age / demand_tau_s))."""
        engine, why = decision.engine, decision.why
        if decision.action not in TAKES_ROOM or not why.startswith("room for "):
            return
        target = self.world.engines.get(why[len("room for "):].split(";")[0].split(" ")[0])
        queue = [c for c in self.world.waiting() if c.engine is target]
        if target is None or not queue or any(c.klass == INTERACTIVE for c in queue):
            return
        now, tau = self.world.loop.now, self.s.swap.demand_tau_s
        rate = sum(math.exp(-(now - t) / tau) for t in self.user_arrivals[engine.name]) / tau
        within = self.s._target_wake_s(target)
        if 1 - math.exp(-rate * within) > 0.5 + EPS:
            self.breaks(4, f"{decision.action} {engine.name} for batch work's {target.name}, though a user is "
                           f"{1 - math.exp(-rate * within):.0%} likely to ask for it within {target.name}'s {within:.1f} s wake")

    def after_decide(self, plan: Any) -> None:
        for d in plan.decisions:
            self.log.append(f"t={self.world.loop.now:.2f} {d.action} {d.engine.name} ({d.engine.state.value}): {d.why}")
        # A boot started so that it fails saying why ("it can never fit") never reaches the GPU.
        coming = {d.engine.name for d in plan.decisions if d.action in ("wake", "boot", "restart", "demote")
                  and d.why != "it can never fit"}
        self.check(coming, {d.engine.name for d in plan.decisions})

    # -- the promises ------------------------------------------------------------------------------------

    def check(self, coming: set[str] = frozenset(), starting: set[str] = frozenset()) -> None:
        """`coming`, `starting`: engines the plan just decided to bring onto the GPU, and to move at all (their
        actions start once `decide` returns)."""
        engines = list(self.world.engines.values())
        on_gpu = [e for e in engines if e.state in HOLDS_SHARE or e.name in coming]
        for group in {e.spec.group for e in on_gpu if e.spec.group}:
            members = [f"{e.name} ({e.state.value})" for e in on_gpu if e.spec.group == group]
            if len(members) > 1:
                self.breaks(1, f"group {group} has {', '.join(members)} awake or waking at once")
        for device in self.world.gpus:
            held = {e.name: self.gpu_held(e, device, e.name in coming) for e in engines if device in e.spec.devices}
            if sum(held.values()) > 1.0 + EPS:
                self.breaks(2, f"GPU {device} holds {sum(held.values()):.3f} of itself: "
                               + ", ".join(f"{n} {f:.3f}" for n, f in held.items() if f))
        self.check_host_ram()
        task = self.s._task
        if task is not None and task.done() and not task.cancelled():
            self.breaks(5, f"the scheduler loop stopped: {task.exception()!r}")
        for e in engines:
            if e.in_flight and e.state not in (State.AWAKE, State.DRAINING, State.FAILED):
                self.breaks(5, f"{e.name} is {e.state.value} with {e.in_flight} lease(s) out")
        background = self.s.startup | self.s.to_boot  # boots nobody waits for, by design
        for target, (victims, _) in self.s.making_room.items():
            if target not in self.world.engines or (not self.s.waiting.get(target) and target not in background
                                                    and not any(v in self.s.busy or v in starting for v in victims)):
                self.breaks(5, f"making room for {target} (parking {victims}) outlived its waiters")

    def gpu_held(self, e: SimEngine, device: int, coming: bool) -> float:
        """What `e` holds on `device`, as a fraction of it, from what it is doing (vLLM's real footprint)."""
        share = e.spec.gpu_share
        state, level = e.failed_from if e.state is State.FAILED and e.alive else (e.state, e.sleep_level)
        if coming or state in HOLDS_SHARE:
            return share
        residual = e.spec.sleep_residual_gb / GPU_GB
        if state is State.SLEEPING and level == 0:
            w = e.spec.weights_gb
            return share if w is None else min(w / len(e.spec.devices) / GPU_GB + residual, share)
        return residual if state is State.SLEEPING else 0.0

    def check_host_ram(self) -> None:
        """Promise 3, at every moment: what is held is measured where measured, else the prior while a
        Level-1 copy may be held. Nothing is left out: a copy counts until the demotion, stop or wake that
        gives it back has ended, and a fixed `sleep_level: 1` keeps to the budget too."""
        held = {}
        for e in self.world.engines.values():
            if e.host_model.measured:
                gb = e.pinned_gb
            else:
                gb = (e.weights_gb or 0.0) * PRIOR_FACTOR if e.host.level1_copy and e.alive else 0.0
            if gb:
                held[e.name] = gb
        if sum(held.values()) > self.ram_gb + EPS:
            self.breaks(3, f"the engines hold {sum(held.values()):.2f} GB of host RAM for sleep against "
                           f"host.ram_budget_gb={self.ram_gb:g}: " + ", ".join(f"{n} {g:.2f}" for n, g in held.items()))

    def interactive_demand(self, engine: SimEngine) -> Optional[str]:
        mine = [c for c in self.world.clients if c.engine is engine and c.klass == INTERACTIVE]
        if any(c.served for c in mine):
            return "an interactive request in flight"
        if any(c.outcome is None and not c.served for c in mine):
            return "an interactive request queued"
        seen = self.interactive_seen.get(engine.name)
        if seen is not None and self.world.loop.now - seen < self.s.swap.interactive_hold_s:
            return f"an interactive request {self.world.loop.now - seen:.1f} s ago"
        return None


# -- the run ---------------------------------------------------------------------------------------------

class SchedulerRun(RuleBasedStateMachine):
    """One simulated run: a roster, then a random sequence of what happens to a router."""

    def __init__(self) -> None:
        super().__init__()
        self.world: Optional[World] = None

    @initialize(roster=rosters().filter(placeable))
    def boot(self, roster: dict[str, Any]) -> None:
        self.roster = roster
        swap, self.queue = Swap(**roster["swap"]), Queue(**roster["queue"])
        self.virtual = VirtualModel(**roster["virtual"]) if roster["virtual"] else None
        world = self.world = World(swap)
        world.gpus = {i: GPU_GB for i in range(roster["gpus"])}
        # The clocks the actions and the leases read: virtual, so a run replays exactly.
        self.saved_time = actions_module.time
        actions_module.time = leases_module.time = SimpleNamespace(monotonic=world.loop.time)
        self.errors = InternalErrors()
        self.logger = logging.getLogger("hotswap")
        self.logger.addHandler(self.errors)
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)  # the decisions are in the checker's log; the router's lines only slow runs
        for entry, timing, host in roster["models"]:
            spec = ModelSpec(**entry)
            world.engines[spec.name] = SimEngine(world, spec, timing, host, spec.weights_gb)
        self.s = Checked(list(world.engines.values()), swap, self.queue, Capacity(world.gpus, roster["ram_gb"]),
                         weights={e.name: e.spec.weights_gb for e in world.engines.values()}, clock=world.loop.time)
        self.checker = self.s.checker = Checker(world, self.s, roster["ram_gb"])
        self.s.events = Recorder(self.checker)
        self.added = 0
        world.loop.run_virtually(self._start())
        world.loop.advance(0)

    async def _start(self) -> None:
        self.s.start()

    # -- what happens -------------------------------------------------------------------------------------

    def serving(self) -> list[SimEngine]:
        return [e for e in self.world.engines.values() if not e.retiring]

    @rule(which=st.integers(0, 7), klass=st.sampled_from([INTERACTIVE, INTERACTIVE, BATCH]), n=st.sampled_from([1, 1, 3]),
          hold_s=st.sampled_from([0.5, 5.0, 40.0, 300.0]), by_virtual=st.booleans())
    def request(self, which: int, klass: str, n: int, hold_s: float, by_virtual: bool) -> None:
        engines = self.serving()
        virtual = self.virtual
        for _ in range(n):
            members = [e for e in engines if virtual is not None and e.name in virtual.models]
            if by_virtual and members:
                engine = virtuals.pick(virtual, members, self.s)
            else:
                engine = engines[which % len(engines)]
            self.checker.asked(engine, klass)
            client = Client(len(self.world.clients), engine, klass, hold_s, self.world.loop.now)
            self.world.clients.append(client)
            client.task = self.world.loop.create_task(self._client(client))
        self.world.loop.settle()

    async def _client(self, c: Client) -> None:
        c.waits_since = self.world.loop.now
        try:
            await self.s.acquire(c.engine, klass=c.klass)
        except APIError as exc:
            c.outcome = f"refused: {exc.status} {exc.message}"
            if not exc.message:
                self.checker.breaks(5, f"client {c.id} for {c.engine.name} refused without a reason")
            return
        except asyncio.CancelledError:
            c.outcome = "left"
            raise
        c.served = True
        started = self.world.loop.now
        try:
            ran = await c.engine.serve(c.hold_s)
        finally:
            c.served = False
            self.s.release(c.engine, c.klass)
        if not ran and c.engine.cut_reason == "preempted":  # as the proxy does: it waits again, for the rest
            c.hold_s = max(c.hold_s - (self.world.loop.now - started), 0.01)
            c.resumed += 1
            return await self._client(c)
        c.outcome = "granted" if ran else "cut"
        self.checker.ended(c)

    @rule(seconds=st.sampled_from([0.05, 0.5, 2.0, 10.0, 45.0, 200.0]))
    def time_passes(self, seconds: float) -> None:
        self.world.loop.advance(seconds)

    @rule(which=st.integers(0, 50))
    def a_client_leaves(self, which: int) -> None:
        waiting = self.world.waiting()
        if waiting:
            waiting[which % len(waiting)].task.cancel()
            self.world.loop.settle()

    @rule(which=st.integers(0, 7), fault=st.sampled_from(["boot", "wake", "gate", "sleep", "slow", "die", "collapse"]))
    def a_fault(self, which: int, fault: str) -> None:
        engines = list(self.world.engines.values())
        engine = engines[which % len(engines)]
        if fault == "die":
            if engine.alive and engine.state is not State.FAILED:
                engine.fail("its process died")
                self.s.poke()
        elif fault == "collapse":
            if engine.state is State.AWAKE:
                engine.gate.needs_restart = "acceptance collapsed while serving"
                self.s.poke()
        else:
            engine.faults.append(fault)
        self.world.loop.settle()

    @rule(which=st.integers(0, 7))
    def an_operator_puts_a_model_to_sleep(self, which: int) -> None:
        engines = self.serving()
        engine = engines[which % len(engines)]
        if engine.state in (State.AWAKE, State.SLEEPING):
            self.checker.slept_by_operator.add(engine.name)
        self.checker.log.append(f"t={self.world.loop.now:.2f} an operator puts {engine.name} ({engine.state.value}) to sleep")
        self.world.loop.create_task(self._admin_sleep(engine))
        self.world.loop.settle()

    async def _admin_sleep(self, engine: SimEngine) -> None:
        try:
            await self.s.sleep(engine)
        except APIError:
            pass

    @rule(which=st.integers(0, 7))
    def a_reload_removes_a_model(self, which: int) -> None:
        engines = self.serving()
        if len(engines) > 1:
            self.s.retire(engines[which % len(engines)])
            self.world.loop.settle()

    @rule(data=st.data())
    def a_reload_adds_a_model(self, data: Any) -> None:
        if len(self.world.engines) >= 9:
            return
        self.added += 1
        self.add_model(*data.draw(entries(f"new{self.added}", len(self.world.gpus))))

    def add_model(self, entry: dict[str, Any], timing: Timing, host: HostModel) -> None:
        spec = ModelSpec(**entry)
        if not fits_check([*(entry_of(e.spec) for e in self.serving()), entry], len(self.world.gpus)):
            return  # `hotswap check` refuses it, and so does a reload
        engine = self.world.engines[spec.name] = SimEngine(self.world, spec, timing, host, spec.weights_gb)
        self.s.weights[spec.name] = spec.weights_gb
        self.s.add(engine)
        self.world.loop.settle()

    @rule(which=st.integers(0, 7), share=st.sampled_from([0.2, 0.5, 0.9]))
    def a_reload_changes_a_model(self, which: int, share: float) -> None:
        engines = self.serving()
        engine = engines[which % len(engines)]
        spec = engine.spec.model_copy(update={"args": ["--gpu-memory-utilization", str(share)]})
        if not fits_check([entry_of(spec if e is engine else e.spec) for e in self.serving()], len(self.world.gpus)):
            return
        self.s.respec(engine, spec)
        self.world.loop.settle()

    # -- judged after every step -----------------------------------------------------------------------

    @invariant()
    def promises_hold(self) -> None:
        if self.world is None:
            return
        self.checker.check()
        for record in self.errors.records:
            self.checker.breaks(5, f"internal error logged: {record.getMessage()} "
                                   f"({record.exc_info[1]!r} at {record.pathname}:{record.lineno})")
        self.errors.records.clear()
        if self.checker.broken:
            raise self.checker.broken[0]

    def teardown(self) -> None:
        if self.world is None:
            return
        try:
            self.every_client_hears()
        finally:
            loop = self.world.loop
            loop.run_virtually(self.s.stop())
            # Every task ends here, not when the garbage collector finds it during a later run.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_virtually(_ended(pending))
            loop.close()
            actions_module.time = leases_module.time = self.saved_time
            self.logger.removeHandler(self.errors)
            self.logger.setLevel(self.level)

    def every_client_hears(self) -> None:
        """Promise 5's end: once every deadline has passed, each client was served, refused with a reason,
        cut by a drain, or left. None is still waiting."""
        queue = self.queue
        longest = max(queue.max_wait_s, queue.batch_max_wait_s) + 1.0
        for _ in range(8):  # a client preempted meanwhile waits again, with a deadline of its own from then
            self.world.loop.advance(longest)
            self.promises_hold()
            for client in self.world.clients:
                if client.outcome is None and not client.served and self.world.loop.now - client.waits_since > longest:
                    self.checker.breaks(5, f"client {client.id} ({client.klass}) for {client.engine.name}, asked at "
                                       f"t={client.asked:.1f}, waiting since t={client.waits_since:.1f}, still waits "
                                       f"at t={self.world.loop.now:.1f}")
            if all(c.outcome is not None for c in self.world.clients):
                break
        self.promises_hold()


async def _ended(tasks: set[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def run(**overrides: Any) -> None:
    """CI's budget replays the same runs every time (derandomized); a long run (HOTSWAP_SIM_EXAMPLES set) draws
    new ones each time. Either way a failure prints its shrunk steps as code to paste into a test."""
    chosen = {"max_examples": EXAMPLES, "stateful_step_count": STEPS, "deadline": None, "database": None,
              "derandomize": "HOTSWAP_SIM_EXAMPLES" not in os.environ, "suppress_health_check": list(HealthCheck),
              **overrides}
    run_state_machine_as_test(SchedulerRun, settings=settings(**chosen))


@pytest.mark.timeout(600)  # a failure's shrinking replays hundreds of runs; a passing budget takes seconds
def test_every_promise_holds_on_every_decision_of_random_runs() -> None:
    run()


# -- each promise catches a bug planted for it ---------------------------------------------------------------
# Each plant is a policy as a hurried change could write it; the run must report that promise broken.

def wakes_ahead_whatever_fits(self: Scheduler, ledger: Any, now: float, moving: set[str], clear: Any) -> list[Decision]:
    """A pre-wake that asks only whether the memory fits (as issue 54 found): no group, no history, no price."""
    for e in self.engines:
        if e.state is State.SLEEPING and e.name not in self.busy and e.name not in moving and ledger.fits(e) and clear(e):
            self.events.woke_ahead(e, "woken")
            return [Decision("wake", e, "planted: its memory fits")]
    return []


def forgets_operators(original: Any) -> Any:
    def ahead(self: Scheduler, *args: Any) -> list[Decision]:
        self.put_to_sleep.clear()
        return wakes_ahead_whatever_fits(self, *args) or original(self, *args)
    return ahead


def loses_a_removed_engine(original: Any) -> Any:
    def targets(self: Scheduler, *args: Any) -> Any:
        if any(e.retiring for e in self.engines):
            raise StopIteration  # a bare next() over the engines, as the wake-ahead pass had
        return original(self, *args)
    return targets


PLANTS = {
    1: ("ahead_decisions", lambda original: wakes_ahead_whatever_fits),
    2: ("ledger", lambda original: lambda self: _fits_everything(original(self))),
    3: ("_choose_level", lambda original: lambda self, engine, *a, **k: (1, []) if engine.spec.sleep_level == "auto"
        else original(self, engine, *a, **k)),
    4: ("interactive_demand", lambda original: lambda self, engine, now, within_s=0.0: (None, 0.0)),
    8: ("preemptible", lambda original: lambda self, engine: engine.in_flight > 0),  # counts an interactive stream as batch
    5: ("_targets", loses_a_removed_engine),
    6: ("ahead_decisions", lambda original: wakes_ahead_whatever_fits),
    7: ("ahead_decisions", forgets_operators),
}


def _fits_everything(ledger: Any) -> Any:
    ledger.shortfall = lambda engine, victims=(): {}
    return ledger


def promises_in(error: BaseException) -> set[int]:
    if isinstance(error, BaseExceptionGroup):
        return {p for e in error.exceptions for p in promises_in(e)}
    return {error.promise} if isinstance(error, Broken) else set()


@pytest.mark.parametrize("promise", sorted(PLANTS))
def test_each_promise_catches_a_bug_planted_for_it(promise: int, monkeypatch) -> None:
    name, plant = PLANTS[promise]
    monkeypatch.setattr(Checked, name, plant(getattr(Checked, name)))
    monkeypatch.setattr(Checker, "only", promise)
    with pytest.raises(BaseException) as caught:
        run(max_examples=300, phases=[Phase.generate])
    assert promise in promises_in(caught.value), f"the plant for promise {promise} was reported as: {caught.value}"


# -- runs the simulation found, kept as scenarios (each failed before its fix) ---------------------------------

def two_models(**swap: Any) -> dict[str, Any]:
    def model(name: str) -> tuple[dict[str, Any], Timing, HostModel]:
        return {"name": name, "model": f"/m/{name}", "args": ["--gpu-memory-utilization", "0.4"], "devices": [0],
                "weights_gb": 2.0}, Timing(), HostModel()
    return {"gpus": 1, "models": [model("m0"), model("m1")], "virtual": None, "swap": swap, "queue": {}, "ram_gb": 100.0}


def test_a_model_an_operator_put_to_sleep_stays_asleep_through_a_change_of_its_roster_entry_regression() -> None:
    state = SchedulerRun()
    state.boot(roster=two_models())
    state.time_passes(seconds=200.0)
    state.an_operator_puts_a_model_to_sleep(which=0)
    state.time_passes(seconds=10.0)
    state.promises_hold()
    state.a_reload_changes_a_model(which=0, share=0.5)
    state.time_passes(seconds=200.0)
    state.promises_hold()
    assert state.world.engines["m0"].state is State.COLD, "restarted from its new entry, it waits for a request to boot"
    state.request(which=0, klass=INTERACTIVE, n=1, hold_s=0.5, by_virtual=False)
    state.time_passes(seconds=200.0)
    state.promises_hold()
    assert state.world.clients[-1].outcome == "granted"
    state.teardown()


def test_a_model_a_reload_added_does_not_park_the_model_a_user_just_used_regression() -> None:
    state = SchedulerRun()
    state.boot(roster=two_models(interactive_hold_s=60.0, wake_ahead=False))
    state.time_passes(seconds=200.0)
    state.request(which=0, klass=INTERACTIVE, n=1, hold_s=5.0, by_virtual=False)
    state.time_passes(seconds=10.0)
    state.a_reload_changes_a_model(which=1, share=0.9)  # m1 restarts at 0.9: it fits only once m0 parks
    state.time_passes(seconds=30.0)
    state.promises_hold()
    assert state.world.engines["m0"].state is State.AWAKE, "m0 keeps its room while its user may come back"
    state.time_passes(seconds=200.0)
    state.promises_hold()
    assert state.world.engines["m1"].state is State.AWAKE, "once m0's interactive hold is over, m1 boots"
    state.teardown()


def test_two_models_an_operator_puts_to_sleep_at_once_do_not_both_take_the_host_ram_for_one_copy_regression() -> None:
    """As the simulation shrank it: two pinned models on one GPU, host RAM for one copy; an operator puts one
    to sleep while it boots and the other before it has."""
    def model(name: str) -> tuple[dict[str, Any], Timing, HostModel]:
        return ({"name": name, "model": f"/m/{name}", "args": ["--gpu-memory-utilization", "0.2"], "devices": [0],
                 "pin": True, "sleep_level": "auto", "weights_gb": 2.0},
                Timing(boot_s=5.0, wake_s=(0.3, 0.5, 3.0), sleep_s=0.2), HostModel(level1_factor=1.0, measured=False))
    state = SchedulerRun()
    state.boot(roster={"gpus": 1, "models": [model("m0"), model("m1")], "virtual": None,
                       "swap": {"min_active_s": 0.0, "max_hold_s": 5.0, "drain_timeout_s": 0.0, "interactive_hold_s": 0.0,
                                "reuse_horizon_s": 10.0, "wake_ahead": False, "demand_tau_s": 60.0},
                       "queue": {"max_wait_s": 30.0, "batch_max_wait_s": 60.0, "max_waiting": 2}, "ram_gb": 5.0})
    state.promises_hold()
    state.request(by_virtual=False, hold_s=0.5, klass="interactive", n=1, which=0)
    state.promises_hold()
    state.an_operator_puts_a_model_to_sleep(which=0)
    state.promises_hold()
    state.an_operator_puts_a_model_to_sleep(which=1)
    state.promises_hold()
    state.time_passes(seconds=200.0)
    state.promises_hold()
    state.teardown()


def test_a_request_that_waited_through_an_operators_sleep_ends_that_sleep_regression() -> None:
    """As a 3,000-run simulation found it: a batch request waits for m0, an operator puts m0 to sleep, the request
    wakes it (it asked), a user's model preempts it, a reload changes m0's entry, and m0 boots again in the background
    with nobody waiting. The oracle kept the operator's sleep past the wake its waiter made; the scheduler kept it
    only until the preempted request asked again (while it held, m0 was never woken ahead nor booted after a change)."""
    def model(name: str, share: str = "0.2", pin: bool = False) -> tuple[dict[str, Any], Timing, HostModel]:
        return ({"name": name, "model": f"/m/{name}", "args": ["--gpu-memory-utilization", share], "devices": [0],
                 "sleep_level": "auto", **({"pin": True} if pin else {})},
                Timing(boot_s=5.0, wake_s=(0.3, 0.5, 3.0), sleep_s=0.2, gate_s=0.5), HostModel(level1_factor=1.0, measured=False))
    state = SchedulerRun()
    state.boot(roster={"gpus": 1, "virtual": None, "ram_gb": 0.0,
                       "models": [model("m0"), model("m1", pin=True), model("m2", pin=True), model("m3"), model("m4"),
                                  model("m5", "0.5"), model("m6"), model("m7")],
                       "swap": {"min_active_s": 0.0, "max_hold_s": 5.0, "drain_timeout_s": 0.0, "idle_sleep_s": None,
                                "interactive_hold_s": 0.0, "reuse_horizon_s": 10.0, "wake_ahead": False, "demand_tau_s": 60.0},
                       "queue": {"max_wait_s": 30.0, "batch_max_wait_s": 60.0, "max_waiting": 2}})
    state.a_reload_removes_a_model(which=1)
    state.time_passes(seconds=45.0)
    state.added += 1
    state.add_model(*model("new1", pin=True))
    state.a_reload_removes_a_model(which=1)
    state.a_client_leaves(which=0)
    state.request(by_virtual=False, hold_s=5.0, klass=BATCH, n=1, which=0)
    state.an_operator_puts_a_model_to_sleep(which=0)
    state.time_passes(seconds=10.0)
    state.promises_hold()
    state.a_fault(fault="boot", which=0)
    state.a_reload_changes_a_model(share=0.2, which=0)
    state.request(by_virtual=False, hold_s=0.5, klass=INTERACTIVE, n=1, which=1)
    state.request(by_virtual=False, hold_s=0.5, klass=INTERACTIVE, n=1, which=3)
    state.a_client_leaves(which=0)
    state.time_passes(seconds=10.0)
    state.promises_hold()
    assert "m0" not in state.s.put_to_sleep
    state.teardown()


def test_an_operators_sleep_of_a_model_whose_request_waits_ends_when_that_request_wakes_it() -> None:
    """The scheduler's side of the run above: the waiting request asked for m0, so once it woke m0 the operator's
    sleep no longer keeps m0 from being woken ahead or booted after a change (it did until a new request came)."""
    roster = two_models()
    for entry, _, _ in roster["models"]:
        entry["args"] = ["--gpu-memory-utilization", "0.6"]  # one at a time
    state = SchedulerRun()
    state.boot(roster=roster)
    state.time_passes(seconds=200.0)
    assert state.world.engines["m0"].state is State.SLEEPING
    state.request(which=0, klass=BATCH, n=1, hold_s=0.5, by_virtual=False)
    state.an_operator_puts_a_model_to_sleep(which=0)  # m0 is still asleep: its wake waits for m1's park
    assert "m0" in state.s.put_to_sleep
    state.time_passes(seconds=30.0)
    state.promises_hold()
    assert state.world.clients[-1].outcome == "granted" and "m0" not in state.s.put_to_sleep
    state.teardown()


def test_a_model_changed_by_a_reload_before_its_first_boot_is_not_booted_again_once_stopped_regression() -> None:
    """As the simulation found it: the change left it marked to boot in the background after its first boot,
    so once stopped (here for an operator's sleep, then for room) it was booted again, asked for by nobody."""
    roster = two_models()
    roster["models"][0][0]["pin"] = True
    state = SchedulerRun()
    state.boot(roster=roster)
    state.a_reload_changes_a_model(which=1, share=0.5)  # m1 has not booted yet
    state.time_passes(seconds=200.0)
    state.promises_hold()
    assert state.world.engines["m1"].state is State.AWAKE
    state.an_operator_puts_a_model_to_sleep(which=1)
    state.time_passes(seconds=10.0)
    entry, timing, host = two_models()["models"][1]
    state.add_model({**entry, "name": "big", "args": ["--gpu-memory-utilization", "0.6"]}, timing, host)
    state.time_passes(seconds=200.0)  # m1's residual is in big's way: m1 is stopped for it
    state.promises_hold()
    assert state.world.engines["m1"].state is State.COLD, "stopped, and not booted again: nobody asked for it"
    state.teardown()


def test_a_user_preempts_batch_streams_which_wait_and_finish_later() -> None:
    """The preemption through the simulated world: the batch stream is cut at once for the user, waits as a batch
    waiter of its model, and is served the rest once the user's model is done with the GPU."""
    roster = two_models(min_active_s=0.0, max_hold_s=120.0, drain_timeout_s=30.0, interactive_hold_s=0.0,
                        wake_ahead=False)
    for model, _, _ in roster["models"]:
        model["args"] = ["--gpu-memory-utilization", "0.6"]
    state = SchedulerRun()
    state.boot(roster=roster)
    state.time_passes(seconds=200.0)
    state.request(which=0, klass=BATCH, n=1, hold_s=300.0, by_virtual=False)
    state.time_passes(seconds=10.0)
    state.request(which=1, klass=INTERACTIVE, n=1, hold_s=5.0, by_virtual=False)
    batch, user = state.world.clients
    state.time_passes(seconds=20.0)  # well under max_hold_s and drain_timeout_s
    state.promises_hold()
    assert user.outcome == "granted" and batch.resumed == 1 and state.world.engines["m0"].preempted == 1
    state.time_passes(seconds=400.0)
    state.promises_hold()
    assert batch.outcome == "granted", "resumed on m0 once m1 was idle, and ran to its end"
    state.teardown()


def users_then_batch() -> SchedulerRun:
    """A user every 2 s for a minute on m0, 20 s of quiet (past interactive_hold_s), then a batch request for m1,
    whose wake takes 20 s: m0's users are still likely within it."""
    roster = two_models(min_active_s=0.0, max_hold_s=30.0, interactive_hold_s=10.0, demand_tau_s=300.0, wake_ahead=False)
    for model, _, _ in roster["models"]:
        model["args"] = ["--gpu-memory-utilization", "0.6"]
    entry, _, host = roster["models"][1]
    roster["models"][1] = (entry, Timing(wake_s=(0.5, 20.0, 30.0)), host)
    state = SchedulerRun()
    state.boot(roster=roster)
    state.time_passes(seconds=200.0)
    state.request(which=1, klass=INTERACTIVE, n=1, hold_s=1.0, by_virtual=False)  # m1's wake, measured
    state.time_passes(seconds=60.0)
    for _ in range(30):
        state.request(which=0, klass=INTERACTIVE, n=1, hold_s=0.5, by_virtual=False)
        state.time_passes(seconds=2.0)
    state.time_passes(seconds=20.0)
    state.request(which=1, klass=BATCH, n=1, hold_s=5.0, by_virtual=False)
    state.time_passes(seconds=5.0)
    return state


def test_batch_work_waits_while_a_user_is_likely_before_its_wake_ends_then_runs() -> None:
    state = users_then_batch()
    state.promises_hold()
    assert state.world.engines["m0"].state is State.AWAKE and "likely to be asked for by a user" in state.s.held_by["m1"]
    state.time_passes(seconds=600.0)  # m0's users' rate decays below the line
    state.promises_hold()
    assert state.world.clients[-1].outcome == "granted"
    state.teardown()


def test_promise_4_catches_batch_work_that_forgets_its_own_wake(monkeypatch) -> None:
    """The forecast part of promise 4, on the scenario above: batch work that holds back only for demand seen (in
    flight, queued, within interactive_hold_s) takes the room of a model its users are about to ask for."""
    original = Checked.interactive_demand
    monkeypatch.setattr(Checked, "interactive_demand", lambda self, engine, now, within_s=0.0: original(self, engine, now))
    with pytest.raises(Broken, match="likely to ask for it within") as caught:
        users_then_batch().promises_hold()
    assert caught.value.promise == 4
