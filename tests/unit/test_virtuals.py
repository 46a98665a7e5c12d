"""Which member of a virtual model a request goes to (`router.virtuals.pick`), driven with the
scheduler's fake engines and clock: each test is a moment a request for `chat` meets."""

from __future__ import annotations

from types import SimpleNamespace

from config.schema import ModelSpec
from config.virtual import VirtualModel
from engines.engine import State
from router.virtuals import pick, queue_wait_s
from tests.unit.test_scheduler import Clock, FakeEngine, awake, scheduler


def chat(how: str = "awake", *members: str) -> VirtualModel:
    return VirtualModel(name="chat", models=list(members) or ["a", "b", "c"], pick=how)


def held(engine: FakeEngine, in_flight: int, mean_s: float | None, max_num_seqs: int | None = None) -> FakeEngine:
    engine.in_flight = in_flight
    engine.leases = SimpleNamespace(mean_held_s=mean_s)
    if max_num_seqs is not None:
        engine.spec = engine.spec.model_copy(update={"args": [*engine.spec.args, "--max-num-seqs", str(max_num_seqs)]})
    return engine


def test_awake_picks_the_least_loaded_awake_member_and_the_first_of_equals():
    clock = Clock()
    a, b, c = held(awake("a", clock, share=0.3), 3, 1.0), held(awake("b", clock, share=0.3), 1, 1.0), FakeEngine("c", share=0.3)
    s = scheduler(a, b, c, clock=clock)
    assert pick(chat(), [a, b, c], s) is b
    b.in_flight = 3
    assert pick(chat(), [a, b, c], s) is a


def test_with_none_awake_awake_picks_the_member_with_the_shortest_predicted_wait():
    clock = Clock()
    a, b = FakeEngine("a", share=0.5), FakeEngine("b", share=0.5)
    s = scheduler(a, b, clock=clock)
    s.costs.observe_wake("a", 2, 30.0)
    s.costs.observe_wake("b", 2, 4.0)
    assert s.predicted_wait(b, clock.now) < s.predicted_wait(a, clock.now)
    assert pick(chat("awake", "a", "b"), [a, b], s) is b
    assert pick(chat("first", "a", "b"), [a, b], s) is a, "first wakes the operator's first, however slow"


def test_a_member_that_can_never_be_placed_or_has_failed_is_passed_over():
    clock = Clock()
    big = FakeEngine("big", share=0.6)
    pinned = awake("pinned", clock, share=0.5, pin=True)  # big never fits beside it
    slow = FakeEngine("slow", share=0.3)
    s = scheduler(big, pinned, slow, clock=clock)
    s.costs.observe_wake("slow", 2, 60.0)
    assert pick(chat("awake", "big", "slow"), [big, slow], s) is slow
    slow.state = State.FAILED
    assert pick(chat("awake", "big", "slow"), [big, slow], s) is big, "none can be served: the first says why in its 503"


def test_balance_wakes_another_member_only_when_the_queue_on_the_awake_one_is_the_longer_wait():
    clock = Clock()
    a, b = held(awake("a", clock, share=0.3), 0, 5.0, max_num_seqs=2), FakeEngine("b", share=0.3)
    s = scheduler(a, b, clock=clock)
    s.costs.observe_wake("b", 2, 3.0)
    balance = chat("balance", "a", "b")
    assert pick(balance, [a, b], s) is a
    a.in_flight = 1
    assert queue_wait_s(a) == 0 and pick(balance, [a, b], s) is a, "a free sequence slot waits for nobody"
    a.in_flight = 2
    assert queue_wait_s(a) == 2.5 and pick(balance, [a, b], s) is a, "half a request's time behind: shorter than b's 3 s wake"
    a.in_flight = 3
    assert queue_wait_s(a) == 5.0 and pick(balance, [a, b], s) is b
    assert pick(chat("awake", "a", "b"), [a, b], s) is a, "awake never wakes while a member is awake"


def test_a_command_engines_queue_is_sized_by_the_max_num_seqs_in_its_command():
    a = held(FakeEngine("a"), 3, 5.0)
    a.spec = ModelSpec(name="a", command=["my-vllm", "--port", "{port}", "--max-num-seqs", "2"], args=["--max-num-seqs", "64"])
    assert queue_wait_s(a) == 5.0, "two requests past its 2 sequences, served 2 at a time at 5 s each"


def test_balance_wakes_nobody_before_it_has_measured_how_long_a_request_holds_the_engine():
    clock = Clock()
    a, b = held(awake("a", clock, share=0.3), 50, None, max_num_seqs=1), FakeEngine("b", share=0.3)
    s = scheduler(a, b, clock=clock)
    assert pick(chat("balance", "a", "b"), [a, b], s) is a


def test_a_busy_member_is_not_an_awake_one():
    clock = Clock()
    a, b = awake("a", clock, share=0.3), awake("b", clock, share=0.3)
    s = scheduler(a, b, clock=clock)
    s.busy["a"] = None  # an action (a park, say) is under way on it
    assert pick(chat("first", "a", "b"), [a, b], s) is b
    assert a.state is State.AWAKE


async def test_two_streams_routed_in_one_turn_of_the_loop_go_to_different_members():
    # A stream waits for its lease in a task of its own (router.proxy.keepalive), which runs a turn later: the
    # lease is taken at once, before the next request is routed, or both would see the same member idle.
    clock = Clock()
    a, b, parked = awake("a", clock, share=0.3), awake("b", clock, share=0.3), FakeEngine("c", share=0.3)
    s = scheduler(a, b, parked, clock=clock)
    first = pick(chat("balance", "a", "b"), [a, b], s)
    assert s.lease_at_once(first) is not None and first.in_flight == 1
    second = pick(chat("balance", "a", "b"), [a, b], s)
    assert second is not first
    assert s.lease_at_once(parked) is None and s.demand.rate("c", clock.now) == 0, "a parked engine's request is acquired, and counted, there"
