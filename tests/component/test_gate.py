"""The promotion gate against simulated engines that lose their draft the way vLLM does (#52479)."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.engine import Engine, State
from tests.support import ask, client, eventually, roster_dict, sim_model


async def router_metrics(router) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def metric(values, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def spec_model(name: str, **extra):
    return sim_model(name, spec=True, **extra)


async def test_a_wake_that_loses_the_draft_is_refused_then_remediated_by_a_restart(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), spec_model("b", draft_restore="none")))
    assert await ask(client(router), "b")  # answered: by the restarted engine, never by the collapsed one
    b = await router.engine("b")
    assert b["state"] == "awake" and b["restarts_by_reason"] == {"gate": 1}
    assert b["last_verdict"]["result"] == "passed"  # the restart's canary, judged against the original baseline
    assert 2.4 < b["baseline_mal"] < 2.8 and abs(b["observed_mal"] - b["baseline_mal"]) < 0.2
    values = await router_metrics(router)
    assert metric(values, "hotswap_gate_verdicts_total", model="b", group="", result="refused") == 1
    assert metric(values, "hotswap_engine_restarts_total", model="b", group="", reason="gate") == 1
    floor = 1 + 0.5 * (b["baseline_mal"] - 1)
    log = router.log()
    assert f"gate b: refused (mean acceptance length 1.00 is below {floor:.2f}" in log
    assert "the draft model looks lost (vLLM #52479)" in log
    phases = (await router.status())["last_swap"]["phases"]
    assert {"wake_weights", "reload_weights", "gate", "restart"} <= set(phases)


@pytest.mark.parametrize("restore", ["reload", "preserve"])
async def test_reload_and_preserve_keep_the_draft_and_pass_without_a_restart(start_router, restore):
    router = await start_router(roster_dict(sim_model("a", default=True), spec_model("b", draft_restore=restore)))
    c = client(router)
    for model in ["b", "a", "b"]:
        assert await ask(c, model)
    b = await router.engine("b")
    assert b["restarts"] == 0 and b["last_verdict"]["result"] == "passed"
    assert abs(b["last_verdict"]["observed_mal"] - b["baseline_mal"]) < 0.2
    assert metric(await router_metrics(router), "hotswap_gate_verdicts_total", model="b", group="", result="passed") == 2


async def test_refuse_fails_the_engine_and_its_waiters_get_a_503_with_the_verdict(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), spec_model("b", draft_restore="none", gate={"on_fail": "refuse"})))
    with pytest.raises(openai.InternalServerError) as failed:
        await ask(client(router), "b")
    assert failed.value.status_code == 503
    assert "model 'b' is unavailable: engine b: gate refused promotion: mean acceptance length 1.00 is below 1.8" in str(failed.value)
    b = await router.engine("b")
    assert b["state"] == "failed" and b["restarts"] == 0 and b["last_verdict"]["result"] == "refused"
    assert await ask(client(router), "a"), "the other model keeps working"


async def test_allow_promotes_the_collapsed_engine_but_says_so_everywhere(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), spec_model("b", draft_restore="none", gate={"on_fail": "allow"})))
    assert await ask(client(router), "b")
    b = await router.engine("b")
    assert b["state"] == "awake" and b["restarts"] == 0
    assert b["last_verdict"]["result"] == "allowed" and b["last_verdict"]["observed_mal"] == 1.0
    assert metric(await router_metrics(router), "hotswap_gate_verdicts_total", model="b", group="", result="allowed") == 1
    assert "PROMOTED DESPITE A REFUSED GATE" in router.log()


async def test_a_midlife_collapse_is_flagged_and_restarted_at_the_next_idle_moment(start_router):
    watched = spec_model("a", default=True, gate={"on_midlife": "restart", "midlife_window_s": 2, "midlife_min_drafts": 20})
    router = await start_router(roster_dict(watched))
    port = (await router.engine("a"))["port"]
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/collective_rpc", json={"method": "hotswap_discard_draft"}) as r:
        assert r.status == 200
    c = client(router)

    async def collapse_seen() -> bool:
        await ask(c, "a", max_tokens=32)  # served traffic moves the counters the watch reads
        return metric(await router_metrics(router), "hotswap_midlife_collapses_total", model="a", group="") == 1

    await eventually(collapse_seen, timeout=20, interval=0.05, what="mid-life collapse flagged")
    await eventually(lambda: _restarted(router, "a", "midlife"), timeout=20, what="restart at idle")
    assert "acceptance collapsed while serving" in router.log()
    assert await ask(c, "a")


async def _restarted(router, name, reason) -> bool:
    e = await router.engine(name)
    return e["restarts_by_reason"].get(reason) == 1 and e["state"] == "awake"


# -- engine-level scenarios ------------------------------------------------------------------------

def counters_only(engine: Engine, *args: str) -> Engine:
    """An engine whose answers carry no acceptance of their own (like a `command:` engine without
    --per-request-spec-decode-metrics), so the gate reads the counters. Set behind the roster's back:
    the flag is router-owned."""
    engine.spec = engine.spec.model_copy(update={"args": [*engine.spec.args, "--per-request-spec-decode-metrics", "none", *args]})
    return engine


async def test_counters_that_lag_the_canarys_answer_are_waited_for_not_misread(engine_factory):
    engine = counters_only(engine_factory(spec_model("a", args=("--sim-metrics-lag-s", "0.5"))))
    await engine.boot()
    assert engine.gate.baseline.mal is not None and 2.4 < engine.gate.baseline.mal < 2.8, engine.gate.baseline
    assert engine.gate.baseline.source == "counters", engine.gate.baseline  # the path this test is about
    assert engine.gate.baseline.seconds >= 0.5  # it did wait for the counters
    await engine.sleep()
    await engine.wake()
    assert engine.gate.last_verdict.result == "passed", engine.gate.last_verdict


async def test_a_target_that_was_not_reloaded_answers_gibberish_and_is_refused_without_a_draft(engine_factory):
    engine = engine_factory(sim_model("a", gate={"on_fail": "refuse"}))
    await engine.boot()
    await engine.sleep()
    # A wake that forgets reload_weights: weights memory is back, its contents are not.
    await engine.client.wake_up(["weights"])
    await engine.client.wake_up(["kv_cache"])
    engine.state = State.VERIFYING  # the gate's view of an engine that has just been woken
    verdict = await engine._judged_canary()
    assert not verdict.passed and verdict.output_match is False
    assert verdict.reason.startswith("canary output differs from the cold-boot baseline (exact) at character 1: expected")


async def test_a_gate_that_cannot_read_the_counters_fails_the_boot_with_a_reason(engine_factory):
    engine = counters_only(engine_factory(spec_model("a", gate={"enabled": True}, args=())), "--disable-log-stats")
    with pytest.raises(Exception, match="the canary's answer has no metrics.speculative_decoding and /metrics has no "
                                        "vllm:spec_decode_num_drafts_total / vllm:spec_decode_num_accepted_tokens_total counters"):
        await engine.boot()
    assert engine.state is State.FAILED
