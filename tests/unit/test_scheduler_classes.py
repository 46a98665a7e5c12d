"""Request classes in the scheduler's policy (issue 33, part 2): a batch request never parks,
stops or preempts an engine with interactive demand (in flight, queued, or seen within
swap.interactive_hold_s, or more likely than not to be asked for by a user before the batch wake would
end), a target only batch waits for ranks after interactive ones, and an
awake engine's waiters are granted interactive first. Fake engines, a fake clock, `decide`."""

from __future__ import annotations

import asyncio
import math

import pytest

from config.schema import Queue, Swap
from engines.engine import State
from router.errors import APIError
from router.scheduling import Capacity, Plan, Scheduler
from router.scheduling.state import BATCH, INTERACTIVE
from tests.unit.test_scheduler import Clock, FakeEngine, actions, awake, popular_beside, measured, wait_for


@pytest.fixture
def clock() -> Clock:
    return Clock()


def scheduler(*engines: FakeEngine, clock: Clock, hold_s: float = 60, queue: Queue = Queue()) -> Scheduler:
    swap = Swap(min_active_s=5, max_hold_s=30, interactive_hold_s=hold_s)
    return Scheduler(list(engines), swap, queue, Capacity(None, 100), clock=clock)


async def test_batch_does_not_park_an_engine_an_interactive_request_used_within_the_hold(clock):
    chat, nightly = awake("chat", clock), FakeEngine("nightly")
    s = scheduler(chat, nightly, clock=clock, hold_s=60)
    s.interactive_seen["chat"] = clock.now - 10
    wait_for(s, nightly, clock.now - 100, BATCH)  # long past max_hold_s: that forces nothing for batch
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(50)), "look again when chat's hold ends"
    assert "chat" in s.held_by["nightly"] and "interactive_hold_s=60" in s.held_by["nightly"]
    clock.now += 50
    assert actions(s.decide(clock.now)) == [("park", "chat")], "idle for the whole hold: batch may take its room"


async def test_batch_does_not_wake_into_room_a_user_is_likely_to_want_before_the_wake_ends(clock):
    """A model asked for by users every few seconds, idle past interactive_hold_s: a batch model's 30 s wake would
    make its next user wait out that wake and its own, only to preempt the batch work at once (the cycle seen on
    the trace bench). The batch wake waits until the users' rate says they have gone quiet."""
    chat, nightly = awake("chat", clock), FakeEngine("nightly", level=2)
    s = scheduler(chat, nightly, clock=clock, hold_s=60)
    s.costs.observe_wake("nightly", 2, 30.0)
    for ago in range(70, 370, 5):  # a user every 5 s for five minutes, the last 70 s ago
        s.user_demand.arrived("chat", clock.now - ago)
    s.interactive_seen["chat"] = clock.now - 70
    wait_for(s, nightly, clock.now - 100, BATCH)
    plan = s.decide(clock.now)
    expected = s.user_demand.rate("chat", clock.now) * 30.0
    assert expected > 0.7 and plan == Plan(wait_s=pytest.approx(300 * math.log(expected / math.log(2)))), \
        "look again when chat's users are no longer likely within the wake"
    assert "'chat' is" in s.held_by["nightly"] and "likely to be asked for by a user within the 30.0 s wake" \
        in s.held_by["nightly"]
    clock.now += plan.wait_s + 0.01
    assert actions(s.decide(clock.now)) == [("park", "chat")], "its users have gone quiet: batch may take the room"


async def test_batch_traffic_alone_is_no_user_to_keep_room_for(clock):
    evals, nightly = awake("evals", clock), FakeEngine("nightly")
    s = scheduler(evals, nightly, clock=clock, hold_s=0)
    s.costs.observe_wake("nightly", 2, 30.0)
    for ago in range(1, 100):
        s.demand.arrived("evals", clock.now - ago)  # batch requests: demand, not users'
    wait_for(s, nightly, clock.now, BATCH)
    assert actions(s.decide(clock.now)) == [("park", "evals")]


