"""The scheduler's policy, driven through `decide` with fake engines and a fake clock: no
processes, no sleeps. Each test is a scenario the real loop meets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from config.schema import ModelSpec, Queue, Swap
from engines.engine import EngineFailed, State
from engines.memory.host import PRIOR_FACTOR, HostMemory
from engines.waking.stage import Stager
from router.scheduling.state import INTERACTIVE, MAX_BACKOFF_S
from router.errors import APIError
from router.scheduling import Capacity, Decision, Plan, Scheduler, Waiter
from router.scheduling.placement import Victim


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """What the scheduler reads of an engine, and the lease bookkeeping it drives."""

    def __init__(self, name: str, state: State = State.SLEEPING, *, share: float = 0.9, since: float = 0.0,
                 level: Optional[int] = 2, **spec: Any):
        self.name = name
        self.spec = ModelSpec(name=name, model=f"/m/{name}", args=["--gpu-memory-utilization", str(share)], **spec)
        self.state = state
        self.since = since
        self.last_used = since
        self.sleep_level = level if state is State.SLEEPING else None
        self.in_flight = 0
        self.tokens = 0  # what its running requests would compute again if cut (a preemption's price)
        self.leases = SimpleNamespace(tokens_in_flight=lambda: self.tokens, unresumable=0)
        self.gate = SimpleNamespace(needs_restart=None)  # what the scheduler reads of the gate record
        self.retiring = False
        self.failure: Optional[str] = None
        self.holds_process = False
        self.stopped = 0
        self.host = HostMemory(self.spec)
        self.stager = Stager(name, enabled=False)  # a test that stages enables it
        self.client = None

    def try_lease(self) -> bool:
        if self.state is not State.AWAKE:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    def fail(self, what: str) -> EngineFailed:
        self.state, self.failure = State.FAILED, f"engine {self.name}: {what}"
        return EngineFailed(self.failure)

    async def stop_after_failure(self) -> None:
        self.stopped += 1

    def adopt(self, spec: ModelSpec) -> None:
        self.spec = spec


def scheduler(*engines: FakeEngine, clock: Clock, gpus: Optional[dict[int, float]] = None, ram_gb: float = 100,
              estimates: Optional[dict[str, float]] = None, **swap) -> Scheduler:
    """`estimates`: GB each engine is expected to hold at Level 1 before it is measured (its checkpoint
    is that over PRIOR_FACTOR)."""
    settings = {"min_active_s": 5, "max_hold_s": 30, **swap}
    weights = {name: gb / PRIOR_FACTOR for name, gb in (estimates or {}).items()}
    return Scheduler(list(engines), Swap(**settings), Queue(), Capacity(gpus, ram_gb), weights=weights, clock=clock)


def wait_for(s: Scheduler, engine: FakeEngine, since: float, klass: Optional[str] = INTERACTIVE) -> Waiter:
    waiter = Waiter(engine, since, klass)
    s.waiting[engine.name].append(waiter)
    return waiter


def actions(plan: Plan) -> list[tuple[str, str]]:
    return [(d.action, d.engine.name) for d in plan.decisions]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def awake(name: str, clock: Clock, **kw: Any) -> FakeEngine:
    return FakeEngine(name, State.AWAKE, since=clock.now - 100, **kw)


async def test_a_waiter_for_an_awake_model_is_granted_at_once(clock):
    a = awake("a", clock)
    s = scheduler(a, FakeEngine("b"), clock=clock)
    waiter = wait_for(s, a, clock.now)
    assert s.decide(clock.now) == Plan()
    assert waiter.future.done() and a.in_flight == 1


async def test_two_small_models_are_awake_together_and_a_third_waits_for_room(clock):
    a, b, big = awake("a", clock, share=0.4), FakeEngine("b", share=0.4), FakeEngine("big", share=0.6)
    s = scheduler(a, b, big, clock=clock)
    wait_for(s, b, clock.now)
    assert actions(s.decide(clock.now)) == [("wake", "b")], "b fits beside a: nothing is parked"
    b.state, b.since = State.AWAKE, clock.now
    s.busy.clear(), s.doing.clear()
    a.in_flight = b.in_flight = 1  # both serving
    wait_for(s, big, clock.now)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(30)), "both are busy: the waiter waits max_hold_s"
    clock.now += 30
    plan = s.decide(clock.now)
    assert sorted(actions(plan)) == [("park", "a")] or sorted(actions(plan)) == [("park", "b")], \
        "after max_hold_s one busy engine is parked: exactly the room 0.6 needs"


async def test_a_big_model_evicts_exactly_what_it_must_and_keeps_the_popular_one(clock):
    a, b, c = (awake(n, clock, share=0.3) for n in "abc")
    big = FakeEngine("big", share=0.6)
    s = scheduler(a, b, c, big, clock=clock)
    for _ in range(20):
        s.demand.arrived("c", clock.now - 5)  # c is asked for all the time
    s.demand.arrived("a", clock.now - 200)
    s.demand.arrived("b", clock.now - 10)
    wait_for(s, big, clock.now)
    plan = s.decide(clock.now)
    assert sorted(actions(plan)) == [("park", "a"), ("park", "b")], "two of three must go: the two least likely to be needed"
    assert s.making_room["big"][0] == ["a", "b"] or sorted(s.making_room["big"][0]) == ["a", "b"]


async def test_a_busy_engine_is_not_parked_while_an_idle_choice_exists(clock):
    busy, idle = awake("busy", clock, share=0.5), awake("idle", clock, share=0.5)
    busy.in_flight = 3
    target = FakeEngine("t", share=0.5)
    s = scheduler(busy, idle, target, clock=clock)
    wait_for(s, target, clock.now - 60)  # even past max_hold_s
    assert actions(s.decide(clock.now)) == [("park", "idle")]


async def test_a_pinned_engine_is_never_parked_and_a_model_that_cannot_fit_beside_it_is_refused(clock):
    pinned = awake("pinned", clock, share=0.5, pin=True)
    big = FakeEngine("big", share=0.6)
    s = scheduler(pinned, big, clock=clock)
    waiter = wait_for(s, big, clock.now - 100)
    assert s.decide(clock.now) == Plan()
    error = waiter.future.exception()
    assert isinstance(error, APIError) and error.status == 503
    assert "cannot be placed: it needs 0.6 of GPU 0, and pinned models hold 0.5 of it (pinned 0.5)" in error.message


async def test_models_in_one_group_are_never_awake_together_even_when_memory_fits(clock):
    a, b = awake("a", clock, share=0.2, group="g"), FakeEngine("b", share=0.2, group="g")
    c = FakeEngine("c", share=0.2)
    s = scheduler(a, b, c, clock=clock)
    wait_for(s, b, clock.now - 1)
    wait_for(s, c, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "a"), ("wake", "c")], "b waits for its rival; c has no group and fits"


async def test_sleepers_residuals_count_and_a_sleeper_is_stopped_when_they_leave_no_room(clock):
    gpus = {0: 80.0}  # a residual of 8 GB is 0.1 of the device
    sleepers = [FakeEngine(f"s{i}", share=0.2, sleep_residual_gb=8) for i in range(3)]
    a = awake("a", clock, share=0.3)
    target = FakeEngine("t", share=0.4, sleep_residual_gb=8)
    s = scheduler(a, *sleepers, target, clock=clock, gpus=gpus)
    wait_for(s, target, clock.now)
    assert s.ledger().use[0] == pytest.approx(0.3 + 0.3 + 0.1), "awake 0.3, and 0.1 for each of four sleepers"
    plan = s.decide(clock.now)
    assert actions(plan) == [("wake", "t")], "awake 0.3 + the other sleepers' 0.3 + its own 0.4 fits in 1.0"
    big = FakeEngine("big", share=0.5, sleep_residual_gb=8)
    s = scheduler(a, *sleepers, big, clock=clock, gpus=gpus)
    a.in_flight = 1  # busy: parking it needs max_hold_s; stopping a sleeper is cheaper and possible now
    wait_for(s, big, clock.now)
    kinds = actions(s.decide(clock.now))
    assert len(kinds) == 1 and kinds[0][0] == "stop", kinds


async def test_a_freshly_woken_engine_stays_min_active_s_even_when_idle(clock):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 2), FakeEngine("b")
    s = scheduler(a, b, clock=clock, min_active_s=5)
    wait_for(s, b, clock.now)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(3))
    clock.now += 3
    assert actions(s.decide(clock.now)) == [("park", "a")]


async def test_the_model_whose_oldest_waiter_waited_longest_goes_first(clock):
    a, b, c = awake("a", clock), FakeEngine("b"), FakeEngine("c")
    s = scheduler(a, b, c, clock=clock)
    wait_for(s, b, since=clock.now - 1)
    wait_for(s, c, since=clock.now - 2)
    s.decide(clock.now)
    assert list(s.making_room) == ["c"]


async def test_the_sleep_level_follows_the_host_ram_budget(clock):
    a, b = awake("a", clock, share=0.5), awake("b", clock, share=0.5)
    s = scheduler(a, b, clock=clock, ram_gb=20, estimates={"a": 16, "b": 16})
    assert s._choose_level(a, clock.now) == (1, []), "16 GB fits in the 20 GB budget"
    a.state, a.sleep_level = State.SLEEPING, 1
    assert s._choose_level(b, clock.now) == (2, []), "a already holds 16 GB; b's 16 would exceed 20 and a is as valuable"
    assert s.level1_gb() == pytest.approx(16)
    s.weights["b"] = None
    assert s._choose_level(b, clock.now) == (2, []), "unknown weights: level 2"


async def test_a_model_never_parked_at_level1_is_priced_there_from_its_level2_wake_without_the_reload(clock):
    cold = FakeEngine("cold", share=0.5, level=1)
    hot = awake("hot", clock, share=0.5)
    s = scheduler(cold, hot, FakeEngine("t", share=0.6), clock=clock, ram_gb=20, estimates={"cold": 16, "hot": 16, "t": 16})
    s.costs.observe_boot("hot", 60.0)  # a boot slower than any wake, as on a GPU
    s.costs.observe_wake("hot", 2, 20.0, reload_s=19.0)
    for _ in range(10):
        s.demand.arrived("hot", clock.now - 1)
    assert s.costs.wake_s("hot", 1) == pytest.approx(1.0)
    assert s._choose_level(hot, clock.now, ledger=s.ledger())[0] == 1, \
        "priced at its boot, Level 1 would look slower than Level 2 and never be tried"


async def test_a_less_valuable_level1_sleeper_is_demoted_to_make_ram_for_a_popular_model(clock):
    cold = FakeEngine("cold", share=0.5, level=1)
    hot = awake("hot", clock, share=0.5)
    target = FakeEngine("t", share=0.6)
    s = scheduler(cold, hot, target, clock=clock, ram_gb=20, estimates={"cold": 16, "hot": 16, "t": 16})
    s.costs.observe_wake("hot", 1, 0.5)
    s.costs.observe_wake("hot", 2, 5.0)
    for _ in range(10):
        s.demand.arrived("hot", clock.now - 1)
    assert s._level_alone(hot) == 2, "a park outside the loop's planning (admin, boot) demotes nobody: Level 2"
    wait_for(s, target, clock.now)
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "hot"), ("stop", "cold")], "no GPU room for cold to pass through: it is stopped"
    assert plan.decisions[0].level == 1


async def test_idle_sleep_s_parks_an_idle_engine_even_when_nobody_waits(clock):
    a = awake("a", clock)
    a.last_used = clock.now - 10
    s = scheduler(a, clock=clock, idle_sleep_s=60)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(50))
    a.in_flight = 1
    assert s.decide(clock.now) == Plan(), "a busy engine is never parked for idleness"
    a.in_flight = 0
    clock.now += 50
    assert actions(s.decide(clock.now)) == [("park", "a")]


async def test_an_awake_engine_that_died_is_handled_as_a_failure_once_and_its_waiters_get_503(clock):
    a = awake("a", clock)
    s = scheduler(a, FakeEngine("b"), clock=clock)
    a.state, a.failure = State.FAILED, "engine a: process died unexpectedly in state awake"
    waiter = wait_for(s, a, clock.now)
    plan = s.decide(clock.now)
    assert plan.decisions == (Decision("failed", a, a.failure),)
    await s._act(plan.decisions[0])
    assert a.stopped == 1 and s.backoff.failures["a"] == 1
    with pytest.raises(APIError) as raised:
        waiter.future.result()
    assert raised.value.status == 503 and "process died unexpectedly" in raised.value.message
    assert s.decide(clock.now) == Plan(), "the same failure is not counted again"
    assert s.backoff.failures["a"] == 1


async def test_a_mid_life_collapse_restarts_at_once_even_under_load(clock):
    a = awake("a", clock)
    a.in_flight = 4
    a.gate.needs_restart = "mean acceptance length 1.00 is below 1.80"
    s = scheduler(a, clock=clock)
    waiter = wait_for(s, a, clock.now)
    assert actions(s.decide(clock.now)) == [("restart", "a")]
    assert not waiter.future.done(), "new requests queue behind the restart"


async def test_repeated_failures_back_off_and_the_first_retry_is_immediate(clock):
    b = FakeEngine("b", State.FAILED)
    s = scheduler(b, clock=clock)
    expected = [0, 1, 2, 4, 8, 16, 32, MAX_BACKOFF_S, MAX_BACKOFF_S]
    for n, delay in enumerate(expected, 1):
        s.handled.discard("b")
        s._count_failure(b, "boom")
        assert s.backoff.failures["b"] == n and s.backoff.retry_at["b"] - clock.now == delay
    with pytest.raises(APIError, match="restarting in 60 s after 9 failures") as raised:
        await s.acquire(b)
    assert raised.value.status == 503 and raised.value.retry_after == MAX_BACKOFF_S
    clock.now += MAX_BACKOFF_S
    assert not s.backoff.waiting(b, clock.now)


async def test_a_client_whose_limit_is_below_the_predicted_wait_is_answered_at_once(clock):
    a, b = awake("a", clock), FakeEngine("b")
    s = scheduler(a, b, clock=clock)
    s.costs.observe_boot("b", 12.0)
    with pytest.raises(APIError, match=r"predicted wait of 1\d\.\d s exceeds X-Hotswap-Max-Wait: 5") as raised:
        await s.acquire(b, max_wait_s=5)
    assert raised.value.status == 503 and raised.value.retry_after >= 12
    assert s.queued(b) == 0


async def test_a_defect_inside_an_action_fails_that_engine_and_the_loop_goes_on(clock, caplog):
    a, b = awake("a", clock, share=0.4), FakeEngine("b", share=0.4)
    s = scheduler(a, b, clock=clock)
    waiter = wait_for(s, b, clock.now)

    async def broken_wake(target):
        target.state = State.VERIFYING  # left mid-transition, as a real defect would
        raise ValueError("could not convert string to float: 'garbage'")

    s._wake = broken_wake
    decision = s.decide(clock.now).decisions[0]
    s._start(decision)
    await asyncio.gather(*s._actions)
    assert b.state is State.FAILED and "internal error during wake: ValueError" in b.failure
    assert isinstance(waiter.future.exception(), APIError) and waiter.future.exception().status == 503
    assert a.state is State.AWAKE, "the other engine is untouched"
    assert [r.levelname for r in caplog.records if r.exc_info] == ["ERROR"], "the traceback is logged once"
    assert not s.busy, "the engine is free for the next action"


async def test_a_defect_in_an_admin_action_answers_the_caller_at_once(clock):
    a = awake("a", clock)
    s = scheduler(a, clock=clock)

    async def broken() -> str:
        a.state = State.DRAINING
        raise KeyError("boom")

    with pytest.raises(APIError, match="admin sleep a failed on an internal error: KeyError") as raised:
        await s._exclusively(a, "sleep", broken)
    assert raised.value.status == 500
    assert a.state is State.FAILED, "nothing is left draining with nobody driving it"


async def test_an_admin_action_outlives_its_caller_and_ends_with_the_scheduler(clock):
    a = awake("a", clock)
    s = scheduler(a, clock=clock)
    parking, done = asyncio.Event(), asyncio.Event()

    async def park(engine, why, level):  # a drain waiting for a stream to end
        parking.set()
        await done.wait()
        engine.state = State.SLEEPING

    s._park = park
    caller = asyncio.create_task(s.sleep(a))
    await parking.wait()
    caller.cancel()  # the operator's client disconnected
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert s.doing["a"][0] == "sleep" and "a" in s.busy, "the sleep goes on, holding its engine"
    done.set()
    await asyncio.gather(*s._actions)
    assert a.state is State.SLEEPING and not s.busy and not s.doing

    a.state, parking, done = State.AWAKE, asyncio.Event(), asyncio.Event()
    caller = asyncio.create_task(s.sleep(a))
    await parking.wait()
    await s.stop()  # shutting down ends it like any other action
    await asyncio.gather(caller, return_exceptions=True)
    assert not s._actions and caller.cancelled()


async def test_a_measured_residual_replaces_the_configured_one(clock):
    a = FakeEngine("a", share=0.5, sleep_residual_gb=1)
    s = scheduler(a, clock=clock, gpus={0: 80.0})
    assert s.ledger().use[0] == pytest.approx(1 / 80)
    s.residuals["a"] = {0: 8.0}  # what NVML saw its processes hold after the sleep
    assert s.ledger().use[0] == pytest.approx(0.1)


async def test_an_engine_restarting_keeps_its_memory_while_it_passes_through_cold(clock):
    a, b = awake("a", clock, share=0.6), FakeEngine("b", share=0.6)
    s = scheduler(a, b, clock=clock)
    a.gate.needs_restart = "collapsed"
    plan = s.decide(clock.now)
    assert actions(plan) == [("restart", "a")]
    s.busy["a"], s.doing["a"] = asyncio.get_running_loop().create_future(), ("restart", clock.now, 0.0)
    a.state = State.COLD  # between its stop and its boot
    wait_for(s, b, clock.now)
    assert s.decide(clock.now) == Plan(), "b must not take a's memory in that moment"


async def test_a_sleeper_someone_asks_for_is_not_stopped_when_waiting_a_moment_for_a_park_costs_less(clock):
    gpus = {0: 100.0}  # residuals of 2 GB are 0.02 each
    a = FakeEngine("a", State.AWAKE, share=0.55, since=clock.now - 2, sleep_residual_gb=2)  # fresh: min_active_s
    b = FakeEngine("b", State.AWAKE, share=0.35, since=clock.now - 2, sleep_residual_gb=2)
    sleepers = [FakeEngine(f"s{i}", share=0.3, sleep_residual_gb=2) for i in range(3)]
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(a, b, *sleepers, t, clock=clock, gpus=gpus, min_active_s=5)
    for sleeper in sleepers:
        s.costs.observe_boot(sleeper.name, 20.0)
        s.costs.observe_wake(sleeper.name, 2, 1.0)
        for _ in range(5):
            s.demand.arrived(sleeper.name, clock.now - 10)  # asked for: a stop would cost a 20 s boot
    wait_for(s, t, clock.now)
    # 0.9 awake + 0.08 residuals: t is 0.01 short. Stopping a sleeper fits it now; parking b fits it in 3 s.
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(3)), "a 3 s wait for one request beats a likely 19 s cold boot"
    clock.now += 3
    kinds = actions(s.decide(clock.now))
    assert kinds in ([("park", "a")], [("park", "b")]), "then one park, and no sleeper stopped"


async def test_a_sleeper_in_a_burst_is_not_stopped_when_its_own_requests_would_wait_out_its_boot(clock):
    # Stopping the sleeper fits t now; parking b fits it in 10 s, for three queued requests: 30 s of waiting.
    # The sleeper's next request alone would wait 19 s more for a boot than for its wake: cheaper, if
    # only one came. Its burst (30 requests in the last second, 0.1/s) sends about one more every 10 s
    # while the boot runs: 39 s in all.
    gpus = {0: 100.0}  # its residual of 2 GB is 0.02
    a = FakeEngine("a", State.AWAKE, share=0.54, since=clock.now - 2, sleep_residual_gb=2)
    b = FakeEngine("b", State.AWAKE, share=0.40, since=clock.now - 2, sleep_residual_gb=2)
    sleeper = FakeEngine("s", share=0.3, sleep_residual_gb=2)
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(a, b, sleeper, t, clock=clock, gpus=gpus, min_active_s=12)
    s.costs.observe_boot("s", 20.0)
    s.costs.observe_wake("s", 2, 1.0)
    for _ in range(30):
        s.demand.arrived("s", clock.now - 1)
    for _ in range(3):
        wait_for(s, t, clock.now)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(10)), "the burst's boot would cost its requests more than the wait"
    s.demand = type(s.demand)(s.demand.tau_s)
    s.demand.arrived("s", clock.now - 1)
    plan = s.decide(clock.now)
    assert actions(plan) == [("stop", "s")], "one request's 19 s, at its 63% chance, beats 30 s of waiting"
    assert "(expected to cost 12.4 s of waiting, against 30.0 s for waiting 10.0 s to park " in plan.decisions[0].why, \
        "the log says what the stop was weighed against"


async def test_a_sleeper_asked_for_once_is_not_stopped_to_spare_one_request_ten_seconds(clock):
    # As above, with one request waiting for t: parking b fits it in 10 s. The sleeper was asked for once,
    # a second ago; its boot costs its next request 19 s more than its wake. Within reuse_horizon_s (60 s)
    # that request is 18% likely: 3.6 s, less than t's 10 s. But nothing boots a stopped engine ahead of
    # demand, so whenever that request comes it waits the boot: 63% likely while its demand is
    # remembered (demand_tau_s, 300 s): 12.4 s. The router waits for b.
    gpus = {0: 100.0}
    a = FakeEngine("a", State.AWAKE, share=0.54, since=clock.now - 2, sleep_residual_gb=2)
    b = FakeEngine("b", State.AWAKE, share=0.40, since=clock.now - 2, sleep_residual_gb=2)
    sleeper = FakeEngine("s", share=0.3, sleep_residual_gb=2)
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(a, b, sleeper, t, clock=clock, gpus=gpus, min_active_s=12)
    s.costs.observe_boot("s", 20.0)
    s.costs.observe_wake("s", 2, 1.0)
    s.demand.arrived("s", clock.now - 1)
    wait_for(s, t, clock.now)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(10)), "its boot is paid later, whenever it is asked for"


async def test_once_a_waiter_has_waited_max_hold_a_busy_engine_is_parked_rather_than_a_burst_sleeper_stopped(clock):
    # As above, but a and b are serving, and t's waiters have waited max_hold_s: parking b is possible
    # now, at the cost of its drain (measured: 2 s) for three requests, against the burst's 39 s boot.
    gpus = {0: 100.0}
    a = FakeEngine("a", State.AWAKE, share=0.54, since=clock.now - 100, sleep_residual_gb=2)
    b = FakeEngine("b", State.AWAKE, share=0.40, since=clock.now - 100, sleep_residual_gb=2)
    a.in_flight = b.in_flight = 1
    sleeper = FakeEngine("s", share=0.3, sleep_residual_gb=2)
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(a, b, sleeper, t, clock=clock, gpus=gpus, drain_timeout_s=30)
    s.costs.observe_boot("s", 20.0)
    s.costs.observe_wake("s", 2, 1.0)
    for name in ("a", "b"):
        s.costs.observe_sleep(name, 3.0, busy_drain_s=2.0)
    for _ in range(30):
        s.demand.arrived("s", clock.now - 1)
    for _ in range(3):
        wait_for(s, t, clock.now - 30)
    assert actions(s.decide(clock.now)) in ([("park", "a")], [("park", "b")]), "a 2 s drain beats a burst's cold boot"
    s.costs.drain.clear()
    plan = s.decide(clock.now)
    assert actions(plan) == [("stop", "s")], "never measured, a drain may last drain_timeout_s: 90 s for three waiters"
    assert "for waiting 30.0 s to park" in plan.decisions[0].why


async def test_a_sleeper_is_not_stopped_for_its_residual_when_a_sleeping_neighbours_burst_would_queue_behind_its_boot(clock):
    # t is 1.5 GB short: stopping s (asked for once) frees its 2 GB residual now; parking b costs t's ten
    # waiters its 2 s drain (20 s). s's next boot, 20 s with GPU 0 to itself, is what decides: s's own next
    # request waits 19 s more (at its 63% chance, 13 s with n's share); once n, asleep beside it, is in a burst
    # (0.1/s), about 2 of n's requests arrive during it and each waits half of it (25 s in all).
    gpus = {0: 100.0}
    a = FakeEngine("a", State.AWAKE, share=0.525, since=clock.now - 100, sleep_residual_gb=2)
    b = FakeEngine("b", State.AWAKE, share=0.40, since=clock.now - 100, sleep_residual_gb=2)
    a.in_flight = b.in_flight = 1
    sleeper, neighbour = FakeEngine("s", share=0.3, sleep_residual_gb=2), FakeEngine("n", share=0.3, sleep_residual_gb=2)
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(a, b, sleeper, neighbour, t, clock=clock, gpus=gpus, drain_timeout_s=30)
    for name in ("s", "n"):
        s.costs.observe_boot(name, 20.0)
        s.costs.observe_wake(name, 2, 1.0)
    for name in ("a", "b"):
        s.costs.observe_sleep(name, 3.0, busy_drain_s=2.0)
    s.demand.arrived("s", clock.now - 1)
    for _ in range(2):
        s.demand.arrived("n", clock.now - 1)
    for _ in range(10):
        wait_for(s, t, clock.now - 30)
    assert actions(s.decide(clock.now)) == [("stop", "s")], "n asked for twice, s once: s's stop is the cheapest"
    for _ in range(28):
        s.demand.arrived("n", clock.now - 1)
    assert actions(s.decide(clock.now)) in ([("park", "a")], [("park", "b")]), \
        "n's burst would queue about 20 s of waiting behind s's boot: b's 2 s drain for ten waiters costs less"


async def test_a_sleeper_whose_own_requests_wait_is_not_stopped_to_make_room_for_another_model_while_room_can_come(clock):
    gpus = {0: 100.0}
    a = FakeEngine("a", State.AWAKE, share=0.55, since=clock.now - 2, sleep_residual_gb=2)  # fresh: min_active_s
    waiting = FakeEngine("waiting", share=0.3, sleep_residual_gb=2)
    t = FakeEngine("t", share=0.45, sleep_residual_gb=2)
    s = scheduler(a, waiting, t, clock=clock, gpus=gpus, min_active_s=5)
    wait_for(s, t, clock.now - 1)  # the older waiter: t's room is looked for first
    wait_for(s, waiting, clock.now)
    # 0.55 + 0.45 leaves nothing for waiting's 0.02 residual: t fits now only if waiting is stopped.
    assert actions(s.decide(clock.now)) == [("wake", "waiting")], \
        "not stopped (its waiter would wait out a cold boot for t's sake): woken, as it fits beside a"


async def test_two_waiting_sleepers_each_in_the_others_way_do_not_wait_for_each_other_forever(clock):
    gpus = {0: 100.0}
    first, second = FakeEngine("first", share=0.99, sleep_residual_gb=2), FakeEngine("second", share=0.99, sleep_residual_gb=2)
    s = scheduler(first, second, clock=clock, gpus=gpus)
    wait_for(s, first, clock.now - 1)
    wait_for(s, second, clock.now)
    assert actions(s.decide(clock.now)) == [("stop", "second")], "nothing else will ever make room: the older waiter's model goes first"


async def test_a_sleeper_nobody_asks_for_is_stopped_at_once_rather_than_making_a_request_wait(clock):
    gpus = {0: 100.0}
    a = FakeEngine("a", State.AWAKE, share=0.55, since=clock.now - 2, sleep_residual_gb=2)
    b = FakeEngine("b", State.AWAKE, share=0.35, since=clock.now - 2, sleep_residual_gb=2)
    sleepers = [FakeEngine(f"s{i}", share=0.3, sleep_residual_gb=2) for i in range(3)]
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(a, b, *sleepers, t, clock=clock, gpus=gpus, min_active_s=5)
    wait_for(s, t, clock.now)
    kinds = actions(s.decide(clock.now))
    assert len(kinds) == 1 and kinds[0][0] == "stop", kinds


async def test_a_level1_sleeper_that_would_have_to_be_stopped_is_valued_at_its_cold_boot(clock):
    cold = FakeEngine("cold", share=0.5, level=1)
    hot = awake("hot", clock, share=0.5)
    target = FakeEngine("t", share=0.6)
    s = scheduler(cold, hot, target, clock=clock, ram_gb=20, estimates={"cold": 16, "hot": 16, "t": 16})
    for name in ("hot", "cold"):
        s.costs.observe_wake(name, 1, 0.5)
        s.costs.observe_wake(name, 2, 5.0)
        s.costs.observe_boot(name, 60.0)
        for _ in range(10):
            s.demand.arrived(name, clock.now - 1)
    wait_for(s, target, clock.now)
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "hot")] and plan.decisions[0].level == 2, \
        "cold cannot pass through the GPU: demoting it means a 60 s boot, worth more than hot's 4.5 s saving"


async def test_an_engine_still_waking_counts_as_parkable_later_rather_than_stopping_sleepers_now(clock):
    gpus = {0: 100.0}
    pinned = FakeEngine("p", State.AWAKE, share=0.55, since=clock.now - 100, sleep_residual_gb=2, pin=True)
    waking = FakeEngine("w", State.WAKING, share=0.35, sleep_residual_gb=2)
    sleepers = [FakeEngine(f"s{i}", share=0.3, sleep_residual_gb=2) for i in range(3)]
    t = FakeEngine("t", share=0.05, sleep_residual_gb=2)
    s = scheduler(pinned, waking, *sleepers, t, clock=clock, gpus=gpus, min_active_s=5)
    for sleeper in sleepers:
        s.costs.observe_boot(sleeper.name, 20.0)
        s.costs.observe_wake(sleeper.name, 2, 1.0)
        for _ in range(5):
            s.demand.arrived(sleeper.name, clock.now - 10)
    s.busy["w"], s.doing["w"] = asyncio.get_running_loop().create_future(), ("wake", clock.now, 2.0)
    wait_for(s, t, clock.now)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(7)), "w is awake in 2 s and parkable 5 s later"


async def test_the_demotions_for_one_level1_park_are_weighed_together(clock):
    # hot's 16 GB need two 8 GB sleepers gone; each alone is worth less than hot's saving, both together more.
    # (hot is parked for its group rival, so the GPU has room for the sleepers to pass through to Level 2.)
    small = [FakeEngine(f"s{i}", share=0.1, level=1) for i in range(2)]
    hot = awake("hot", clock, share=0.2, group="g")
    target = FakeEngine("t", share=0.2, group="g")
    s = scheduler(*small, hot, target, clock=clock, ram_gb=20, estimates={"s0": 8, "s1": 8, "hot": 16, "t": 1})
    s.costs.observe_wake("hot", 1, 0.5)
    s.costs.observe_wake("hot", 2, 5.0)  # hot at Level 1 saves 4.5 s
    for sleeper in small:
        s.costs.observe_wake(sleeper.name, 1, 0.5)
        s.costs.observe_wake(sleeper.name, 2, 3.0)  # each at Level 1 saves 2.5 s: 5 s together
    for name in ("hot", "s0", "s1"):
        for _ in range(10):
            s.demand.arrived(name, clock.now - 1)
    wait_for(s, target, clock.now)
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "hot")] and plan.decisions[0].level == 2


async def test_a_parked_engines_residual_is_measured_through_nvml_when_it_sees_the_gpus(clock, monkeypatch):

    from router.scheduling import actions

    a = FakeEngine("a", devices=[0, 1])
    a.process = SimpleNamespace(pid=4242, group_pids=lambda: {4242, 4243})
    seen = {}

    def nvml(pids, index):
        seen[index] = pids
        return {0: 6.0, 1: None}[index]  # GPU 1: NVML could not say

    monkeypatch.setattr(actions, "process_gpu_memory_gb", nvml)
    s = scheduler(a, clock=clock, gpus={0: 80.0, 1: 80.0})
    s._measure_residual(a)
    assert s.residuals == {"a": {0: 6.0}} and seen == {0: {4242, 4243}, 1: {4242, 4243}}
    assert s.ledger().use == {0: pytest.approx(6 / 80), 1: pytest.approx(1 / 80)}, "GPU 1 keeps the configured residual"


# -- boot while serving: boots are the loop's actions, one per GPU at a time ----------------------

def starting(s: Scheduler) -> Scheduler:
    """The scheduler as `start()` leaves it, without its loop: every cold engine still to boot."""
    s.startup = {e.name for e in s.engines if e.state is State.COLD}
    s.startup_total = len(s.startup)
    return s


def running(s: Scheduler, engine: FakeEngine, action: str, clock: Clock, state: Optional[State] = None) -> None:
    """`engine`'s action has started (as `Scheduler._start` records it)."""
    s.busy[engine.name], s.doing[engine.name] = asyncio.get_running_loop().create_future(), (action, clock.now, 1.0)
    if action in ("boot", "restart") or engine.state is State.COLD:
        s.boots.add(engine.name)
    if state is not None:
        engine.state = state


