"""The KV tier (level 0, engines/waking/ladder.py) in the scheduler's decisions, as scenarios: which rung a
victim goes to, what placement counts for a KV-parked engine, and when one is parked further down.
The harness (fake engines, fake clock, `decide`) is tests/unit/test_scheduler.py's."""

from __future__ import annotations

import pytest

from engines import waking
from engines.engine import State
from router.scheduling.placement import Ledger
from tests.unit.test_scheduler import FakeEngine, actions, awake, clock, scheduler, wait_for  # noqa: F401 (clock: a fixture)

GPU = {0: 80.0}  # 1 GB is 0.0125 of it


def finish(s, *engines: FakeEngine) -> None:
    """The started actions ended (the loop's _done, without the loop)."""
    for e in engines:
        s.busy.pop(e.name, None)
        s.doing.pop(e.name, None)
        s.parking_level.pop(e.name, None)
    s.making_room.clear()


def test_a_kv_parked_engine_is_counted_at_its_weights_and_residual_on_each_of_its_devices(clock):
    one = FakeEngine("one", share=0.5, level=0, weights_gb=8, sleep_residual_gb=1)
    two = FakeEngine("two", share=0.5, level=0, weights_gb=16, sleep_residual_gb=1, devices=[0, 1])
    asleep = FakeEngine("asleep", share=0.5, level=2, weights_gb=8, sleep_residual_gb=1)
    ledger = Ledger([one, two, asleep], scheduler(clock=clock, gpus={0: 80.0, 1: 80.0}).capacity)
    assert ledger.held(one) == {0: pytest.approx(0.1 + 0.0125)}, "its weights (8 of 80 GB) stay, and its residual"
    assert ledger.held(two) == {0: pytest.approx(0.1125), 1: pytest.approx(0.1125)}, "16 GB over two devices: 8 on each"
    assert ledger.held(asleep) == {0: pytest.approx(0.0125)}, "Level 2 keeps only the residual"
    assert ledger.deepened_frees(one) == {0: pytest.approx(0.1)}, "going down a rung frees the weights"


def test_a_kv_parked_engine_whose_weights_are_unknown_is_counted_at_its_whole_share(clock):
    fixed = FakeEngine("fixed", share=0.5, level=0, sleep_level=0)
    ledger = Ledger([fixed], scheduler(clock=clock, gpus=GPU).capacity)
    assert ledger.held(fixed) == {0: 0.5} and not ledger.kv_offered(fixed)


async def test_a_small_models_kv_is_parked_for_a_burst_of_another_and_it_comes_back_without_a_weight_copy(clock):
    small = awake("small", clock, share=0.5, weights_gb=8, sleep_residual_gb=1)
    burst = FakeEngine("burst", share=0.6, sleep_residual_gb=1)
    s = scheduler(small, burst, clock=clock, gpus=GPU)
    s.costs.observe_wake("small", 2, 20.0)
    s.costs.observe_wake("small", 0, 0.3)
    s.demand.arrived("small", clock.now - 1)
    wait_for(s, burst, clock.now)
    plan = s.decide(clock.now)
    assert [(d.action, d.engine.name, d.level) for d in plan.decisions] == [("park", "small", 0)], \
        "releasing small's KV cache (0.39 of the GPU) makes the 0.1 burst needs, for a 0.3 s wake instead of 20 s"
    small.state, small.sleep_level = State.SLEEPING, 0
    finish(s, small)
    assert actions(s.decide(clock.now)) == [("wake", "burst")], "small's weights (0.11 with its residual) leave room"
    burst.state, burst.since, burst.sleep_level = State.AWAKE, clock.now, None
    finish(s, burst)
    s.waiting["burst"].clear()
    burst.in_flight = 0
    clock.now += 60  # the burst is over
    wait_for(s, small, clock.now)
    assert actions(s.decide(clock.now)) == [("park", "burst")]
    burst.state, burst.sleep_level = State.SLEEPING, 2
    finish(s, burst)
    assert actions(s.decide(clock.now)) == [("wake", "small")]
    assert waking.phases(small.sleep_level, "none") == ["wake_kv_cache", "reset_prefix_cache"], "no weights step: a KV re-allocation"
    assert s.predicted_wait(small, clock.now) == pytest.approx(0.3)


async def test_a_kv_park_that_does_not_free_enough_is_passed_over_for_a_full_park(clock):
    small = awake("small", clock, share=0.5, weights_gb=24, sleep_residual_gb=1)  # 0.3 of the GPU is weights
    burst = FakeEngine("burst", share=0.75, sleep_residual_gb=1)
    s = scheduler(small, burst, clock=clock, gpus=GPU)
    s.costs.observe_wake("small", 0, 0.3)
    wait_for(s, burst, clock.now)
    (decision,) = s.decide(clock.now).decisions
    assert (decision.action, decision.engine.name) == ("park", "small") and decision.level == 2, \
        "its KV cache frees 0.19, the burst needs 0.26: only the weights leaving too make the room"


async def test_a_model_whose_weights_are_unknown_is_not_offered_the_kv_tier(clock):
    small = awake("small", clock, share=0.5, sleep_residual_gb=1)
    burst = FakeEngine("burst", share=0.6, sleep_residual_gb=1)
    s = scheduler(small, burst, clock=clock, gpus=GPU)
    s.costs.observe_wake("small", 0, 0.3)
    wait_for(s, burst, clock.now)
    (decision,) = s.decide(clock.now).decisions
    assert decision.level == 2, "what a KV park would keep is unknown: it cannot be planned"


