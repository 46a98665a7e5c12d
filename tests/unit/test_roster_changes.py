"""What a reload asks of the scheduler, decided without engines: new models boot in the background
without cutting into requests, removed ones stop once idle, changed ones restart when idle."""

from __future__ import annotations

import pytest

from config.diff import diff, model_change, router_side
from config.schema import ModelSpec
from engines.engine import State
from tests.support import sim_roster
from tests.unit.test_scheduler import Clock, FakeEngine, actions, awake, scheduler, wait_for


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def test_a_new_model_boots_in_the_background_but_never_parks_a_busy_engine(clock):
    busy = awake("busy", clock, share=0.6)
    busy.in_flight = 2
    new = FakeEngine("new", State.COLD, share=0.6, level=None)
    s = scheduler(busy, clock=clock)
    s.add(new)
    clock.now += 3600  # however long it waits: it has no waiter whose patience runs out
    assert actions(s.decide(clock.now)) == []
    busy.in_flight = 0
    assert actions(s.decide(clock.now)) == [("park", "busy")]


async def test_a_new_model_that_fits_boots_at_once(clock):
    s = scheduler(awake("a", clock, share=0.3), clock=clock)
    s.add(FakeEngine("new", State.COLD, share=0.3, level=None))
    assert actions(s.decide(clock.now)) == [("wake", "new")]


async def test_a_removed_model_is_stopped_only_once_its_requests_and_waiters_are_done(clock):
    gone = awake("gone", clock, share=0.3)
    gone.in_flight = 1
    s = scheduler(gone, awake("kept", clock, share=0.3), clock=clock)
    s.retire(gone)
    assert actions(s.decide(clock.now)) == []
    gone.in_flight = 0
    waiter = wait_for(s, gone, clock.now)  # queued before the reload: it is served first
    assert actions(s.decide(clock.now)) == [] and waiter.future.done() and gone.in_flight == 1
    gone.release()
    s.waiting["gone"].clear()
    assert actions(s.decide(clock.now)) == [("retire", "gone")]


async def test_a_changed_model_restarts_at_its_next_idle_moment_and_takes_router_side_keys_at_once(clock):
    a = awake("a", clock, share=0.3)
    s = scheduler(a, clock=clock)
    new = ModelSpec(name="a", model="/m/other", aliases=["chat"], args=["--gpu-memory-utilization", "0.3"])
    a.in_flight = 1
    s.respec(a, new)
    assert a.spec.aliases == ["chat"] and a.spec.model == "/m/a", "aliases now; the model with the restart"
    assert actions(s.decide(clock.now)) == []
    a.in_flight = 0
    assert actions(s.decide(clock.now)) == [("respec", "a")]


def test_the_diff_sorts_each_change_into_restart_or_in_place():
    old = sim_roster({"name": "a", "model": "m/a"}, {"name": "b", "model": "m/b"}, {"name": "c", "model": "m/c"})
    new = sim_roster({"name": "a", "model": "m/a", "aliases": ["x"], "default": True, "gate": {"output_check": "off"}},
                     {"name": "b", "model": "m/b", "env": {"X": "1"}, "gate": {"max_tokens": 8}},
                     {"name": "d", "model": "m/d"}, queue={"max_wait_s": 9}, listen={"port": 9999})
    changes = diff(old, {m.name: m for m in old.models}, new)
    assert [m.name for m in changes.added] == ["d"] and changes.removed == ("c",)
    assert {c.name: (c.fields, c.restart) for c in changes.changed} == {
        "a": (("aliases", "default", "gate.output_check"), False), "b": (("env", "gate.max_tokens"), True)}
    assert changes.sections == ("queue",) and changes.needs_restart == ("listen.port",)


def test_a_changed_activity_log_is_reported_as_needing_a_restart():
    old = sim_roster({"name": "a", "model": "m/a"})
    new = sim_roster({"name": "a", "model": "m/a"}, activity={"path": "/var/lib/hotswap/activity.db"})
    changes = diff(old, {m.name: m for m in old.models}, new)
    assert changes.needs_restart == ("activity.path",) and not changes.sections
    assert "! activity.path: NOT applied: the activity log needs a router restart (still on the old one)" in changes.summary()


def test_what_an_engine_waiting_for_its_restart_is_judged_by():
    running = ModelSpec(name="a", model="m/a", gate={"prompt": "one", "min_acceptance_ratio": 0.5})
    thresholds_only = ModelSpec(name="a", model="m/a", gate={"prompt": "one", "min_acceptance_ratio": 0.2}, group="g")
    new_canary = ModelSpec(name="a", model="m/b", gate={"prompt": "two", "min_acceptance_ratio": 0.2}, group="g")
    assert not model_change(running, thresholds_only).restart and model_change(running, new_canary).restart
    interim = router_side(running, new_canary)
    assert interim.group == "g" and interim.model == "m/a" and interim.gate == running.gate, \
        "its baseline was recorded with its own canary, so the new thresholds wait for the new one"


def test_a_changed_agent_port_needs_a_restart_while_the_rest_of_node_changes_in_place():
    old = sim_roster({"name": "a", "model": "m/a"}, node={"agent_port": 9001})
    moved = diff(old, {m.name: m for m in old.models}, sim_roster({"name": "a", "model": "m/a"}, node={"agent_port": 9002}))
    assert moved.needs_restart == ("node.agent_port",) and not moved.sections
    assert moved.summary() == ["! node.agent_port: NOT applied: the agent's port needs a router restart (still on the old one)"]
    both = diff(old, {m.name: m for m in old.models},
                sim_roster({"name": "a", "model": "m/a"}, node={"agent_port": 9002, "name": "n2"}))
    assert both.needs_restart == ("node.agent_port",) and both.sections == ("node",)
