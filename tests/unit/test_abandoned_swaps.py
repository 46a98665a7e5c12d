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

