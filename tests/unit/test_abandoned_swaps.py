"""Swaps nobody waits for any more, and reloads that remove what a swap was about: the scheduler's
loop goes on (promise 5), and nothing of the swap outlives it. Fake engines and a fake clock, as in
tests/unit/test_scheduler.py; where the loop itself is the subject, it runs, and each test waits for
what it expects, never for a fixed time."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from engines.engine import State
from router.scheduling.state import Waiter
from tests.unit.test_scheduler import FakeEngine, actions, awake, clock, scheduler, wait_for  # noqa: F401 (clock: a fixture)
from tests.unit.test_wake_ahead import asked, priced


class Moving(FakeEngine):
    """A fake engine the actions can move: a wake, a stop, and what a swap record reads."""

    last_phases: dict[str, float] = {}
    progress = type("Progress", (), {"gates": []})()

    async def wake(self) -> None:
        self.state, self.sleep_level = State.AWAKE, None

    async def stop(self) -> None:
        self.state, self.sleep_level = State.COLD, None


async def until(check: Callable[[], bool], turns: int = 1000) -> None:
    """Let the loop and its actions run until `check` holds (a bounded number of turns, not a time)."""
    for _ in range(turns):
        if check():
            return
        await asyncio.sleep(0)
    assert check(), "the scheduler never got there"


def leaves(s, waiter: Waiter) -> None:
    """What `acquire` does when its client goes away, or its queue.max_wait_s passes."""
    s._forget(waiter)


async def test_a_reload_that_removes_a_target_whose_waiter_left_mid_swap_does_not_stop_the_scheduler(clock):
    a, t, other = awake("a", clock, share=0.6), Moving("t", share=0.6), Moving("other", share=0.3)
    s = scheduler(a, t, other, clock=clock, gpus={0: 100.0})
    parked = asyncio.Event()

    async def park(engine, why, level):  # a drain that lasts until the test says
        await parked.wait()
        engine.state, engine.sleep_level = State.SLEEPING, level

    s._park = park
    waiter = wait_for(s, t, clock.now)
    s.start()
    try:
        await until(lambda: "a" in s.busy)
        leaves(s, waiter)  # while its victim still parks
        parked.set()
        await until(lambda: "a" not in s.busy)
        s.retire(t)  # a reload removes t
        await until(lambda: t not in s.engines)
        waiter = wait_for(s, other, clock.now)
        s.poke()
        await until(waiter.future.done)
        assert waiter.future.exception() is None and other.state is State.AWAKE, "the loop still wakes, parks and grants"
        assert not s._task.done() and s.defect is None
    finally:
        await s.stop()


async def test_a_swap_whose_waiters_all_left_is_forgotten_once_its_victims_are_parked(clock):
    a, t = awake("a", clock, share=0.6), FakeEngine("t", share=0.6)
    s = scheduler(a, t, clock=clock, gpus={0: 100.0})
    waiter = wait_for(s, t, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "a")] and "t" in s.making_room
    s.busy["a"] = asyncio.get_running_loop().create_future()  # its park runs
    leaves(s, waiter)
    s.decide(clock.now)
    assert "t" in s.making_room, "while its victim parks, the room it makes is still counted as t's"
    del s.busy["a"]
    a.state, a.sleep_level = State.SLEEPING, 2
    s.decide(clock.now)
    assert s.making_room == {}, "nobody waits for t: the swap is over"


async def test_a_swap_whose_target_left_the_roster_is_forgotten_at_once(clock):
    a, t = awake("a", clock, share=0.6), FakeEngine("t", share=0.6)
    s = scheduler(a, t, clock=clock, gpus={0: 100.0})
    wait_for(s, t, clock.now)
    s.decide(clock.now)
    s.busy["a"] = asyncio.get_running_loop().create_future()
    s.engines.remove(t)  # what `_retire` leaves
    s.decide(clock.now)
    assert s.making_room == {}


async def test_an_abandoned_swap_leaves_its_gpu_to_wake_ahead_and_its_target_is_not_staged_for_a_wake_to_come(clock):
    a, t, popular = awake("a", clock, share=0.6), FakeEngine("t", share=0.6), FakeEngine("popular", share=0.6)
    t.stager.enabled = True
    s = scheduler(a, t, popular, clock=clock, gpus={0: 100.0})
    priced(s, "popular")
    waiter = wait_for(s, t, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "a")]
    leaves(s, waiter)  # before its victim's park even began to matter
    a.state, a.sleep_level = State.SLEEPING, 2
    asked(s, "popular", 20, clock.now - 5)
    assert actions(s.decide(clock.now)) == [("wake", "popular")], "the room t's swap made goes to the likeliest"
    s.stage_ahead(clock.now)
    assert not t.stager.running and "t" not in s.staged_for, "t is no wake's target: its checkpoint is not read for one"


async def test_a_wake_whose_victim_a_reload_removed_wakes_and_grants_its_waiter(clock):
    v, t = awake("v", clock, share=0.6), Moving("t", share=0.6)
    s = scheduler(v, t, clock=clock, gpus={0: 100.0})
    waiter = wait_for(s, t, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "v")]
    v.state, v.sleep_level = State.SLEEPING, 2  # parked
    s.engines.remove(v)  # a reload removed it (`_retire`) before t's wake began
    plan = s.decide(clock.now)
    assert actions(plan) == [("wake", "t")]
    s._start(plan.decisions[0])
    await asyncio.gather(*s._actions)
    assert t.state is State.AWAKE and t.failure is None
    assert waiter.future.done() and waiter.future.exception() is None, "its client is answered, not sent a 503"
    assert s.last_swap.result == "ok" and s.last_swap.from_models == ["v"]


async def test_a_defect_in_the_decisions_is_logged_once_shown_and_the_loop_goes_on(clock, caplog):
    a = awake("a", clock)
    s = scheduler(a, clock=clock)
    s.defect_pause_s = 0.001
    decide, calls = s.decide, []

    def broken(now):
        calls.append(now)
        if len(calls) <= 3:
            raise KeyError("gone")
        return decide(now)

    s.decide = broken
    waiter = wait_for(s, a, clock.now)
    with caplog.at_level(logging.ERROR, logger="hotswap"):
        s.start()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=10)  # a deadline, not a pause
        finally:
            await s.stop()
    assert len(calls) >= 4 and a.in_flight == 1, "it looked again after each defect and granted the waiter"
    assert [r.getMessage() for r in caplog.records if r.exc_info] == [
        "internal error in the scheduler's decisions; it looks again in 0.001 s"], "one traceback, not one a look"
    assert s.defect["error"] == "KeyError: 'gone'" and s.defect["count"] == 3


async def test_a_waiter_that_leaves_after_its_room_was_made_has_the_swap_forgotten_at_once(clock):
    """Its victims parked, but its wake cannot start yet (a boot holds the GPU): when it leaves, the loop
    looks again at once rather than at the next action's end, so nothing shows a swap nobody waits for."""
    a, t = awake("a", clock, share=0.6), FakeEngine("t", share=0.6)
    s = scheduler(a, t, clock=clock, gpus={0: 100.0})
    waiter = wait_for(s, t, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "a")] and "t" in s.making_room
    a.state, a.sleep_level = State.SLEEPING, 2  # its park ended
    s._poke.clear()
    leaves(s, waiter)
    assert s._poke.is_set(), "the loop is woken to decide again"
    s.decide(clock.now)
    assert "t" not in s.making_room