async def test_interactive_requests_in_flight_hold_the_room_however_long_batch_waited(clock):
    chat, nightly = awake("chat", clock), FakeEngine("nightly")
    s = scheduler(chat, nightly, clock=clock, hold_s=0)
    chat.in_flight = 1
    s.interactive_leases["chat"] = 1
    wait_for(s, nightly, clock.now - 1000, BATCH)
    assert s.decide(clock.now) == Plan(), "nothing to do until the interactive request ends (its release pokes)"
    assert "1 interactive request(s) in flight" in s.held_by["nightly"]
    s.release(chat, INTERACTIVE)  # hold_s 0: the end of the last interactive request frees the room
    assert actions(s.decide(clock.now)) == [("park", "chat")]


async def test_batch_does_not_preempt_a_wake_interactive_requests_wait_for(clock):
    chat, nightly = FakeEngine("chat", share=0.6), FakeEngine("nightly", share=0.6)
    s = scheduler(chat, nightly, clock=clock, hold_s=0)
    wait_for(s, chat, clock.now - 1, INTERACTIVE)
    wait_for(s, nightly, clock.now - 5, BATCH)  # older, but batch
    assert actions(s.decide(clock.now)) == [("wake", "chat")], "the interactive target ranks first"
    chat.state, chat.since = State.WAKING, clock.now  # as _start and the action would have it
    s.busy["chat"], s.doing["chat"] = asyncio.get_running_loop().create_future(), ("wake", clock.now, 10.0)
    assert s.decide(clock.now + 100) == Plan(), "chat is waking for interactive waiters: not offered as batch's victim"


async def test_batch_may_stop_a_sleeper_without_interactive_demand_but_not_one_with_it(clock):
    gpus = {0: 80.0}
    old = FakeEngine("old", share=0.2, sleep_residual_gb=40)
    recent = FakeEngine("recent", share=0.2, sleep_residual_gb=40)
    nightly = FakeEngine("nightly", share=0.3, sleep_residual_gb=8)
    s = Scheduler([old, recent, nightly], Swap(interactive_hold_s=60), Queue(), Capacity(gpus, 100), clock=clock)
    s.interactive_seen["recent"] = clock.now - 1
    wait_for(s, nightly, clock.now, BATCH)
    assert actions(s.decide(clock.now)) == [("stop", "old")]


async def test_a_mixed_queue_is_interactive_demand_and_takes_room_as_usual(clock):
    chat, nightly = awake("chat", clock), FakeEngine("nightly")
    s = scheduler(chat, nightly, clock=clock, hold_s=60)
    s.interactive_seen["chat"] = clock.now - 1
    wait_for(s, nightly, clock.now, BATCH)
    wait_for(s, nightly, clock.now, INTERACTIVE)  # someone interactive wants nightly too
    assert actions(s.decide(clock.now)) == [("park", "chat")], "interactive against interactive: the usual rules"


async def test_batch_takes_room_from_an_engine_only_batch_used(clock):
    evals, nightly = awake("evals", clock), FakeEngine("nightly")
    s = scheduler(evals, nightly, clock=clock, hold_s=60)
    s.demand.arrived("evals", clock.now - 1)  # batch traffic: no interactive_seen
    wait_for(s, nightly, clock.now, BATCH)
    assert actions(s.decide(clock.now)) == [("park", "evals")]


async def test_a_batch_only_target_ranks_after_interactive_ones_however_old(clock):
    a, b, c = awake("a", clock), FakeEngine("b"), FakeEngine("c")
    s = scheduler(a, b, c, clock=clock)
    wait_for(s, b, clock.now - 500, BATCH)
    wait_for(s, c, clock.now - 1, INTERACTIVE)
    assert [e.name for e, _ in s._targets(clock.now, set())] == ["c", "b"]


