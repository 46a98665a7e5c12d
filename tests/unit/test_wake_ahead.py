"""Waking ahead of demand (router.scheduling.ahead), driven through `decide` with fake engines and a
fake clock, as the scheduler's other scenarios are (tests/unit/test_scheduler.py)."""

from __future__ import annotations

from engines.engine import State
from tests.unit.test_scheduler import FakeEngine, actions, awake, clock, scheduler, wait_for  # noqa: F401 (clock: a fixture)


class Heard:
    """The events the scheduler reports."""

    def __init__(self) -> None:
        self.ahead: list[tuple[str, str]] = []

    def woke_ahead(self, engine, outcome: str) -> None:
        self.ahead.append((engine.name, outcome))

    def swap_done(self, record) -> None: ...

    def evicted(self, engine, reason: str) -> None: ...


def asked(s, name: str, times: int, at: float) -> None:
    for _ in range(times):
        s.demand.arrived(name, at)


def priced(s, *names: str, wake_s: float = 5.0, sleep_s: float = 0.3) -> None:
    for name in names:
        s.costs.observe_wake(name, 2, wake_s)
        s.costs.observe_sleep(name, sleep_s)


async def test_room_nobody_waits_for_goes_to_the_sleeper_most_likely_to_be_asked_for_next(clock):
    a = awake("a", clock, share=0.3)
    popular, rare = FakeEngine("popular", share=0.3), FakeEngine("rare", share=0.3)
    s = scheduler(a, popular, rare, clock=clock, gpus={0: 100.0})
    s.events = heard = Heard()
    priced(s, "popular", "rare")
    asked(s, "popular", 20, clock.now - 5)
    asked(s, "rare", 1, clock.now - 200)
    plan = s.decide(clock.now)
    assert actions(plan) == [("wake", "popular")], "one pre-wake at a time, the likeliest first"
    assert plan.decisions[0].why.startswith("ahead of demand: ")
    assert heard.ahead == [("popular", "woken")]
    assert s.ahead["popular"].level == 2


async def test_nothing_is_woken_ahead_where_a_waiter_needs_the_room(clock):
    busy = awake("busy", clock, share=0.5)
    busy.in_flight = 1
    waited, popular = FakeEngine("waited", share=0.6), FakeEngine("popular", share=0.3)
    s = scheduler(busy, waited, popular, clock=clock, gpus={0: 100.0})
    priced(s, "popular", "waited")
    asked(s, "popular", 20, clock.now - 5)
    wait_for(s, waited, clock.now - 1)
    assert actions(s.decide(clock.now)) == [], "waited's room is being waited for (busy holds it until max_hold_s)"


async def test_a_model_nobody_asked_for_is_not_woken_ahead_nor_one_whose_unused_wake_costs_more_than_it_saves(clock):
    never, seldom = FakeEngine("never", share=0.3), FakeEngine("seldom", share=0.3)
    s = scheduler(never, seldom, clock=clock, gpus={0: 100.0})
    priced(s, "never")
    priced(s, "seldom", wake_s=1.0, sleep_s=4.0)
    asked(s, "seldom", 1, clock.now - 250)  # about 15% likely within the 60 s horizon
    assert actions(s.decide(clock.now)) == [], "no demand: no guess; a 1 s wake saved is not worth a 4 s sleep wasted"


async def test_an_idle_engine_nobody_asked_for_lately_is_parked_for_a_likely_one_and_one_with_demand_never(clock):
    rare = awake("rare", clock, share=0.6)
    rare.last_used = clock.now - 100
    popular = FakeEngine("popular", share=0.6)
    s = scheduler(rare, popular, clock=clock, gpus={0: 100.0})
    priced(s, "rare", "popular", wake_s=10.0)
    asked(s, "popular", 20, clock.now - 5)
    asked(s, "rare", 1, clock.now - 280)
    rare.in_flight = 1
    assert actions(s.decide(clock.now)) == [], "rare is serving: nothing is cut for a guess"
    rare.in_flight = 0
    s.demand.arrived("rare", clock.now - 30)
    assert actions(s.decide(clock.now)) == [], "rare was asked for 30 s ago, within the 60 s horizon: it has demand"
    s.demand = type(s.demand)(s.demand.tau_s)
    asked(s, "popular", 20, clock.now - 5)
    asked(s, "rare", 1, clock.now - 280)
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "rare")] and "ahead of demand" in plan.decisions[0].why
    s.busy.clear(), s.doing.clear()
    rare.state, rare.sleep_level = State.SLEEPING, 2
    assert actions(s.decide(clock.now)) == [("wake", "popular")], "its room made, popular wakes"