async def test_at_start_engines_boot_pinned_first_and_defaults_last_one_gpu_at_a_time(clock):
    d = FakeEngine("d", State.COLD, share=0.3, default=True)
    a = FakeEngine("a", State.COLD, share=0.3)
    p = FakeEngine("p", State.COLD, share=0.3, pin=True)
    other_gpu = FakeEngine("g1", State.COLD, share=0.3, devices=[1])
    s = starting(scheduler(d, a, p, other_gpu, clock=clock, gpus={0: 80.0, 1: 80.0}))
    assert actions(s.decide(clock.now)) == [("boot", "p"), ("boot", "g1")], "one boot per GPU, the pinned one first"
    running(s, p, "boot", clock, State.BOOTING)
    running(s, other_gpu, "boot", clock, State.BOOTING)
    assert s.decide(clock.now) == Plan(), "GPU 0 is p's until its boot ends (the end pokes the loop)"
    s.busy.clear(), s.doing.clear(), s.boots.clear()
    p.state = other_gpu.state = State.AWAKE
    s.startup -= {"p", "g1"}
    assert actions(s.decide(clock.now)) == [("boot", "a")], "then roster order, the default last"


async def test_a_request_for_a_model_not_booted_yet_moves_its_boot_to_the_front(clock):
    a, b, c = (FakeEngine(n, State.COLD, share=0.3) for n in "abc")
    s = starting(scheduler(a, b, c, clock=clock))
    assert actions(s.decide(clock.now)) == [("boot", "a")]
    running(s, a, "boot", clock, State.BOOTING)
    waiter = wait_for(s, c, clock.now)
    assert s.decide(clock.now) == Plan(), "a boot is never cut short: c waits for a's to end"
    s.busy.clear(), s.doing.clear(), s.boots.clear()
    a.state = State.AWAKE
    s.startup.discard("a")
    assert actions(s.decide(clock.now)) == [("boot", "c")], "c, asked for, boots before b"
    assert not waiter.future.done()


