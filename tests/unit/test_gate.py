"""Gate arithmetic: counters from exposition text, and verdicts from a baseline and an observation."""

from __future__ import annotations

import pytest

from config.schema import Gate
from engines.vllm.client import EngineError
from engines.gate.canary import FROM_ANSWER, FROM_COUNTERS, Canary, Counters, answer_spec_counts, read_counters
from engines.gate.verdict import MidlifeWatch, acceptance_problems, judge

EXPOSITION = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 20.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 160.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 32.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 312.0
"""


def test_counters_are_summed_over_engines_and_created_samples_ignored():
    c = read_counters(EXPOSITION)
    assert (c.drafts, c.accepted, c.generated, c.has_spec) == (120.0, 192.0, 312.0, True)


def test_an_engine_without_spec_decode_has_no_spec_counters():
    c = read_counters('vllm:generation_tokens_total{engine="0",model_name="m"} 5.0\n')
    assert not c.has_spec and c.generated == 5.0


def canary(text: str = "the same words", mal: float | None = 2.6) -> Canary:
    return Canary(text=text, tokens=64, mal=mal, drafts=25, accepted=40, seconds=0.1)


GATE = Gate()


def test_a_healthy_wake_passes_with_both_numbers_in_the_reason():
    v = judge(canary(mal=2.6), canary(mal=2.55), GATE)
    assert v.passed and v.result == "passed" and v.output_match is True
    assert (v.baseline_mal, v.observed_mal) == (2.6, 2.55)
    assert "2.55 vs baseline 2.60" in v.reason


def test_a_lost_draft_is_refused_with_the_measured_numbers():
    v = judge(canary(mal=2.6), canary(mal=1.0), GATE)
    assert not v.passed and v.result == "refused"
    assert "mean acceptance length 1.00 is below 1.80 (min_acceptance_ratio 0.5 of the baseline 2.60)" in v.reason
    assert "below min_acceptance_length 1.2" in v.reason


@pytest.mark.parametrize("observed, refused", [(1.79, True), (1.8, False), (1.81, False)])
def test_the_ratio_threshold_is_relative_to_the_baselines_gain_over_one(observed, refused):
    assert bool(acceptance_problems(2.6, observed, GATE)) is refused


def test_min_acceptance_length_applies_even_when_the_baseline_was_low():
    low_baseline = 1.3  # the ratio floor would be 1.15
    assert acceptance_problems(low_baseline, 1.16, GATE) == ["mean acceptance length 1.16 is below min_acceptance_length 1.2"]


def test_gibberish_after_wake_is_refused_even_without_a_draft():
    v = judge(canary("the cat sat on the mat", mal=None), canary("the cat zq#x!! kk", mal=None), GATE)
    assert not v.passed and v.output_match is False
    assert "canary output differs from the cold-boot baseline (exact) at character 8: expected 'sat on the mat', got 'zq#x!! kk'" in v.reason


def test_empty_output_always_fails_even_with_the_output_check_off():
    v = judge(canary("words", mal=None), canary("", mal=None), Gate(output_check="off"))
    assert not v.passed and v.reason == "the canary produced no output" and v.output_match is None


def test_a_prefix_check_tolerates_a_different_tail():
    gate = Gate(output_check="prefix:8")
    assert judge(canary("the cat sat"), canary("the cat ran"), gate).passed
    assert not judge(canary("the cat sat"), canary("the dog sat"), gate).passed


def test_no_drafts_counted_after_a_wake_is_a_refusal_for_a_model_with_a_draft():
    v = judge(canary(mal=2.6), canary(mal=None), GATE)
    assert not v.passed and "no drafts were counted" in v.reason


def test_allow_keeps_the_numbers_and_says_what_was_overridden():
    v = judge(canary(mal=2.6), canary(mal=1.0), GATE).allowed()
    assert v.passed and v.result == "allowed" and v.observed_mal == 1.0 and v.reason.startswith("promoted despite: ")


def test_text_that_is_not_prometheus_exposition_is_an_engine_error_with_the_text():
    with pytest.raises(EngineError) as raised:
        read_counters("vllm:x 1\nbroken None\n")
    assert str(raised.value) == ("GET /metrics: the answer is not Prometheus text (could not convert string to float: "
                                 "'None'): 'vllm:x 1\\nbroken None\\n'")


def sample(drafts: float, accepted: float) -> Counters:
    return Counters(generated=0, drafts=drafts, accepted=accepted, has_spec=True)


def test_the_midlife_window_waits_for_enough_drafts_then_judges_like_the_canary():
    watch = MidlifeWatch(Gate(midlife_window_s=60, midlife_min_drafts=100))
    assert watch.observe(0, sample(0, 0), baseline_mal=3.0) == (None, [])
    assert watch.observe(5, sample(50, 100), baseline_mal=3.0) == (None, []), "50 drafts are too few to judge"
    mal, problems = watch.observe(10, sample(100, 200), baseline_mal=3.0)
    assert (mal, problems, watch.collapsed) == (3.0, [], False)


def test_a_collapse_in_the_window_is_flagged_once_and_remembered_after_a_reset():
    watch = MidlifeWatch(Gate(midlife_window_s=10, midlife_min_drafts=100))
    watch.observe(0, sample(0, 0), baseline_mal=3.0)
    assert watch.observe(9, sample(100, 200), baseline_mal=3.0) == (3.0, [])  # healthy
    watch.observe(12, sample(100, 200), baseline_mal=3.0)  # the draft is lost here; no traffic yet
    # 200 new drafts, nothing accepted: the window (10 s) has slid past the healthy part.
    mal, problems = watch.observe(20, sample(300, 200), baseline_mal=3.0)
    assert mal == pytest.approx(1.0) and problems and watch.collapsed
    collapse = watch.last_collapse
    assert collapse["observed_mal"] == pytest.approx(1.0) and "the draft model looks lost" in collapse["reason"]
    watch.observe(21, sample(400, 200), baseline_mal=3.0)
    assert watch.last_collapse is collapse, "one collapse, one record"
    watch.reset()  # the restart that remedies it
    assert not watch.collapsed and watch.last_collapse is collapse


# -- an answer's own numbers (metrics.speculative_decoding, vLLM 0.32's shape) -------------------

SPEC = (b'"metrics":{"speculative_decoding":{"mean_acceptance_length":2.5,"draft_acceptance_rate":0.5,'
        b'"acceptance_histogram":[1,0,2,1],"num_spec_steps":4,"num_accepted_draft_tokens":6,"num_draft_tokens":12,"num_spec_tokens":3}}')


def test_a_buffered_answer_and_a_streams_last_event_give_their_counts():
    body = b'{"id":"cmpl-1","choices":[{"text":"hi"}],"usage":{"completion_tokens":10},' + SPEC + b'}'
    assert answer_spec_counts(body) == (4, 6)
    tail = b'data: {"id":"cmpl-1","choices":[],"usage":{"completion_tokens":10},' + SPEC + b'}\n\ndata: [DONE]\n\n'
    assert answer_spec_counts(tail) == (4, 6)


def test_generated_text_that_spells_the_key_is_not_taken_for_the_numbers():
    # Inside a JSON string a quote is escaped, so the text cannot forge the key.
    body = b'{"choices":[{"text":"\\"speculative_decoding\\": {\\"num_spec_steps\\": 999}"}]}'
    assert answer_spec_counts(body) is None


@pytest.mark.parametrize("payload", [
    b'{"choices":[]}',  # no metrics: an engine without the flag
    b'{"metrics":{"speculative_decoding":null}}',  # n > 1: vLLM leaves it out
    b'{"metrics":{"speculative_decoding":{"num_spec_steps":"4","num_accepted_draft_tokens":6}}}',
    b'{"metrics":{"speculative_decoding":{"num_spec_steps":4,',  # a tail cut mid-event
])
def test_an_answer_without_usable_numbers_gives_none(payload):
    assert answer_spec_counts(payload) is None


def test_the_window_judges_answers_by_their_own_numbers_and_counters_only_without_any():
    gate = Gate(midlife_window_s=10, midlife_min_drafts=10)
    w = MidlifeWatch(gate)
    assert w.observe(0.0, Counters(0, 0, 0, True), 2.5) == (None, [])
    mal, problems = w.observe(1.0, Counters(0, 100, 10, True), 2.5)  # the counters: 1.1, mixed with others' traffic
    assert w.source == FROM_COUNTERS and problems
    w.answered(2.0, 40, 60)
    mal, problems = w.observe(3.0, Counters(0, 200, 20, True), 2.5)
    assert (mal, problems, w.source) == (2.5, [], FROM_ANSWER)
    mal, _ = w.observe(13.0, Counters(0, 300, 30, True), 2.5)  # the answer left the window: back to the counters
    assert w.source == FROM_COUNTERS and w.last["source"] == FROM_COUNTERS


def test_answers_leave_the_window_even_when_nothing_judges_it():
    w = MidlifeWatch(Gate(midlife_window_s=10, midlife_min_drafts=10))
    for t in range(1000):  # a gate that is disabled never scrapes; the proxy still hands over answers
        w.answered(float(t), 4, 6)
    assert len(w._answers) == 11 and (w._answer_steps, w._answer_accepted) == (44, 66)