async def test_a_pre_woken_engine_nobody_used_goes_back_to_level2_at_once_for_a_waiter_and_counts_as_unused(clock):
    popular, other = FakeEngine("popular", share=0.6), FakeEngine("other", share=0.6)
    s = scheduler(popular, other, clock=clock, gpus={0: 100.0})
    s.events = heard = Heard()
    priced(s, "popular", "other")
    asked(s, "popular", 20, clock.now - 5)
    assert actions(s.decide(clock.now)) == [("wake", "popular")]
    s.busy.clear(), s.doing.clear()
    popular.state, popular.since, popular.sleep_level = State.AWAKE, clock.now, None  # woken, unused since
    clock.now += 1  # well inside min_active_s: an unclaimed wake is not protected by it
    wait_for(s, other, clock.now)
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "popular")] and plan.decisions[0].level == 2, "dropped again, as it was"
    s.busy.clear(), s.doing.clear()
    popular.state, popular.sleep_level = State.SLEEPING, 2
    s.decide(clock.now)
    assert heard.ahead == [("popular", "woken"), ("popular", "unused")]
    assert [w.outcome for w in s.ahead_done] == ["unused"]


async def test_a_pre_woken_engine_that_served_a_request_counts_as_used(clock):
    popular = FakeEngine("popular", share=0.6)
    s = scheduler(popular, clock=clock, gpus={0: 100.0})
    s.events = heard = Heard()
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 5)
    s.decide(clock.now)
    s.busy.clear(), s.doing.clear()
    popular.state, popular.since = State.AWAKE, clock.now
    clock.now += 3
    popular.last_used = clock.now
    s.decide(clock.now)
    assert heard.ahead == [("popular", "woken"), ("popular", "used")]


async def test_wake_ahead_off_wakes_nothing_nobody_asked_for(clock):
    popular = FakeEngine("popular", share=0.3)
    s = scheduler(popular, clock=clock, gpus={0: 100.0}, wake_ahead=False)
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 5)
    assert actions(s.decide(clock.now)) == []


async def test_a_model_an_operator_put_to_sleep_is_not_woken_ahead_until_a_request_asks_for_it(clock):
    popular = FakeEngine("popular", share=0.3)
    s = scheduler(popular, clock=clock, gpus={0: 100.0})
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 5)
    s.put_to_sleep.add("popular")  # what /admin/sleep leaves
    assert actions(s.decide(clock.now)) == [], "the operator wants it asleep"
    s.put_to_sleep.discard("popular")  # what a request for it does (acquire)
    assert actions(s.decide(clock.now)) == [("wake", "popular")]


async def test_an_operator_who_asks_a_sleeping_model_to_sleep_keeps_it_asleep(clock):
    popular = FakeEngine("popular", share=0.3)
    s = scheduler(popular, clock=clock, gpus={0: 100.0})
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 5)
    assert await s.sleep(popular) == "not awake (sleeping)"
    assert actions(s.decide(clock.now)) == [], "asleep already, it stays asleep: nothing wakes it ahead"


def run(s, clock, seconds: float, step: float = 1.0) -> list[tuple[str, str]]:
    """The loop's decisions over `seconds` of the fake clock, each action done at once; what was started."""
    started = []
    for _ in range(int(seconds / step)):
        for decision in s.decide(clock.now).decisions:
            engine = decision.engine
            started.append((decision.action, engine.name))
            if decision.action == "wake":
                engine.state, engine.since, engine.sleep_level = State.AWAKE, clock.now, None
            elif decision.action == "park":
                engine.state, engine.since, engine.sleep_level = State.SLEEPING, clock.now, decision.level or 2
        clock.now += step
    return started


async def test_a_parked_group_rival_is_never_woken_ahead_beside_the_awake_one(clock):
    amber, birch = awake("amber", clock, share=0.3, group="g"), FakeEngine("birch", share=0.3, group="g")
    s = scheduler(amber, birch, clock=clock, gpus={0: 100.0})
    priced(s, "amber", "birch")
    asked(s, "birch", 20, clock.now - 5)
    assert actions(s.decide(clock.now)) == [], "the memory fits, but a group is exclusive"


async def test_wake_ahead_parks_nothing_to_make_room_for_a_rival_of_an_awake_engine(clock):
    amber, birch = awake("amber", clock, share=0.3, group="g"), FakeEngine("birch", share=0.6, group="g")
    idle = awake("idle", clock, share=0.6)
    idle.last_used = clock.now - 100
    s = scheduler(amber, birch, idle, clock=clock, gpus={0: 100.0})
    priced(s, "amber", "birch", "idle", wake_s=10.0)
    asked(s, "birch", 20, clock.now - 5)
    assert actions(s.decide(clock.now)) == [], "idle's room would only wake birch beside amber"


async def test_nothing_is_woken_ahead_beside_a_group_rival_on_its_way_to_a_waiter_on_another_gpu(clock):
    amber = FakeEngine("amber", share=0.6, group="g", devices=[1])
    birch = FakeEngine("birch", share=0.3, group="g", devices=[0])
    s = scheduler(amber, birch, clock=clock, gpus={0: 100.0, 1: 100.0})
    priced(s, "amber", "birch")
    asked(s, "birch", 20, clock.now - 5)
    wait_for(s, amber, clock.now)
    assert actions(s.decide(clock.now)) == [("wake", "amber")], "amber wakes for its waiter; birch, its rival, stays parked"


