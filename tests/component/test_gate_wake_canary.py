"""The short wake canary against simulated engines: after a wake that moved no weights from disk (the
KV-only rung, Level 1) the gate runs gate.wake_max_tokens tokens, judged against a cold-boot baseline
of that length, and still refuses every wake fault the simulator can inject there: a lost draft,
logprobs shifted or scattered by the wake (vLLM #45617, #44972), a target answering garbage."""

from __future__ import annotations

import aiohttp
import pytest

from engines.waking import ladder
from engines.engine import EngineFailed, State
from tests.component.test_gate import counters_only
from tests.support import ask, client, eventually, roster_dict, sim_model

WAKE_GATE = {"max_tokens": 64, "wake_max_tokens": 16}  # the production full canary, the shipped short one


def spec_model(name: str, gate: dict | None = None, **extra):
    return sim_model(name, spec=True, gate={**WAKE_GATE, **(gate or {})}, **extra)


async def rpc(port: int, method: str) -> object:
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/collective_rpc", json={"method": method}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["results"][0]


async def test_a_wake_from_the_kv_rung_or_level_1_runs_the_short_canary_and_a_level_2_wake_the_full_one(engine_factory):
    engine = engine_factory(spec_model("a"))
    await engine.boot()
    record = engine.gate
    assert (record.baseline.tokens, record.wake_baseline.tokens) == (64, 16), "the boot recorded both baselines"
    assert "; 16-token wake canary: mean acceptance length" in record.last_verdict.reason
    for level in (ladder.KV_PARKED, 1):
        await engine.sleep(level)
        await engine.wake()
        v = record.last_verdict
        assert v.result == "passed" and (v.canary, v.canary_tokens, v.logprob_tokens) == ("wake", 16, 16), v
        assert v.reason.startswith("16-token wake canary: mean acceptance length") and v.logprob_drift == 0.0, v
        assert v.baseline_mal == record.wake_baseline.mal, "judged against the short baseline, not the 64-token one"
    await engine.sleep(2)
    await engine.wake()
    v = record.last_verdict
    assert v.result == "passed" and (v.canary, v.canary_tokens) == ("full", 64), "Level 2 reloads from disk: the full canary"
    assert v.baseline_mal == record.baseline.mal and not v.reason.startswith("16-token")


async def test_with_wake_max_tokens_null_every_wake_runs_the_full_canary(engine_factory):
    engine = engine_factory(sim_model("a", spec=True, gate={**WAKE_GATE, "wake_max_tokens": None}))
    await engine.boot()
    assert engine.gate.wake_baseline is None
    await engine.sleep(1)
    await engine.wake()
    assert (engine.gate.last_verdict.canary, engine.gate.last_verdict.canary_tokens) == ("full", 64)


async def test_a_short_canary_read_from_the_counters_waits_for_them_and_passes(engine_factory):
    engine = counters_only(engine_factory(spec_model("a", args=("--sim-metrics-lag-s", "0.2"))))
    await engine.boot()
    assert engine.gate.wake_baseline.source == "counters" and engine.gate.wake_baseline.mal > 2
    await engine.sleep(1)
    await engine.wake()
    v = engine.gate.last_verdict
    assert v.result == "passed" and v.canary == "wake" and v.acceptance_source == "counters", v


async def test_a_draft_lost_while_at_level_1_is_refused_by_the_short_canary_and_the_restart_runs_the_full_one(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), spec_model("b", sleep_level=1)))

    async def parked():
        e = await router.engine("b")
        return e if e["state"] == "sleeping" else None

    b0 = await eventually(parked, timeout=30, what="b parked after its boot")
    assert (await rpc(b0["port"], "hotswap_discard_draft"))["discarded"] > 0
    assert await ask(client(router), "b")  # answered by the restarted engine, never by the collapsed one
    b = await router.engine("b")
    refused = next(v for v in b["verdicts"] if v["result"] == "refused")
    assert refused["reason"].startswith("16-token wake canary: mean acceptance length 1.00 is below"), refused
    assert "the draft model looks lost (vLLM #52479)" in refused["reason"] and refused["canary"] == "wake"
    assert b["restarts_by_reason"] == {"gate": 1} and b["state"] == "awake"
    assert (b["last_verdict"]["result"], b["last_verdict"]["canary"], b["last_verdict"]["canary_tokens"]) == ("passed", "full", 64)
    assert "gate b: refused (16-token wake canary: mean acceptance length 1.00" in router.log()


@pytest.mark.parametrize("level", [ladder.KV_PARKED, 1])
@pytest.mark.parametrize("fault, drift", [("--sim-wake-logprob-shift", r"0\.3"), ("--sim-wake-logprob-noise", r"0\.\d+")])
async def test_logprobs_moved_by_the_wake_are_refused_by_the_short_canary(engine_factory, level, fault, drift):
    value = "-0.3" if fault.endswith("shift") else "1.0"
    engine = engine_factory(spec_model("a", args=(fault, value), gate={"on_fail": "refuse"}))
    await engine.boot()
    await engine.sleep(level)
    with pytest.raises(EngineFailed, match=rf"gate refused promotion: 16-token wake canary: logprob drift {drift} > 0\.05 "
                                           r"over 16 tokens, tokens identical"):
        await engine.wake()
    v = engine.gate.last_verdict
    assert v.output_match is True and v.canary == "wake" and "mean acceptance length" not in v.reason, v


async def test_a_target_answering_garbage_is_refused_by_the_short_canary_from_its_first_character(engine_factory):
    # The simulator's target comes back as garbage only from Level 2 without reload_weights; the gate is
    # told the wake was a Level-1 one (as if the host copy came back corrupt), so the short canary judges it.
    engine = engine_factory(sim_model("a", gate={**WAKE_GATE, "on_fail": "refuse"}))
    await engine.boot()
    await engine.sleep(2)
    await engine.client.wake_up(["weights"])
    await engine.client.wake_up(["kv_cache"])
    engine.state = State.VERIFYING  # the gate's view of an engine that has just been woken
    verdict = await engine._judged_canary(1)
    assert not verdict.passed and verdict.output_match is False and verdict.canary == "wake"
    assert verdict.reason.startswith("16-token wake canary: canary output differs from the cold-boot baseline (exact) "
                                     "at character 1: expected"), verdict.reason