async def test_while_a_model_boots_its_gpu_serves_the_awake_ones_but_no_wake_or_park_starts_there(clock):
    served, sleeper = awake("served", clock, share=0.3), FakeEngine("sleeper", share=0.3)
    elsewhere = FakeEngine("elsewhere", share=0.3, devices=[1])
    booting = FakeEngine("booting", State.BOOTING, share=0.3)
    s = scheduler(served, sleeper, elsewhere, booting, clock=clock, gpus={0: 80.0, 1: 80.0}, idle_sleep_s=1)
    running(s, booting, "boot", clock)
    lease = wait_for(s, served, clock.now)
    wait_for(s, sleeper, clock.now)
    wait_for(s, elsewhere, clock.now)
    plan = s.decide(clock.now)
    assert lease.future.done(), "an awake engine on the booting GPU still takes requests"
    assert actions(plan) == [("wake", "elsewhere")], \
        "vLLM sizes its KV cache from what moves on the device while it boots: nothing else starts there, not even an idle park"


async def test_a_boot_waits_until_nothing_else_moves_on_its_gpu(clock):
    parking = awake("parking", clock, share=0.3)
    cold = FakeEngine("cold", State.COLD, share=0.3)
    s = scheduler(parking, cold, clock=clock)
    running(s, parking, "park", clock, State.DRAINING)
    wait_for(s, cold, clock.now)
    assert s.decide(clock.now) == Plan(), "the park's memory is still moving"
    s.busy.clear(), s.doing.clear()
    parking.state, parking.sleep_level = State.SLEEPING, 1
    assert actions(s.decide(clock.now)) == [("wake", "cold")]
    assert "cold" not in s.boots, "decide records nothing: _start does"