async def test_an_engine_parked_for_idleness_is_not_woken_ahead_before_a_request_asks_for_it_again(clock):
    popular = awake("popular", clock, share=0.6)
    s = scheduler(popular, clock=clock, gpus={0: 100.0}, idle_sleep_s=10)
    s.events = heard = Heard()
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 15)
    popular.last_used = clock.now - 15
    assert run(s, clock, 60) == [("park", "popular")], "parked once for idleness, and left parked"
    assert heard.ahead == []
    s.demand.arrived("popular", clock.now)  # a request after the park: demand again (served, say, by a peer)
    assert actions(s.decide(clock.now)) == [("wake", "popular")]


async def test_with_no_requests_an_engine_is_woken_ahead_once_not_woken_and_parked_in_a_cycle(clock):
    popular = FakeEngine("popular", share=0.6)
    s = scheduler(popular, clock=clock, gpus={0: 100.0}, idle_sleep_s=10)
    s.events = heard = Heard()
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 5)
    assert run(s, clock, 60) == [("wake", "popular"), ("park", "popular")], "one guess, given back unused, not repeated"
    assert heard.ahead == [("popular", "woken"), ("popular", "unused")]


async def test_wake_ahead_does_not_park_a_model_with_interactive_demand(clock):
    chat, popular = awake("chat", clock, share=0.6), FakeEngine("popular", share=0.6)
    s = scheduler(chat, popular, clock=clock, gpus={0: 100.0}, interactive_hold_s=300)
    priced(s, "chat", "popular", wake_s=10.0)
    asked(s, "popular", 20, clock.now - 5)
    asked(s, "chat", 1, clock.now - 110)
    chat.last_used = s.interactive_seen["chat"] = clock.now - 100  # a user's request, ended 100 s ago
    assert s.interactive_demand(chat, clock.now)[0] is not None
    assert actions(s.decide(clock.now)) == [], "within swap.interactive_hold_s the user's model keeps its room"


async def test_a_request_longer_than_the_reuse_horizon_is_still_demand_for_wake_ahead(clock):
    chat, popular = awake("chat", clock, share=0.6), FakeEngine("popular", share=0.6)
    s = scheduler(chat, popular, clock=clock, gpus={0: 100.0}, interactive_hold_s=0)
    priced(s, "chat", "popular", wake_s=10.0)
    asked(s, "popular", 20, clock.now - 5)
    asked(s, "chat", 1, clock.now - 70)  # beyond the 60 s horizon when it arrived ...
    chat.last_used = clock.now - 1  # ... and it ended a second ago
    assert actions(s.decide(clock.now)) == [], "chat was used a second ago"
    clock.now += 60
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "chat")] and "ahead of demand" in plan.decisions[0].why, "unused for the horizon: fair game"


async def test_a_pre_woken_engine_that_was_used_parks_at_the_level_any_park_would_choose(clock):
    popular, other = FakeEngine("popular", share=0.6), FakeEngine("other", share=0.6)
    # No GPU sizes: no KV park is offered, so the park is a full one and its level the question.
    s = scheduler(popular, other, clock=clock, estimates={"popular": 1.0, "other": 1.0})
    s.events = heard = Heard()
    priced(s, "popular", "other")
    asked(s, "popular", 20, clock.now - 5)
    assert actions(s.decide(clock.now)) == [("wake", "popular")]
    popular.state, popular.since, popular.sleep_level = State.AWAKE, clock.now, None
    clock.now += 3
    popular.last_used = clock.now  # it served a request: the guess paid
    clock.now += 10  # past min_active_s
    wait_for(s, other, clock.now)
    plan = s.decide(clock.now)
    assert actions(plan) == [("park", "popular")] and plan.decisions[0].level == 1, "host RAM has room for level 1"
    assert heard.ahead == [("popular", "woken"), ("popular", "used")]


async def test_a_pre_woken_engine_still_serving_its_first_request_counts_as_used(clock):
    popular = FakeEngine("popular", share=0.6)
    s = scheduler(popular, clock=clock, estimates={"popular": 1.0})
    s.events = heard = Heard()
    priced(s, "popular")
    asked(s, "popular", 20, clock.now - 5)
    s.decide(clock.now)
    popular.state, popular.since, popular.sleep_level = State.AWAKE, clock.now, None
    popular.in_flight = 1  # a long stream, begun on the pre-woken engine
    s.decide(clock.now + 1)
    assert heard.ahead == [("popular", "woken"), ("popular", "used")]
    assert s.ahead_level(popular) is None, "were it parked now, its level is chosen as for any park"
