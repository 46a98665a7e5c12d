"""The gate's logprob check against simulated engines that wake up numerically wrong while their
tokens stay the same (vLLM #45617, #44972): acceptance and the output check pass such an engine;
only the canary's per-token logprobs, compared with its cold-boot baseline's, catch it."""

from __future__ import annotations

import aiohttp
import pytest

from engines.engine import EngineFailed
from tests.component.test_gate import metric, router_metrics
from tests.support import ask, client, eventually, roster_dict, sim_model, traffic_beside


async def rpc(port: int, method: str, *args: object) -> object:
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/collective_rpc",
                                                    json={"method": method, "args": list(args)}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["results"][0]


async def test_a_wake_that_shifts_every_logprob_but_no_token_is_refused_then_restarted_clean(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True),
                                            sim_model("b", args=("--sim-wake-logprob-shift", "-0.3"))))
    b0 = await router.engine("b")
    assert b0["logprob_drift"] == {"last": None, "spread": 0.0, "max": 0.05}, "two cold-boot canaries agree to the bit"
    answer = await ask(client(router), "b")  # answered by the restarted engine, never by the drifted one
    b = await router.engine("b")
    assert b["state"] == "awake" and b["restarts_by_reason"] == {"gate": 1} and b["pid"] != b0["pid"]
    refused = next(v for v in b["verdicts"] if v["result"] == "refused")
    assert refused["reason"].startswith("logprob drift 0.3 > 0.05 over 16 tokens, tokens identical"), refused
    assert refused["output_match"] is True and refused["logprob_drift"] == pytest.approx(0.3)
    assert b["last_verdict"]["result"] == "passed" and b["last_verdict"]["logprob_drift"] == 0.0
    assert b["logprob_drift"]["last"] == 0.0
    assert answer == await ask(client(router), "b"), "the same greedy answer as before the wake"
    values = await router_metrics(router)
    assert metric(values, "hotswap_gate_logprob_drift_count", model="b", group="") == 2  # the refused wake, the restart
    assert metric(values, "hotswap_gate_logprob_drift_sum", model="b", group="") == pytest.approx(0.3)
    assert metric(values, "hotswap_gate_logprob_drift_bucket", model="b", group="", le="0.2") == 1
    assert "gate b: refused (logprob drift 0.3 > 0.05 over 16 tokens, tokens identical" in router.log()


async def test_noisy_logprobs_after_a_wake_are_refused_with_the_largest_token_named(engine_factory):
    engine = engine_factory(sim_model("a", args=("--sim-wake-logprob-noise", "1.0"), gate={"on_fail": "refuse"}))
    await engine.boot()
    await engine.sleep()
    with pytest.raises(EngineFailed, match=r"gate refused promotion: logprob drift 0\.\d+ > 0\.05 over 16 tokens, "
                                           r"tokens identical \(largest [\d.]+ at token \d+\)"):
        await engine.wake()
    assert engine.gate.last_verdict.output_match is True


async def test_a_target_weight_perturbed_while_asleep_is_refused_and_the_cold_restart_restores_it(start_router):
    # spec: the router loads its worker extension, whose test method perturbs the target (as on real vLLM).
    # Level 1: a Level-2 wake's reload_weights would rewrite the weight from the checkpoint itself.
    router = await start_router(roster_dict(sim_model("a", default=True), sim_model("b", spec=True, sleep_level=1)))
    async def parked():
        e = await router.engine("b")
        return e if e["state"] == "sleeping" else None

    b0 = await eventually(parked, timeout=30,
                          what="b parked after its boot")
    digest0 = await rpc(b0["port"], "hotswap_target_digest")
    perturbed = await rpc(b0["port"], "hotswap_perturb_target", 1.5)
    assert perturbed["digest_after"] != digest0 == perturbed["digest_before"]
    assert await ask(client(router), "b")
    b = await router.engine("b")
    refused = next(v for v in b["verdicts"] if v["result"] == "refused")
    assert "logprob drift" in refused["reason"] and "tokens identical" in refused["reason"], refused
    assert "mean acceptance length" not in refused["reason"], "acceptance is untouched: only the numbers moved"
    assert b["restarts_by_reason"] == {"gate": 1} and b["last_verdict"]["result"] == "passed"
    assert await rpc(b["port"], "hotswap_target_digest") == digest0, "the restarted engine loaded the checkpoint's weights"


async def test_a_canary_in_a_busy_batch_passes_when_the_batch_moves_its_logprobs_less_than_the_threshold(engine_factory):
    # --sim-logprob-jitter: while other requests run alongside, each logprob moves by up to 0.01 (a GPU's
    # kernels for another batch shape); the shipped threshold must not turn that into a cold restart.
    engine = engine_factory(sim_model("a", args=("--sim-logprob-jitter", "0.01", "--sim-token-rate", "300")))
    await engine.boot()
    await engine.sleep()
    async with traffic_beside(engine.client.base_url, "a", "other traffic", max_tokens=32, workers=3) as answered:
        await engine.wake()  # the traffic waits for the wake, then decodes beside the canary
        await eventually(lambda: answered[0] >= 3, timeout=20, what="the other traffic answered")
    verdict = engine.gate.last_verdict
    assert verdict.result == "passed" and not engine.restarts, verdict
    assert 0 < verdict.logprob_drift <= 0.01, "measured, moved by the batch, and within the threshold"


async def test_with_max_logprob_drift_null_the_canary_asks_for_no_logprobs(engine_factory):
    engine = engine_factory(sim_model("a", args=("--sim-wake-logprob-shift", "-0.3"), gate={"max_logprob_drift": None}))
    await engine.boot()
    assert engine.gate.baseline.token_logprobs is None and engine.gate.logprob_spread is None
    await engine.sleep()
    await engine.wake()  # the shift goes unseen: that is what turning the check off means
    assert engine.gate.last_verdict.passed and engine.gate.last_verdict.logprob_drift is None