async def test_room_for_a_first_boot_is_made_from_engines_nobody_used_yet_and_the_defaults_stay_awake(clock):
    # Booted a moment ago in the background and not used since: min_active_s does not hold them.
    fresh = FakeEngine("fresh", State.AWAKE, share=0.5, since=clock.now - 1)
    fresh.last_used = clock.now - 2
    default = FakeEngine("default", State.AWAKE, share=0.3, since=clock.now - 1, default=True)
    default.last_used = clock.now - 2
    last = FakeEngine("last", State.COLD, share=0.3)
    s = starting(scheduler(fresh, default, last, clock=clock, min_active_s=30))
    assert actions(s.decide(clock.now)) == [("park", "fresh")], "the default one is parked last"
    assert s.decide(clock.now).decisions[0].why == "room to boot last"


async def test_a_first_boot_that_can_never_fit_is_started_so_it_fails_saying_why(clock):
    pinned = FakeEngine("pinned", State.AWAKE, share=0.8, since=clock.now - 100, pin=True)
    big = FakeEngine("big", State.COLD, share=0.5)
    s = starting(scheduler(pinned, big, clock=clock))
    assert actions(s.decide(clock.now)) == [("boot", "big")], "the first boot ends (failed), so the roster's boot finishes"


async def test_an_admin_sleep_on_a_gpu_where_a_model_boots_waits_for_the_boot_to_end(clock):
    a = awake("a", clock)
    booting = FakeEngine("booting", State.BOOTING, share=0.3)
    s = scheduler(a, booting, clock=clock)
    running(s, booting, "boot", clock)
    parked = asyncio.Event()

    async def park(engine, why, level):
        engine.state = State.SLEEPING
        parked.set()

    s._park = park
    caller = asyncio.create_task(s.sleep(a))
    for _ in range(20):  # let the admin action run as far as it can (no clock involved: loop turns only)
        await asyncio.sleep(0)
    assert s._actions, "the admin action runs"
    assert not parked.is_set() and "a" not in s.busy, "a park would move memory while vLLM profiles the boot"
    booting.state = State.AWAKE
    s.boots.discard("booting")
    s.busy.pop("booting").set_result(None)
    assert await asyncio.wait_for(caller, 5) == "sleeping"


