"""Batch requests yield at once (issue 55, item 2): a user's waiter never waits out `swap.max_hold_s` or a
drain behind an engine whose in-flight work is batch only. That engine is parked at once and its streams
are cut as `preempted` (the proxy pauses and resumes them); an interactive stream is never preempted, and
batch work never preempts anything. Fake engines, a fake clock, `decide`; then the park itself."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest

from config.schema import Queue, Swap
from engines.engine import State
from engines.leases import PREEMPTED, Leases
from router.scheduling import Capacity, Scheduler
from router.scheduling.estimates import PREFILL_TPS
from router.scheduling.history import Events
from router.scheduling.state import BATCH, INTERACTIVE
from tests.unit.test_scheduler import Clock, FakeEngine, actions, awake, wait_for


@pytest.fixture
def clock() -> Clock:
    return Clock()


def scheduler(*engines: FakeEngine, clock: Clock, min_active_s: float = 5) -> Scheduler:
    swap = Swap(min_active_s=min_active_s, max_hold_s=30, interactive_hold_s=60, drain_timeout_s=30)
    return Scheduler(list(engines), swap, Queue(), Capacity(None, 100), clock=clock)


def serving(s: Scheduler, engine: FakeEngine, klass: str, n: int = 1) -> None:
    """`n` requests of `klass` in flight on `engine`, as `_grant` would count them."""
    for _ in range(n):
        engine.try_lease()
        s._leased(engine, klass)


async def test_a_user_does_not_wait_out_max_hold_s_behind_batch_streams_they_are_preempted(clock):
    evals, chat = awake("evals", clock), FakeEngine("chat")
    s = scheduler(evals, chat, clock=clock)
    serving(s, evals, BATCH, 2)
    wait_for(s, chat, clock.now)  # just arrived: max_hold_s (30 s) would make it wait
    [park] = s.decide(clock.now).decisions
    assert (park.action, park.engine.name, park.preempt) == ("park", "evals", True)
    assert park.why.startswith("preempt 2 batch request(s) of evals: room for chat")


async def test_an_interactive_stream_is_never_preempted_it_drains_after_max_hold_s(clock):
    evals, chat = awake("evals", clock), FakeEngine("chat")
    s = scheduler(evals, chat, clock=clock)
    serving(s, evals, BATCH, 3)
    serving(s, evals, INTERACTIVE)  # one user among the batch streams: the engine's work is not batch only
    wait_for(s, chat, clock.now)
    assert actions(s.decide(clock.now)) == [], "the usual rule: the user waits max_hold_s"
    clock.now += 30
    [park] = s.decide(clock.now).decisions
    assert (park.action, park.preempt) == ("park", False), "then a drain, up to drain_timeout_s: no preemption"


async def test_batch_work_never_preempts_batch_work_it_waits_as_before(clock):
    evals, nightly = awake("evals", clock), FakeEngine("nightly")
    s = scheduler(evals, nightly, clock=clock)
    serving(s, evals, BATCH)
    wait_for(s, nightly, clock.now, BATCH)
    assert actions(s.decide(clock.now)) == []
    clock.now += 30
    [park] = s.decide(clock.now).decisions
    assert park.preempt is False


async def test_an_operators_lease_is_not_batch_work(clock):
    evals, chat = awake("evals", clock), FakeEngine("chat")
    s = scheduler(evals, chat, clock=clock)
    serving(s, evals, BATCH)
    evals.try_lease()  # an admin LoRA load, say: leased with no class
    wait_for(s, chat, clock.now)
    assert actions(s.decide(clock.now)) == [], "only work the scheduler knows to be batch yields at once"


async def test_batch_work_that_could_not_be_resumed_exactly_is_not_preempted(clock):
    evals, chat = awake("evals", clock), FakeEngine("chat")
    s = scheduler(evals, chat, clock=clock)
    serving(s, evals, BATCH, 2)
    evals.leases.unresumable = 1  # n > 1, say: a cut would lose it
    wait_for(s, chat, clock.now)
    assert actions(s.decide(clock.now)) == [], "it holds its engine as before: max_hold_s, then a drain"


async def test_min_active_s_still_protects_a_model_that_just_woke(clock):
    evals, chat = FakeEngine("evals", State.AWAKE, since=clock.now - 2), FakeEngine("chat")
    s = scheduler(evals, chat, clock=clock, min_active_s=5)
    serving(s, evals, BATCH)
    wait_for(s, chat, clock.now)
    assert s.decide(clock.now).wait_s == pytest.approx(3), "anti-thrash holds whoever asked: 3 s more, not 30"
    clock.now += 3
    assert s.decide(clock.now).decisions[0].preempt


async def test_a_preemption_is_priced_at_the_streams_recompute_and_their_pause(clock):
    evals = awake("evals", clock)
    s = scheduler(evals, FakeEngine("chat"), clock=clock)
    s.costs.observe_wake("evals", 2, 4.0)  # the wake back, at the level a park would choose here
    serving(s, evals, BATCH, 2)
    evals.tokens = 20_000  # two prompts and what they have generated so far
    assert s.preempt_cost(evals, clock.now) == pytest.approx(2 * 4.0 + 20_000 / PREFILL_TPS), "before any is measured"
    s.costs.observe_prefill("evals", 40_000, 2.0)  # a resumed answer's 40k tokens in 2 s
    assert s.preempt_cost(evals, clock.now) == pytest.approx(2 * 4.0 + 1.0)


async def test_an_idle_engine_is_parked_before_batch_streams_are_preempted(clock):
    evals, idle, chat = awake("evals", clock, share=0.3), awake("idle", clock, share=0.3), FakeEngine("chat", share=0.5)
    s = scheduler(evals, idle, chat, clock=clock)
    serving(s, evals, BATCH)
    wait_for(s, chat, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "idle")]


async def test_the_preempted_requests_are_demand_that_brings_their_model_back(clock):
    evals, chat = awake("evals", clock), FakeEngine("chat")
    s = scheduler(evals, chat, clock=clock)
    s.swap = Swap(min_active_s=0, max_hold_s=30, interactive_hold_s=0)
    serving(s, evals, BATCH)
    wait_for(s, chat, clock.now)
    assert s.decide(clock.now).decisions[0].preempt
    evals.state, evals.sleep_level, chat.state, chat.since = State.SLEEPING, 2, State.AWAKE, clock.now
    s.release(evals, BATCH)  # the cut stream gives its lease back ...
    s.waiting["chat"].clear()
    wait_for(s, evals, clock.now, BATCH)  # ... and waits again, for the rest, as a batch waiter of its model
    assert actions(s.decide(clock.now)) == [("park", "chat")], "chat is idle, no interactive hold: evals comes back"


# -- the park itself ------------------------------------------------------------------------------------

class Evictions(Events):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def evicted(self, engine: object, reason: str) -> None:
        self.reasons.append(reason)


async def test_a_preempting_park_cuts_at_once_and_counts_as_a_preempt_eviction(clock):
    evals = awake("evals", clock)
    s = scheduler(evals, FakeEngine("chat"), clock=clock)
    s.events = evictions = Evictions()
    slept: list[tuple[int, Optional[str]]] = []

    async def sleep(level: int, preempt: Optional[str] = None) -> None:
        slept.append((level, preempt))
        evals.state, evals.sleep_level = State.SLEEPING, level

    evals.sleep, evals.last_phases = sleep, {}
    await s._park(evals, "preempt 1 batch request(s) of evals: room for chat", 2, (), preempt=True)
    assert slept == [(2, "preempt 1 batch request(s) of evals: room for chat")]
    assert evictions.reasons == ["preempt"]


async def test_the_leases_cut_every_running_request_at_once_as_preempted():
    leases = Leases("evals", lambda: 60.0)
    cuts: list[str] = []

    async def request(tokens: int) -> None:
        leases.take()
        with leases.cuttable(lambda why, reason: (cuts.append(reason), leases.give_back()), lambda: tokens):
            await asyncio.sleep(0.05)

    running = [asyncio.ensure_future(request(n)) for n in (100, 250)]
    await asyncio.sleep(0)
    assert leases.tokens_in_flight() == 350 and leases.unresumable == 0
    await asyncio.wait_for(leases.preempt("room for chat"), 1)
    assert cuts == [PREEMPTED, PREEMPTED] and leases.count == 0
    await asyncio.gather(*running)
