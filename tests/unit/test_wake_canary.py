"""The short wake canary: which gate step runs it, what the roster accepts, and that a short canary is
judged against the short baseline, never against the full one."""

from __future__ import annotations

import textwrap

import pytest

from config import RosterError, parse_roster
from config.diff import model_change, router_side
from config.schema import Gate
from engines.gate.canary import Canary
from engines.gate.promotion import Baseline, canaries, wake_canary
from engines.gate.verdict import baseline_verdict, judge


def gate_of(text: str) -> Gate:
    return parse_roster(textwrap.dedent(text), "roster.yaml", {}).models[0].gate


def canary(tokens: int, mal: float | None = 2.6, text: str = "the same words") -> Canary:
    return Canary(text=text, tokens=tokens, mal=mal, drafts=tokens // 3, accepted=tokens // 2, seconds=0.1)


FULL, SHORT = canary(64, 2.60), canary(16, 3.00)
BASELINE = Baseline(FULL, None, SHORT)


def test_by_default_a_wake_from_the_kv_rung_or_level_1_runs_16_tokens_and_everything_else_the_full_canary():
    gate = Gate()
    assert gate.wake_tokens == 16
    assert [wake_canary(gate, level, BASELINE) for level in (0, 1)] == [16, 16]
    assert wake_canary(gate, 2, BASELINE) is None, "a Level-2 wake reloads from disk: the draft can be lost there"
    assert wake_canary(gate, None, BASELINE) is None, "a cold boot or a restart (gate, midlife, admin, failed)"


def test_null_or_no_short_baseline_means_the_full_canary_after_every_wake():
    assert wake_canary(Gate(wake_max_tokens=None), 1, BASELINE) is None
    assert wake_canary(Gate(), 1, Baseline(FULL, None)) is None, "a baseline recorded without one"


def test_the_first_boot_pays_one_short_canary_more_and_later_gates_none():
    assert canaries(Gate(), first=True) == 3  # the baseline, its replay, the short baseline
    assert canaries(Gate(wake_max_tokens=None), first=True) == 2
    assert canaries(Gate(max_tokens=16), first=True) == 2, "16 of 16 is the full canary: nothing extra"
    assert canaries(Gate(), first=False) == 1


def test_a_written_wake_length_above_max_tokens_is_a_roster_error_on_its_line():
    with pytest.raises(RosterError) as info:
        gate_of("""
            models:
              - name: a
                model: /m/a
                gate: {max_tokens: 8, wake_max_tokens: 16}
        """)
    (issue,) = info.value.issues
    assert str(issue).startswith("roster.yaml:5:") and "models[0].gate.wake_max_tokens: 16 is more than max_tokens (8)" in str(issue)


def test_an_unwritten_default_is_cut_to_a_shorter_max_tokens_so_old_rosters_still_load():
    gate = gate_of("""
        models:
          - name: a
            model: /m/a
            gate: {max_tokens: 8}
    """)
    assert gate.wake_max_tokens == 16 and gate.wake_tokens is None, "8 tokens already: every wake runs them"


def test_a_short_canary_is_judged_against_the_short_baseline_not_the_full_one():
    # The first tokens can draft better than the whole answer (3.00 over 16, 2.60 over 64); a healthy short
    # wake at 3.00 passes against its own baseline, and a lost draft (1.00) is refused against either.
    assert judge(SHORT, canary(16, 3.00), Gate()).passed
    lost = judge(SHORT, canary(16, 1.00), Gate())
    assert not lost.passed and "is below 2.00 (min_acceptance_ratio 0.5 of the baseline 3.00)" in lost.reason
    # Against the full baseline a short wake that drafts worse than its own first tokens would be misjudged:
    assert judge(FULL, canary(16, 1.9), Gate()).passed and not judge(SHORT, canary(16, 1.9), Gate()).passed


def test_the_baseline_verdict_names_the_short_canary_and_refuses_one_that_answered_nothing():
    v = baseline_verdict(FULL, None, Gate(), SHORT)
    assert v.passed and v.reason.endswith("; 16-token wake canary: mean acceptance length 3.00 over 5 drafts")
    assert v.canary == "full" and v.canary_tokens == 64
    empty = baseline_verdict(FULL, None, Gate(), canary(16, None, text=""))
    assert not empty.passed and empty.reason == "the cold-boot 16-token wake canary produced no output"


def test_changing_the_wake_canary_in_a_reload_restarts_the_engine_for_new_baselines():
    def spec(wake: int):
        return parse_roster(f"models: [{{name: a, model: /m/a, gate: {{wake_max_tokens: {wake}}}}}]\n", "r.yaml", {}).models[0]

    change = model_change(spec(16), spec(8))
    assert change is not None and change.restart and change.fields == ("gate.wake_max_tokens",)
    assert router_side(spec(16), spec(8)).gate.wake_max_tokens == 16, "judged by the canary it recorded until then"