# -- a load format that cannot reload from disk never sleeps at Level 2 -----------------------------

def no_reload(engine: FakeEngine) -> FakeEngine:
    engine.spec = engine.spec.model_copy(update={"args": [*engine.spec.args, "--load-format", "tensorizer"]})
    return engine


async def test_without_host_ram_for_level_1_an_engine_whose_load_format_cannot_reload_is_stopped_not_put_at_level_2(clock):
    tz, plain, t = no_reload(awake("tz", clock, share=0.4)), awake("plain", clock, share=0.4), FakeEngine("t", share=0.6)
    s = scheduler(tz, plain, t, clock=clock, ram_gb=4, estimates={"tz": 8.0, "plain": 8.0, "t": 8.0})
    s.costs.observe_boot("tz", 1.0)  # a cold boot of tz is the cheaper loss: it is the one moved
    s.costs.observe_boot("plain", 60.0)
    wait_for(s, t, clock.now)
    plan = s.decide(clock.now)
    assert actions(plan) == [("stop", "tz")], plan
    assert "cannot reload weights from disk, so it never sleeps at level 2" in plan.decisions[0].why
    assert s._level_alone(tz) is None and s._level_alone(plain) == 2


async def test_with_host_ram_for_level_1_such_an_engine_parks_there_like_any_other(clock):
    tz, t = no_reload(awake("tz", clock, share=0.6)), FakeEngine("t", share=0.6)
    s = scheduler(tz, t, clock=clock, ram_gb=16, estimates={"tz": 8.0, "t": 8.0})
    wait_for(s, t, clock.now)
    plan = s.decide(clock.now)
    assert [(d.action, d.engine.name, d.level) for d in plan.decisions] == [("park", "tz", 1)]