async def test_a_kv_parked_engine_is_parked_further_when_the_room_it_keeps_is_needed(clock):
    popular = awake("popular", clock, share=0.3, sleep_residual_gb=1)
    small = FakeEngine("small", share=0.5, level=0, weights_gb=8, sleep_residual_gb=1)
    big = FakeEngine("big", share=0.65, sleep_residual_gb=1)
    s = scheduler(popular, small, big, clock=clock, gpus=GPU, estimates={"small": 10.8})
    for _ in range(30):
        s.demand.arrived("popular", clock.now - 1)
    s.demand.arrived("small", clock.now - 100)
    s.costs.observe_boot("small", 40.0)
    s.costs.observe_wake("small", 0, 0.3)
    s.costs.observe_wake("small", 1, 2.0)
    s.costs.observe_wake("popular", 1, 2.0)
    wait_for(s, big, clock.now)
    plan = s.decide(clock.now)
    assert [(d.action, d.engine.name, d.level) for d in plan.decisions] == [("deepen", "small", 1)], \
        "big lacks 0.06; small's weights (0.1) going to host RAM cost a 2 s wake instead of 0.3 s, " \
        "less than parking the popular engine or stopping small (a 40 s boot)"
    small.sleep_level = 1
    finish(s, small)
    assert actions(s.decide(clock.now)) == [("wake", "big")]


async def test_a_fixed_level_0_engine_is_kv_parked_and_stopped_when_its_weights_room_is_needed(clock):
    small = awake("small", clock, share=0.5, weights_gb=8, sleep_residual_gb=1, sleep_level=0)
    big = FakeEngine("big", share=0.6, sleep_residual_gb=1)
    s = scheduler(small, big, clock=clock, gpus=GPU)
    wait_for(s, big, clock.now)
    (decision,) = s.decide(clock.now).decisions
    assert (decision.action, decision.level) == ("park", 0)
    small.state, small.sleep_level = State.SLEEPING, 0
    finish(s, small)
    s.waiting["big"].clear()
    huge = FakeEngine("huge", share=0.95, sleep_residual_gb=1)
    s = scheduler(small, huge, clock=clock, gpus=GPU)
    wait_for(s, huge, clock.now)
    assert actions(s.decide(clock.now)) == [("stop", "small")], "sleep_level: 0 never goes down a rung: it is stopped"


async def test_before_any_wake_is_measured_a_kv_park_is_priced_at_the_gate_its_boot_ran(clock):
    small = awake("small", clock, share=0.5, weights_gb=8, sleep_residual_gb=1)
    burst = FakeEngine("burst", share=0.6, sleep_residual_gb=1)
    s = scheduler(small, burst, clock=clock, gpus=GPU)
    s.costs.observe_boot("small", 30.0, gate_s=1.5)
    s.demand.arrived("small", clock.now - 1)
    assert s.costs.wake_s("small", 0) == 1.5 and s.costs.wake_s("small", 2) == 30.0
    assert s.expected_cost(small, "kv_park", clock.now) < s.expected_cost(small, "park", clock.now)
    small.state, small.sleep_level = State.SLEEPING, 0
    assert s.expected_cost(small, "deepen", clock.now) > 0, "going down a rung is priced at what it adds to the next wake"


async def test_a_fixed_level_0_engine_whose_kv_park_cannot_be_sized_is_stopped_to_make_room(clock):
    small = awake("small", clock, share=0.5, sleep_residual_gb=1, sleep_level=0)  # weights unknown
    big = FakeEngine("big", share=0.6, sleep_residual_gb=1)
    s = scheduler(small, big, clock=clock, gpus=GPU)
    s.costs.observe_boot("small", 20.0)
    s.demand.arrived("small", clock.now - 1)
    wait_for(s, big, clock.now)
    assert actions(s.decide(clock.now)) == [("stop", "small")], "what a KV park would free is unknown: not a wait for ever"
    assert s.expected_cost(small, "stop", clock.now) > 0.01, "an awake engine's stop costs its whole boot"


async def test_two_kv_parked_engines_sent_down_in_one_round_do_not_both_take_the_host_ram_for_one_copy(clock):
    """As the simulation found it: each was offered Level 1 for the host RAM as it was, before the other's move."""
    one = FakeEngine("one", share=0.4, level=0, weights_gb=8, sleep_residual_gb=1)
    two = FakeEngine("two", share=0.4, level=0, weights_gb=8, sleep_residual_gb=1)
    big = FakeEngine("big", share=0.95, sleep_residual_gb=0)
    s = scheduler(one, two, big, clock=clock, gpus=GPU, ram_gb=12, estimates={"one": 10.8, "two": 10.8})
    for name in ("one", "two"):
        s.costs.observe_boot(name, 40.0)
        s.costs.observe_wake(name, 0, 0.3)
        s.costs.observe_wake(name, 1, 2.0)
    wait_for(s, big, clock.now)
    plan = s.decide(clock.now)
    assert sorted((d.action, d.level) for d in plan.decisions) == [("deepen", 1), ("deepen", 2)], \
        "host RAM for one 10.8 GB copy: one goes to Level 1, the other to Level 2"