async def test_a_group_rival_with_interactive_demand_blocks_a_batch_target(clock):
    chat, nightly = awake("chat", clock, share=0.2, group="g"), FakeEngine("nightly", share=0.2, group="g")
    s = scheduler(chat, nightly, clock=clock, hold_s=60)
    s.interactive_seen["chat"] = clock.now - 20
    wait_for(s, nightly, clock.now, BATCH)
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(40)), "room fits, but the group is chat's while it is used"


async def test_an_awake_engine_grants_its_interactive_waiters_before_its_batch_ones(clock):
    chat = awake("chat", clock)
    s = scheduler(chat, clock=clock)
    order: list[str] = []
    waiters = [wait_for(s, chat, clock.now - 3, BATCH), wait_for(s, chat, clock.now - 2, INTERACTIVE),
               wait_for(s, chat, clock.now - 1, BATCH), wait_for(s, chat, clock.now, INTERACTIVE)]
    for i, w in enumerate(waiters):
        w.future.add_done_callback(lambda _, i=i: order.append(f"{waiters[i].klass}{i}"))
    s._grant(chat)
    await asyncio.sleep(0)  # the done callbacks run on the loop
    assert order == ["interactive1", "interactive3", "batch0", "batch2"]
    assert s.interactive_leases["chat"] == 2 and chat.in_flight == 4


async def test_acquire_counts_interactive_leases_and_batch_times_out_naming_the_holder(clock):
    chat, nightly = awake("chat", clock), FakeEngine("nightly")
    s = scheduler(chat, nightly, clock=clock, queue=Queue(max_wait_s=300, batch_max_wait_s=0.05))
    lease = await s.acquire(chat, klass=INTERACTIVE)
    assert lease.found_awake and s.interactive_leases["chat"] == 1 and s.interactive_seen["chat"] == clock.now
    s.decide(clock.now)  # nobody waits yet
    task = asyncio.ensure_future(s.acquire(nightly, klass=BATCH))
    await asyncio.sleep(0)
    assert s.queued_by_class(nightly) == {"interactive": 0, "batch": 1}
    s.decide(clock.now)
    with pytest.raises(APIError) as error:
        await task
    assert error.value.status == 503 and "queue.batch_max_wait_s=0.05" in error.value.message
    assert "'chat' has 1 interactive request(s) in flight" in error.value.message
    s.release(chat, INTERACTIVE)
    assert "chat" not in s.interactive_leases
    await s.acquire(chat, klass=BATCH)
    assert "chat" not in s.interactive_leases, "a batch lease is no interactive demand"


async def test_a_model_a_reload_added_boots_in_the_background_without_parking_the_model_a_user_just_used(clock):
    chat, added = awake("chat", clock), FakeEngine("added", State.COLD)
    s = scheduler(chat, added, clock=clock, hold_s=60)
    s.to_boot.add("added")  # new in a reload: nobody waits for it
    s.interactive_seen["chat"] = clock.now - 10
    assert s.decide(clock.now) == Plan(wait_s=pytest.approx(50)), "the boot waits for chat's interactive hold to end"
    clock.now += 50
    assert actions(s.decide(clock.now)) == [("park", "chat")], "idle for the whole hold: the boot may take its room"
async def test_a_batch_flood_that_fills_the_queue_leaves_room_in_it_for_an_interactive_request(clock):
    nightly = FakeEngine("nightly")
    s = scheduler(nightly, clock=clock, queue=Queue(max_waiting=3))
    flood = [asyncio.ensure_future(s.acquire(nightly, klass=BATCH)) for _ in range(3)]
    user = None
    try:
        await asyncio.sleep(0)  # each acquire runs up to its wait
        user = asyncio.ensure_future(s.acquire(nightly, klass=INTERACTIVE))
        await asyncio.sleep(0)
        assert not user.done(), "the user queues beside the flood instead of getting a 429"
        assert s.queued_by_class(nightly) == {"interactive": 1, "batch": 3}
        with pytest.raises(APIError) as error:
            await s.acquire(nightly, klass=BATCH)
        assert error.value.status == 429 and "has 3 batch requests waiting (queue.max_waiting, per class)" in \
            error.value.message
    finally:
        for task in [*flood, *([user] if user else [])]:
            task.cancel()
        await asyncio.gather(*flood, *([user] if user else []), return_exceptions=True)