# -- host RAM by measurement (engines/memory/host.py): what the engines hold for sleep, not the checkpoint ----

def measured(engine: FakeEngine, gb: float, *, level1: Optional[float] = None, source: str = "extension") -> FakeEngine:
    """`engine` as its last host-memory measurement left it: `gb` held for sleep (`level1`: what its last
    Level-1 sleep held)."""
    engine.host.held, engine.host.source = int(gb * 1e9), source
    if level1 is not None:
        engine.host.level1, engine.host.level1_copy = int(level1 * 1e9), True
    return engine


async def test_a_level1_park_the_checkpoint_estimate_allows_is_refused_when_a_sleeper_measured_more(clock):
    sleeper = FakeEngine("sleeper", share=0.5, level=1)
    b = awake("b", clock, share=0.5)
    s = scheduler(sleeper, b, clock=clock, ram_gb=20, estimates={"sleeper": 12, "b": 6})
    assert s._choose_level(b, clock.now) == (1, []), "by the estimates, 12 + 6 GB fit in 20"
    measured(sleeper, 18.5, level1=18.5)  # its pinned blocks rounded up to powers of two
    assert s.level1_gb() == pytest.approx(18.5)
    assert s._choose_level(b, clock.now) == (2, []), "measured, the sleeper holds 18.5 GB: b's 6 would break the budget"
    assert s.level1_why(b) == ("host RAM for level 1: it would hold 6.00 GB (estimated: 4.44 GB checkpoint x 1.35) "
                               "beside 18.50 GB the others hold for sleep, over host.ram_budget_gb=20")


