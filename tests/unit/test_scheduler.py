"""The group scheduler's policy, driven through `decide` with fake engines and a fake clock: no
processes, no sleeps. Each test is a scenario the real loop meets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Optional

import pytest

from config.schema import Queue, Swap
from engines.engine import EngineFailed, State
from router.errors import APIError
from router.backoff import MAX_BACKOFF_S
from router.scheduler import Decision, GroupScheduler, Waiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """What the scheduler reads of an engine, and the lease bookkeeping it drives."""

    def __init__(self, name: str, state: State = State.SLEEPING, *, since: float = 0.0, default: bool = False):
        self.name = name
        self.state = state
        self.since = since
        self.last_used = since
        self.in_flight = 0
        self.needs_restart: Optional[str] = None
        self.failure: Optional[str] = None
        self.spec = SimpleNamespace(default=default, sleep_level=2)
        self.stopped = 0

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


def group(*engines: FakeEngine, clock: Clock, active: Optional[FakeEngine] = None, **swap) -> GroupScheduler:
    settings = {"min_active_s": 5, "max_hold_s": 30, **swap}
    scheduler = GroupScheduler("g", list(engines), Swap(**settings), Queue(), clock=clock)
    scheduler.active = active
    return scheduler


def wait_for(scheduler: GroupScheduler, engine: FakeEngine, since: float) -> Waiter:
    waiter = Waiter(engine, since)
    scheduler.waiting[engine.name].append(waiter)
    return waiter


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def test_a_waiter_for_the_awake_model_is_granted_at_once(clock):
    a = FakeEngine("a", State.AWAKE, since=clock.now - 100)
    scheduler = group(a, FakeEngine("b"), clock=clock, active=a)
    waiter = wait_for(scheduler, a, clock.now)
    assert scheduler.decide(clock.now) == Decision()
    assert waiter.future.done() and a.in_flight == 1


async def test_a_waiter_for_a_sleeping_model_swaps_when_the_awake_one_is_idle(clock):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 100), FakeEngine("b")
    scheduler = group(a, b, clock=clock, active=a)
    wait_for(scheduler, b, clock.now)
    assert scheduler.decide(clock.now) == Decision("swap", b)


async def test_a_busy_engine_keeps_the_gpu_until_the_oldest_waiter_has_waited_max_hold_s(clock):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 100), FakeEngine("b")
    a.in_flight = 3
    scheduler = group(a, b, clock=clock, active=a, max_hold_s=30)
    wait_for(scheduler, b, since=clock.now)
    assert scheduler.decide(clock.now) == Decision(wait_s=30)
    clock.now += 29.5
    assert scheduler.decide(clock.now) == Decision(wait_s=pytest.approx(0.5))
    clock.now += 0.5
    assert scheduler.decide(clock.now) == Decision("swap", b)


async def test_the_model_whose_oldest_waiter_waited_longest_goes_first(clock):
    a, b, c = FakeEngine("a", State.AWAKE, since=clock.now - 100), FakeEngine("b"), FakeEngine("c")
    scheduler = group(a, b, c, clock=clock, active=a)
    wait_for(scheduler, b, since=clock.now - 1)
    wait_for(scheduler, c, since=clock.now - 2)
    assert scheduler.decide(clock.now) == Decision("swap", c)


async def test_a_freshly_woken_engine_stays_min_active_s_even_when_idle(clock):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 2), FakeEngine("b")
    scheduler = group(a, b, clock=clock, active=a, min_active_s=5)
    wait_for(scheduler, b, clock.now)
    assert scheduler.decide(clock.now) == Decision(wait_s=pytest.approx(3))
    clock.now += 3
    assert scheduler.decide(clock.now) == Decision("swap", b)


async def test_idle_sleep_s_parks_an_idle_engine_even_when_nobody_waits(clock):
    a = FakeEngine("a", State.AWAKE, since=clock.now - 100)
    a.last_used = clock.now - 10
    scheduler = group(a, clock=clock, active=a, idle_sleep_s=60)
    assert scheduler.decide(clock.now) == Decision(wait_s=pytest.approx(50))
    a.in_flight = 1
    assert scheduler.decide(clock.now) == Decision(), "a busy engine is never parked for idleness"
    a.in_flight = 0
    clock.now += 50
    decision = scheduler.decide(clock.now)
    assert (decision.action, decision.engine) == ("park", a)


async def test_nothing_to_do_waits_until_poked(clock):
    a = FakeEngine("a", State.AWAKE, since=clock.now - 100)
    assert group(a, clock=clock, active=a).decide(clock.now) == Decision(wait_s=None)


async def test_an_awake_engine_that_died_is_handled_as_a_failure_and_its_waiters_get_503(clock):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 100), FakeEngine("b")
    scheduler = group(a, b, clock=clock, active=a)
    a.state, a.failure = State.FAILED, "engine a: process died unexpectedly in state awake"
    waiter = wait_for(scheduler, a, clock.now)
    decision = scheduler.decide(clock.now)
    assert decision == Decision("failed", a, a.failure)
    await scheduler._act(decision)
    assert scheduler.active is None and a.stopped == 1 and scheduler.backoff.failures["a"] == 1
    with pytest.raises(APIError) as raised:
        waiter.future.result()
    assert raised.value.status == 503 and "process died unexpectedly" in raised.value.message


async def test_a_mid_life_collapse_restarts_at_once_even_under_load(clock):
    a = FakeEngine("a", State.AWAKE, since=clock.now - 100)
    a.in_flight = 4  # steady load: waiting for an idle moment would never end
    a.needs_restart = "mean acceptance length 1.00 is below 1.80"
    scheduler = group(a, clock=clock, active=a)
    waiter = wait_for(scheduler, a, clock.now)
    assert scheduler.decide(clock.now) == Decision("restart", a, a.needs_restart)
    assert not waiter.future.done(), "new requests queue behind the restart, they are not leased to the collapsed engine"


async def test_repeated_failures_back_off_and_the_first_retry_is_immediate(clock):
    b = FakeEngine("b", State.FAILED)
    scheduler = group(b, clock=clock)
    expected = [0, 1, 2, 4, 8, 16, 32, MAX_BACKOFF_S, MAX_BACKOFF_S]
    for n, delay in enumerate(expected, 1):
        scheduler._count_failure(b, "boom")
        assert scheduler.backoff.failures["b"] == n
        assert scheduler.backoff.retry_at["b"] - clock.now == delay
    assert scheduler.backoff.waiting(b, clock.now)
    with pytest.raises(APIError, match="restarting in 60 s after 9 failures") as raised:
        await scheduler.acquire(b)
    assert raised.value.status == 503 and raised.value.retry_after == MAX_BACKOFF_S
    clock.now += MAX_BACKOFF_S
    assert not scheduler.backoff.waiting(b, clock.now)


async def test_waiters_of_a_model_that_is_backing_off_are_failed_not_swapped_to(clock):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 100), FakeEngine("b", State.FAILED)
    scheduler = group(a, b, clock=clock, active=a)
    scheduler._count_failure(b, "boom")
    scheduler._count_failure(b, "boom")  # the second failure backs off 1 s
    waiter = wait_for(scheduler, b, clock.now)
    assert scheduler.decide(clock.now) == Decision()
    assert isinstance(waiter.future.exception(), APIError)
    clock.now += 1
    wait_for(scheduler, b, clock.now)
    assert scheduler.decide(clock.now) == Decision("swap", b), "after the backoff, the next request retries"


async def test_a_failure_of_the_active_engine_is_counted_once(clock):
    a = FakeEngine("a", State.AWAKE, since=clock.now - 100)
    scheduler = group(a, clock=clock, active=a)
    a.fail("restart failed: boot failed")
    await scheduler._handle_failure(a, a.failure)
    assert scheduler.active is None
    assert scheduler.decide(clock.now) == Decision(), "the loop must not count the same failure again"
    assert scheduler.backoff.failures["a"] == 1 and scheduler.backoff.retry_at["a"] == clock.now


async def test_a_defect_inside_an_action_fails_that_engine_and_the_loop_goes_on(clock, caplog):
    a, b = FakeEngine("a", State.AWAKE, since=clock.now - 100), FakeEngine("b")
    scheduler = group(a, b, clock=clock, active=a)
    waiter = wait_for(scheduler, b, clock.now)

    async def broken_swap(target, restart=None):
        target.state = State.VERIFYING  # left mid-transition, as a real defect would
        raise ValueError("could not convert string to float: 'garbage'")

    scheduler._swap_to = broken_swap
    await scheduler._act(scheduler.decide(clock.now))
    assert b.state is State.FAILED and "internal error during swap: ValueError" in b.failure
    assert isinstance(waiter.future.exception(), APIError) and waiter.future.exception().status == 503
    assert [r.levelname for r in caplog.records if r.exc_info] == ["ERROR"], "the traceback is logged once"


async def test_a_defect_in_an_admin_action_answers_the_caller_at_once(clock):
    a = FakeEngine("a", State.AWAKE, since=clock.now - 100)
    scheduler = group(a, clock=clock, active=a)

    async def broken() -> str:
        a.state = State.DRAINING
        raise KeyError("boom")

    call = asyncio.ensure_future(scheduler._command(a, "sleep", broken))
    await asyncio.sleep(0)  # the command is queued; run it as the loop would
    await scheduler._run_command(scheduler._commands.popleft())
    with pytest.raises(APIError, match="admin sleep a failed on an internal error: KeyError") as raised:
        await call
    assert raised.value.status == 500
    assert a.state is State.FAILED and scheduler.active is None, "nothing is left draining with nobody driving it"
