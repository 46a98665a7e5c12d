"""The gate's logprob check on real vLLM (CPU): a target made numerically wrong while it sleeps,
with the canary's tokens and acceptance unchanged, is refused and cold-restarted; healthy wakes
are not refused, and their measured drift is the tier's report (docs/gate.md).

One router, one engine: the tiny target as its own draft (acceptance exactly 3.0), parked at
Level 1. Level 1 because vLLM's `reload_weights` (the Level-2 wake) rewrites the target from
its checkpoint and so would itself undo the stand-in fault (measured: docs/gate.md, "Measured: logprob drift").
The stand-in is the worker extension's test method `hotswap_perturb_target`, called straight on
the sleeping engine's port: it scales the final norm weight, so every logit scales and no argmax
moves (engines/vllm_worker/extension.py). On CPU sleep itself is bookkeeping; the wake's endpoints, the
canary, the logprobs, the refusal and the restart are real. A Level-1 wake moves no weights from disk,
so its gate runs the short wake canary (gate.wake_max_tokens, 16 tokens) against its own cold-boot
baseline; the restart after a refusal runs the full one (GATE_TOKENS).
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Iterator

import pytest

from config.schema import Gate
from tests.integration.harness import BOOT_TIMEOUT_S, REPORT, http
from tests.integration.live_router import LiveRouter
from tests.integration.test_router_vllm import GATE_TOKENS, RESTART_TIMEOUT_S, SPEC, ask, counters, delta
from tests.integration.test_router_vllm import roster as group_roster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

WAKES = int(os.environ.get("HOTSWAP_VLLM_DRIFT_WAKES", "50"))
PERTURB = 1.5  # mean drift 0.46 on this model (docs/gate.md), tokens and acceptance unchanged
FULL = 3.0
WAKE_TOKENS = Gate().wake_max_tokens  # the short canary a Level-1 wake runs (the roster leaves the default)


def roster() -> dict[str, Any]:
    data = group_roster()
    spec = next(m for m in data["models"] if m["name"] == SPEC)
    return {**data, "models": [{**spec, "sleep_level": 1, "default": True}]}


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    with LiveRouter.booted(roster(), tmp_path_factory.mktemp("router"), timeout=2 * BOOT_TIMEOUT_S) as live:
        yield live


def park(live: LiveRouter) -> dict[str, Any]:
    code, body = http("POST", live.url + f"/admin/sleep?model={SPEC}", timeout=120)
    assert code == 200, body
    engine = live.engine(SPEC)
    assert engine["state"] == "sleeping" and engine["sleep_level"] == 1, engine
    return engine


def test_healthy_level1_wakes_are_all_promoted_and_their_logprob_drift_is_measured(router: LiveRouter) -> None:
    reference = ask(router, SPEC)
    engine = router.engine(SPEC)
    spread, limit = engine["logprob_drift"]["spread"], engine["logprob_drift"]["max"]
    assert spread is not None and spread <= limit, engine["logprob_drift"]
    before = counters(router, SPEC)
    drifts, tokens, seconds = [], set(), []
    for _ in range(WAKES):
        park(router)
        assert ask(router, SPEC) == reference
        verdict = router.engine(SPEC)["last_verdict"]
        assert verdict["result"] == "passed" and verdict["observed_mal"] == pytest.approx(FULL), verdict
        assert verdict["canary"] == "wake" and verdict["reason"].startswith(f"{WAKE_TOKENS}-token wake canary: "), verdict
        drifts.append(verdict["logprob_drift"])
        seconds.append(verdict["seconds"])
        tokens.add(verdict["logprob_tokens"])
    assert delta(counters(router, SPEC), before) == {"passed": WAKES}, "no false refusal, no restart"
    assert tokens == {WAKE_TOKENS}, "every wake compared all of the short canary's tokens: they were identical"
    REPORT["drift_healthy_level1"] = {
        "wakes": WAKES, "refused": 0, "boot_spread": spread, "threshold": limit, "canary_tokens": WAKE_TOKENS,
        "canary_s": {"median": statistics.median(seconds), "max": max(seconds)},
        "drift": {"min": min(drifts), "median": statistics.median(drifts), "max": max(drifts),
                  "exactly_zero": sum(d == 0 for d in drifts)},
    }


def test_a_target_perturbed_while_asleep_is_refused_for_its_drift_and_the_cold_restart_restores_it(router: LiveRouter) -> None:
    reference = ask(router, SPEC)
    engine0 = park(router)
    (digest0,) = router.rpc(SPEC, "hotswap_target_digest")
    (perturbed,) = router.rpc(SPEC, "hotswap_perturb_target", scale=PERTURB)
    assert perturbed["digest_before"] == digest0 != perturbed["digest_after"], perturbed
    before = counters(router, SPEC)

    assert ask(router, SPEC, timeout=RESTART_TIMEOUT_S) == reference, "answered, correctly, by the restarted engine"
    engine = router.engine(SPEC)
    refused = next(v for v in engine["verdicts"] if v["result"] == "refused")
    assert refused["reason"].startswith(f"{WAKE_TOKENS}-token wake canary: logprob drift "), refused
    assert f"over {WAKE_TOKENS} tokens, tokens identical" in refused["reason"], "caught by the short canary after the Level-1 wake"
    assert refused["output_match"] is True and refused["observed_mal"] == pytest.approx(FULL), \
        "the tokens and the acceptance were the baseline's: only the numbers moved"
    assert refused["logprob_drift"] > engine["logprob_drift"]["max"]
    assert engine["state"] == "awake" and engine["pid"] != engine0["pid"], "a new engine process"
    assert engine["last_verdict"]["result"] == "passed" and engine["last_verdict"]["logprob_drift"] <= engine["logprob_drift"]["max"]
    assert (engine["last_verdict"]["canary"], engine["last_verdict"]["logprob_tokens"]) == ("full", GATE_TOKENS), "a restart runs the full canary"
    assert delta(counters(router, SPEC), before) == {"refused": 1, "passed": 1, "restart_gate": 1}
    assert router.rpc(SPEC, "hotswap_target_digest") == [digest0], "the checkpoint's weights again"
    REPORT["drift_perturbed"] = {"scale": PERTURB, "refused_drift": refused["logprob_drift"],
                                 "largest": refused["logprob_drift_largest"], "restarted_drift": engine["last_verdict"]["logprob_drift"],
                                 "gate_s": refused["seconds"]}