async def test_a_level1_sleep_that_measured_less_than_its_estimate_leaves_room_for_another(clock):
    sleeper = FakeEngine("sleeper", share=0.5, level=1)
    b = awake("b", clock, share=0.5)
    s = scheduler(sleeper, b, clock=clock, ram_gb=20, estimates={"sleeper": 16, "b": 6})
    assert s._choose_level(b, clock.now) == (2, []), "unmeasured, the sleeper counts its 16 GB estimate"
    measured(sleeper, 10, level1=10)
    assert s._choose_level(b, clock.now) == (1, [])


async def test_what_stays_held_after_a_level1_wake_counts_against_the_budget(clock):
    woken = awake("woken", clock, share=0.5)  # its wake could not empty the host cache (no worker extension)
    b = awake("b", clock, share=0.5)
    s = scheduler(woken, b, clock=clock, ram_gb=20, estimates={"woken": 16, "b": 6})
    assert s._choose_level(b, clock.now) == (1, []), "an engine that never slept holds nothing for sleep"
    measured(woken, 16, level1=16, source="proc")
    assert s.host_gb(woken) == pytest.approx(16), "awake, its cached pinned copy is still held"
    assert s._choose_level(b, clock.now) == (2, [])
    woken.host.held = None  # unmeasured after that wake: the copy may still be cached, so its estimate counts
    assert s.host_gb(woken) == pytest.approx(16)


async def test_an_engines_own_level1_cost_is_its_last_measured_level1_sleep(clock):
    a = awake("a", clock, share=0.5)
    s = scheduler(a, clock=clock, ram_gb=20, estimates={"a": 12})
    assert s._choose_level(a, clock.now) == (1, []), "estimated 12 GB fit in 20"
    measured(a, 0.1, level1=21)  # its last Level-1 sleep held 21 GB; its wake gave most of it back
    a.host.level1_copy = False
    assert s._choose_level(a, clock.now) == (2, []), "the next Level-1 sleep is expected to hold what the last one did"


async def test_a_level1_sleeper_whose_wake_cannot_give_host_ram_back_is_stopped_for_it_not_demoted(clock):
    gpus = {0: 100.0}
    idle = measured(FakeEngine("idle", share=0.3, level=1), 16, level1=16, source="proc")
    hot = awake("hot", clock, share=0.3, group="g")
    target = FakeEngine("t", share=0.3, group="g")
    s = scheduler(idle, hot, target, clock=clock, gpus=gpus, ram_gb=20, estimates={"idle": 16, "hot": 16, "t": 1})
    s.costs.observe_wake("hot", 1, 0.5)
    s.costs.observe_wake("hot", 2, 30.0)
    s.costs.observe_boot("idle", 1.0)
    for _ in range(10):
        s.demand.arrived("hot", clock.now - 1)
    wait_for(s, target, clock.now)
    idle.host.release_ok = True
    assert actions(s.decide(clock.now)) == [("park", "hot"), ("demote", "idle")], "its wake empties the cache: demoted"
    s.busy.clear(), s.doing.clear(), s.parking_level.clear()
    idle.host.release_ok = False  # no worker extension: a demotion would leave the pinned copy cached
    assert actions(s.decide(clock.now)) == [("park", "hot"), ("stop", "idle")], "only its stop gives the RAM back"


async def test_a_level1_park_copies_out_only_once_the_sleeper_demoted_for_its_host_ram_has_let_go(clock):
    """The park and the demotion made for its RAM start together; the demotion (a wake through the GPU and a
    Level-2 sleep) holds its copy until it ends, so a park that copied out at once held both over the budget."""
    gpus = {0: 100.0}
    idle = measured(FakeEngine("idle", share=0.3, level=1), 16, level1=16)
    idle.host.release_ok = True
    hot = awake("hot", clock, share=0.3, group="g")
    target = FakeEngine("t", share=0.3, group="g")
    s = scheduler(idle, hot, target, clock=clock, gpus=gpus, ram_gb=20, estimates={"idle": 16, "hot": 16, "t": 1})
    s.costs.observe_wake("hot", 1, 0.5)
    s.costs.observe_wake("hot", 2, 30.0)
    for _ in range(10):
        s.demand.arrived("hot", clock.now - 1)
    wait_for(s, target, clock.now)
    park, demote = s.decide(clock.now).decisions
    assert (park.action, park.level, park.after, demote.action) == ("park", 1, ("idle",), "demote")
    s.busy.clear(), s.doing.clear(), s.parking_level.clear()

    slept: list[int] = []

    async def sleep(level: int, preempt: Optional[str] = None) -> None:
        slept.append(level)
        hot.state, hot.sleep_level = State.SLEEPING, level

    hot.sleep, hot.last_phases = sleep, {}
    s.busy["idle"] = asyncio.get_running_loop().create_future()  # its demotion runs
    parking = asyncio.ensure_future(s._park(hot, park.why, 1, park.after))
    for _ in range(5):
        await asyncio.sleep(0)
    assert slept == [], "idle still holds its copy: hot waits to make its own"
    s.busy.pop("idle").set_result(None)
    await asyncio.wait_for(parking, 5)
    assert slept == [1]

    hot.state, hot.sleep_level, hot.since = State.AWAKE, None, clock.now - 100
    s.busy["idle"], s.doing["idle"] = asyncio.get_running_loop().create_future(), ("demote", clock.now, 0.0)
    assert s.level1_gb() == 0, "counted as done, though idle still holds its 16 GB until the demotion ends"
    [later] = s._move(Victim(hot, "park", {}, 0.0), "idle", s.ledger(), clock.now)
    assert (later.level, later.after) == (1, ("idle",)), "a park decided later waits for that demotion too"


async def test_a_stopped_engine_holds_no_host_ram_whatever_its_last_measurement_said(clock):
    gone = measured(FakeEngine("gone", State.COLD), 16, level1=16)
    b = awake("b", clock, share=0.5)
    s = scheduler(gone, b, clock=clock, ram_gb=20, estimates={"gone": 16, "b": 6})
    assert s.host_gb(gone) == 0 and s._choose_level(b, clock.now) == (1, [])


def popular_beside(s: Scheduler, other: FakeEngine, clock: Clock) -> None:
    """`popular` (asked for 10 times just now) and `other`, Level-1 sleepers whose wakes are priced (0.5 s from
    Level 1, 5 s from Level 2) and give their host copy back."""
    popular = next(e for e in s.engines if e.name == "popular")
    for engine in (popular, other):
        s.costs.observe_wake(engine.name, 1, 0.5)
        s.costs.observe_wake(engine.name, 2, 5.0)
        engine.host.release_ok = True
    for _ in range(10):
        s.demand.arrived("popular", clock.now - 1)


