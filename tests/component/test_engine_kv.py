"""One engine's KV park (level 0, engines/waking/ladder.py) against a real simulated vLLM process: the steps
down and back up in vLLM's order, going further down without a wake, and a KV wake the gate refuses."""

from __future__ import annotations

import pytest

from engines.waking import ladder
from engines.engine import EngineFailed, State
from tests.component.test_engine import dev_calls, make_engine, sim  # noqa: F401 (make_engine: a fixture)
from tests.support import sim_model

pytestmark = pytest.mark.timeout(30)


async def test_a_kv_park_pauses_then_releases_and_its_wake_is_a_kv_reallocation_then_the_gate(make_engine):
    engine = await make_engine(sim_model("a", spec=True))
    await engine.boot()
    await engine.sleep(ladder.KV_PARKED)
    assert (engine.state, engine.sleep_level) == (State.SLEEPING, 0)
    assert list(engine.last_phases) == ["drain", "sleep", "release_kv_cache"]
    assert (await sim(engine, "GET", "/sim/state"))["kv_cache_awake"] is False
    await engine.wake()
    assert engine.state is State.AWAKE and engine.gate.last_verdict.result == "passed"
    assert await dev_calls(engine) == ["sleep", "release_kv_cache_memory", "wake_kv_cache", "reset_prefix_cache"]
    assert list(engine.last_phases) == ["wake_kv_cache", "reset_prefix_cache", "gate"], "no weight step, the gate still runs"


async def test_a_kv_parked_engine_goes_down_to_level_2_without_waking_and_wakes_from_there(make_engine):
    engine = await make_engine(sim_model("a", spec=True))
    await engine.boot()
    await engine.sleep(ladder.KV_PARKED)
    await engine.park_further(2)
    assert (engine.state, engine.sleep_level) == (State.SLEEPING, 2)
    assert engine.observer.states[-1] == ("sleeping", "sleeping"), "its new rung is reported"
    await engine.wake()
    assert engine.state is State.AWAKE and engine.gate.last_verdict.result == "passed", "the draft was reloaded too"
    assert await dev_calls(engine) == ["sleep", "release_kv_cache_memory", "sleep", "stage", "wake_weights", "reload_draft",
                                       "reload_weights", "wake_kv_cache", "reset_prefix_cache"]
    with pytest.raises(EngineFailed):
        await engine.park_further(1)  # awake: there is no KV park to go further from
    assert engine.state is State.FAILED


async def test_a_release_the_engine_refuses_fails_the_engine_naming_the_step_and_vllms_cause(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    await sim(engine, "POST", "/sim/faults", json={"step": "release_kv_cache_memory", "kind": "http500"})
    with pytest.raises(EngineFailed, match="release_kv_cache failed: POST /release_kv_cache_memory: HTTP 500"):
        await engine.sleep(ladder.KV_PARKED)
    assert engine.state is State.FAILED


async def test_a_kv_wake_that_vllm_answers_still_asleep_fails_rather_than_hang_the_gate(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    await engine.sleep(ladder.KV_PARKED)
    await sim(engine, "POST", "/wake_up", params={"tags": "kv_cache"})  # behind the router's back: nothing sleeps now
    await sim(engine, "POST", "/sleep", params={"level": "1"})  # and the weights do
    with pytest.raises(EngineFailed, match="still asleep after its KV cache's wake"):
        await engine.wake()