def host_ram_short(clock: Clock, *, talked_to_s: float) -> tuple[Scheduler, FakeEngine]:
    """hot (awake, asked for often, worth Level 1) is parked for t, in its group; 20 GB of host RAM hold
    only one of hot's and recent's 16 GB copies; a user talked to recent `talked_to_s` ago."""
    recent = measured(FakeEngine("recent", share=0.3, level=1), 16, level1=16)
    recent.host.release_ok = True
    hot = awake("hot", clock, share=0.3, group="g")
    target = FakeEngine("t", share=0.3, group="g")
    s = Scheduler([recent, hot, target], Swap(min_active_s=5, max_hold_s=30, interactive_hold_s=60), Queue(),
                  Capacity({0: 100.0}, 20), weights={"hot": 16 / 1.35, "t": 1}, clock=clock)
    s.costs.observe_wake("hot", 1, 0.5)
    s.costs.observe_wake("hot", 2, 30.0)
    for _ in range(10):
        s.demand.arrived("hot", clock.now - 1)
    s.interactive_seen["recent"] = clock.now - talked_to_s
    return s, target


async def test_batch_work_never_demotes_a_sleeper_a_user_talked_to_seconds_ago_for_its_victims_host_ram(clock):
    s, target = host_ram_short(clock, talked_to_s=5)
    wait_for(s, target, clock.now, BATCH)
    plan = s.decide(clock.now)
    assert [(d.action, d.engine.name, d.level) for d in plan.decisions] == [("park", "hot", 2)], \
        "recent keeps its Level-1 copy: hot goes to Level 2 instead"
    s, target = host_ram_short(clock, talked_to_s=5)
    wait_for(s, target, clock.now, INTERACTIVE)
    assert actions(s.decide(clock.now)) == [("park", "hot"), ("demote", "recent")], "an interactive target may demote it"
    s, target = host_ram_short(clock, talked_to_s=61)
    wait_for(s, target, clock.now, BATCH)
    assert actions(s.decide(clock.now)) == [("park", "hot"), ("demote", "recent")], "past interactive_hold_s batch may too"


async def test_host_ram_over_budget_by_measurement_sends_down_a_sleeper_no_user_talked_to_first(clock):
    popular = measured(FakeEngine("popular", share=0.3, level=1), 12, level1=12)
    talked = measured(FakeEngine("talked", share=0.3, level=1), 10, level1=10)  # measured over its guess
    s = Scheduler([popular, talked, awake("a", clock, share=0.3)], Swap(interactive_hold_s=60, wake_ahead=False), Queue(),
                  Capacity({0: 100.0}, 20), clock=clock)
    popular_beside(s, talked, clock)
    s.interactive_seen["talked"] = clock.now - 5
    assert actions(s.decide(clock.now)) == [("demote", "popular")], \
        "talked is worth less, but a user talked to it 5 s ago: popular's copy clears the excess instead"


async def test_an_idle_park_never_demotes_a_sleeper_a_user_talked_to_seconds_ago_for_its_host_ram(clock):
    s, _ = host_ram_short(clock, talked_to_s=5)
    s.swap = s.swap.model_copy(update={"idle_sleep_s": 30.0})
    s.engines[1].last_used = clock.now - 40  # hot: idle past idle_sleep_s, nobody waits for anything
    plan = s.decide(clock.now)
    assert [(d.action, d.engine.name, d.level) for d in plan.decisions] == [("park", "hot", 2)], \
        "recent keeps its Level-1 copy: an idle park is nobody's demand, so hot goes to Level 2"