async def test_a_level1_sleep_that_held_more_than_its_guess_over_the_budget_sends_the_least_valuable_sleeper_down(clock):
    gpus = {0: 100.0}
    popular = measured(FakeEngine("popular", share=0.3, level=1), 12, level1=12)
    unused = measured(FakeEngine("unused", share=0.3, level=1), 10, level1=10)  # estimated 8: it fit, measured it does not
    s = scheduler(popular, unused, awake("a", clock, share=0.3), clock=clock, gpus=gpus, ram_gb=20,
                  estimates={"popular": 12, "unused": 8}, wake_ahead=False)  # the room is free: popular would wake ahead
    popular_beside(s, unused, clock)
    plan = s.decide(clock.now)
    assert actions(plan) == [("demote", "unused")], "22 GB held for sleep in a 20 GB budget: the one nobody asks for goes"
    assert plan.decisions[0].why == ("host RAM over host.ram_budget_gb=20 by measurement: the engines hold 22.00 GB "
                                     "for sleep, 10.00 GB of it unused's")
    s.busy.clear(), s.doing.clear()
    unused.host.release_ok = False
    assert actions(s.decide(clock.now)) == [("stop", "unused")], "its wake cannot give the RAM back: stopped"
    unused.host.held = int(8e9)
    assert actions(s.decide(clock.now)) == [], "within the budget: nobody moves"


async def test_a_victims_level1_copy_is_sized_beside_the_copy_its_target_still_holds_until_that_wake(clock):
    """Issue 54: a, b, c in one group round-robin under host.ram_budget_gb=0.34, each Level-1 copy 0.143 GB.
    c's park for a copies out before a's wake (which waits for that room) gives a's copy back: the three
    copies are held at once, 0.43 GB, if c's level is chosen as if a's were gone already."""
    a = measured(FakeEngine("a", share=0.6, level=1, group="g"), 0.143, level1=0.143)
    b = measured(FakeEngine("b", share=0.6, level=1, group="g"), 0.143, level1=0.143)
    c = awake("c", clock, share=0.6, group="g")
    for sleeper in (a, b):
        sleeper.host.release_ok = True  # the worker extension empties the cache after the wake
    s = scheduler(a, b, c, clock=clock, ram_gb=0.34, estimates={"a": 0.135, "b": 0.135, "c": 0.135})
    wait_for(s, a, clock.now)
    plan = s.decide(clock.now)
    assert [(d.action, d.engine.name, d.level) for d in plan.decisions] == [("park", "c", 2)], \
        "a's 0.143 GB and b's are held while c parks: c's 0.135 GB would break the budget"
    assert "beside 0.29 GB the others hold for sleep" in plan.decisions[0].why


async def test_two_victims_of_one_wake_are_not_both_parked_at_level1_in_ram_for_one_copy(clock):
    a, b = awake("a", clock, share=0.5), awake("b", clock, share=0.5)
    target = FakeEngine("t", share=0.9)
    s = scheduler(a, b, target, clock=clock, ram_gb=20, estimates={"a": 12, "b": 12, "t": 12})
    wait_for(s, target, clock.now)
    plan = s.decide(clock.now)
    assert sorted((d.action, d.engine.name, d.level) for d in plan.decisions) == [("park", "a", 1), ("park", "b", 2)], \
        "b's level counts the copy a's park, planned a moment before, will hold"
    assert "beside 12.00 GB the others hold for sleep" in plan.decisions[1].why


async def test_a_fixed_level1_engine_with_no_host_ram_for_its_copy_is_stopped_rather_than_break_the_budget(clock):
    """The same round-robin with sleep_level: 1 and no worker extension (each copy stays cached after its wake):
    c's Level-1 park made the third copy, and only the over-budget remedy stopped a sleeper after it."""
    a, b = (measured(FakeEngine(n, share=0.6, level=1, group="g", sleep_level=1), 0.143, level1=0.143, source="proc")
            for n in "ab")
    c = awake("c", clock, share=0.6, group="g", sleep_level=1)
    s = scheduler(a, b, c, clock=clock, ram_gb=0.34, estimates={"a": 0.135, "b": 0.135, "c": 0.135})
    wait_for(s, a, clock.now)
    [decision] = s.decide(clock.now).decisions
    assert (decision.action, decision.engine.name) == ("stop", "c"), "level 2 is ruled out: a stop keeps the budget"
    assert "no room for it at level 1 in host RAM, and its sleep_level: 1 rules out level 2; host RAM for level 1: " \
        "it would hold 0.14 GB" in decision.why, decision.why
    unsized = awake("unsized", clock, share=0.6, sleep_level=1)
    assert s._choose_level(unsized, clock.now) == (1, []), "its copy cannot be sized before it is measured: level 1"


async def test_a_sleeper_whose_room_is_being_made_is_not_sent_down_for_the_ram_its_own_wake_gives_back(clock):
    target = measured(FakeEngine("target", share=0.6, level=1), 12, level1=12)
    target.host.release_ok = True
    parking = awake("parking", clock, share=0.6)
    s = scheduler(target, parking, clock=clock, ram_gb=20, estimates={"target": 12, "parking": 6})
    wait_for(s, target, clock.now)
    assert [(d.action, d.engine.name, d.level) for d in s.decide(clock.now).decisions] == [("park", "parking", 1)], \
        "by its estimate, parking's copy fits beside the one the target holds until its wake"
    s.busy["parking"], s.doing["parking"] = asyncio.get_running_loop().create_future(), ("park", clock.now, 0.0)
    s.parking_level["parking"] = 1
    measured(parking, 12, level1=12)  # it held twice its guess
    assert s.decide(clock.now) == Plan(), "12 + 12 GB over 20 while the park runs, but target's 12 are on their way out"


async def test_stopping_a_sleeper_is_priced_with_the_wait_its_cold_boot_makes_its_gpu_neighbours_pay(clock):
    sleeper, neighbour = FakeEngine("sleeper", share=0.3, level=1), FakeEngine("neighbour", share=0.3)
    elsewhere = FakeEngine("elsewhere", share=0.3, devices=[1])
    s = scheduler(sleeper, neighbour, elsewhere, clock=clock, gpus={0: 100.0, 1: 100.0})
    s.costs.observe_boot("sleeper", 50.0)
    s.costs.observe_wake("sleeper", 1, 1.0)
    for name in ("sleeper", "elsewhere"):
        for _ in range(10):
            s.demand.arrived(name, clock.now - 1)
    alone = s.expected_cost(sleeper, "stop", clock.now)
    rate = s.demand.rate("sleeper", clock.now)
    chance = s._reuse(sleeper, clock.now, s.swap.demand_tau_s)  # a stopped engine's boot is paid whenever it is next asked for
    assert alone == pytest.approx(chance * (49.0 + rate * (50.0 ** 2 - 1.0) / 2), rel=1e-3), \
        "a busy GPU elsewhere waits for nothing: the boot beyond the wake, for the asker and those arriving during it"
    for _ in range(10):
        s.demand.arrived("neighbour", clock.now - 1)
    shared = s.expected_cost(sleeper, "stop", clock.now)
    arriving = s.demand.rate("neighbour", clock.now) * 50.0
    assert shared - alone == pytest.approx(chance * arriving * 25.0, rel=1e-3), \
        "its boot holds GPU 0 alone for 50 s: each request the sleeping neighbour is sent meanwhile waits behind it, " \
        "half of it on average"
    neighbour.state, neighbour.sleep_level = State.AWAKE, None
    assert s.expected_cost(sleeper, "stop", clock.now) == pytest.approx(alone, rel=1e-3), \
        "an awake neighbour answers while the boot runs"
