"""The logprob check of the gate: what drift is, and the verdicts it earns."""

from __future__ import annotations

import pytest

from config.schema import Gate
from engines.gate.canary import Canary
from engines.gate.drift import describe, logprob_drift
from engines.gate.verdict import baseline_verdict, judge

TOKENS = tuple(f" w{i}" for i in range(64))
HEALTHY = tuple(-0.1 - (i % 7) * 0.3 for i in range(64))


def canary(logprobs=HEALTHY, tokens=TOKENS) -> Canary:
    text = "".join(tokens) if tokens is not None else "".join(TOKENS)
    return Canary(text, len(text.split()), None, 0.0, 0.0, 0.1, token_texts=tokens, token_logprobs=logprobs)


def test_drift_is_the_mean_absolute_change_over_the_tokens_both_chose():
    shifted = tuple(v - 0.25 for v in HEALTHY)
    d = logprob_drift(TOKENS, HEALTHY, TOKENS, shifted)
    assert d.mean == pytest.approx(0.25) and d.largest == pytest.approx(0.25) and d.positions == 64 and d.identical


def test_drift_stops_where_the_tokens_diverge_and_says_so():
    other = TOKENS[:10] + tuple(" x" for _ in range(54))
    moved = HEALTHY[:9] + (HEALTHY[9] - 2.0,) + HEALTHY[10:]
    d = logprob_drift(TOKENS, HEALTHY, other, moved)
    assert (d.positions, d.identical, d.at) == (10, False, 9)
    assert d.mean == pytest.approx(0.2) and d.largest == pytest.approx(2.0)
    assert describe(d) == "0.2 over 10 tokens, up to where the tokens diverge (largest 2 at token 9)"


def test_tokens_that_differ_from_the_first_on_leave_nothing_to_compare():
    assert logprob_drift(TOKENS, HEALTHY, (" x",) * 64, HEALTHY) is None


def test_a_wake_whose_numbers_moved_with_the_tokens_unchanged_is_refused_with_the_numbers():
    observed = canary(tuple(v - 0.41 if i == 17 else v - 0.4 for i, v in enumerate(HEALTHY)))
    verdict = judge(canary(), observed, Gate())
    assert not verdict.passed and verdict.result == "refused" and verdict.output_match is True
    assert verdict.reason.startswith("logprob drift 0.4 > 0.05 over 64 tokens, tokens identical (largest 0.41 at token 17): "
                                     "the target answers the same tokens with other numbers"), verdict.reason
    assert verdict.logprob_drift == pytest.approx(0.40015625) and verdict.logprob_tokens == 64
    assert verdict.logprob_drift_largest == pytest.approx(0.41)


def test_a_wake_within_the_threshold_passes_and_its_drift_is_reported():
    verdict = judge(canary(), canary(tuple(v + 0.01 for v in HEALTHY)), Gate())
    assert verdict.passed and verdict.logprob_drift == pytest.approx(0.01)
    assert verdict.reason.startswith("canary output matches the baseline (no draft model); logprob drift 0.01 over 64 "
                                     "tokens, tokens identical (largest 0.01 at token "), verdict.reason


def test_the_threshold_is_the_gate_key():
    moved = canary(tuple(v + 0.01 for v in HEALTHY))
    assert not judge(canary(), moved, Gate(max_logprob_drift=0.005)).passed
    assert judge(canary(), moved, Gate(max_logprob_drift=0.02)).passed


def test_with_the_key_null_nothing_is_measured_or_refused():
    verdict = judge(canary(), canary(tuple(v - 3 for v in HEALTHY)), Gate(max_logprob_drift=None))
    assert verdict.passed and verdict.logprob_drift is None


def test_an_engine_that_returned_logprobs_at_boot_and_none_after_a_wake_is_refused():
    verdict = judge(canary(), canary(logprobs=None, tokens=None), Gate())
    assert not verdict.passed and "carries no logprobs, though the cold-boot canary's did" in verdict.reason


def test_an_engine_that_never_returns_logprobs_is_judged_without_them():
    verdict = judge(canary(logprobs=None, tokens=None), canary(logprobs=None, tokens=None), Gate())
    assert verdict.passed and verdict.logprob_drift is None


def test_diverging_tokens_are_the_output_checks_to_name_and_the_drift_covers_the_prefix():
    other = canary(tokens=TOKENS[:32] + (" x",) * 32)
    verdict = judge(canary(), other, Gate())
    assert not verdict.passed and verdict.reason.startswith("canary output differs from the cold-boot baseline (exact)")
    assert verdict.logprob_tokens == 32 and verdict.logprob_drift == 0.0


def test_the_baseline_records_the_engines_own_spread_from_its_replay():
    verdict = baseline_verdict(canary(), canary(tuple(v + 0.002 for v in HEALTHY)), Gate())
    assert verdict.passed and verdict.result == "baseline" and verdict.logprob_drift == pytest.approx(0.002)
    assert verdict.reason.endswith("; its own logprob spread 0.002 over 64 tokens, tokens identical (largest 0.002 at token 0)")


def test_a_cold_boot_that_cannot_reproduce_its_own_canary_within_the_threshold_is_refused_naming_the_key():
    verdict = baseline_verdict(canary(), canary(tuple(v + 0.08 for v in HEALTHY)), Gate())
    assert not verdict.passed
    assert verdict.reason.startswith("two cold-boot canaries differ by logprob drift 0.08 > 0.05 over 64 tokens")
    assert "raise gate.max_logprob_drift above this engine's own spread 0.08 (docs/gate.md)" in verdict.reason


def test_a_baseline_without_a_replay_or_logprobs_is_recorded_as_before():
    assert baseline_verdict(canary(logprobs=None, tokens=None), None, Gate(max_logprob_drift=None)).passed
    assert baseline_verdict(canary(), None, Gate()).logprob_drift is None
