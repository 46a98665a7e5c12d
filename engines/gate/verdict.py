"""The promotion gate: a canary generation compared with the engine's own cold-boot baseline.

After a Level-2 wake vLLM reloads only the target model; a draft that was not restored
proposes garbage, every draft token is rejected, and decode runs at about half speed while
outputs stay correct (vLLM #52479). The gate catches that by the canary's mean acceptance
length (`engines.gate.canary`), and compares the canary's output with the baseline's (a target
that was not reloaded answers gibberish) and its per-token logprobs (`engines.gate.drift`: a
target that came back numerically wrong while its tokens still match).
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from config.schema import Gate
from engines.gate.canary import FROM_ANSWER, FROM_COUNTERS, Canary, Counters, mean_acceptance_length
from engines.gate.drift import Drift, describe, logprob_drift


@dataclass(frozen=True)
class Verdict:
    passed: bool
    result: str  # "baseline" | "passed" | "refused" | "allowed" | "skipped"
    reason: str
    baseline_mal: Optional[float] = None
    observed_mal: Optional[float] = None
    output_match: Optional[bool] = None
    seconds: float = 0.0
    at: float = field(default_factory=time.time)
    acceptance_source: Optional[str] = None  # where observed_mal came from: FROM_ANSWER | FROM_COUNTERS
    # Mean |logprob change| from the baseline over `logprob_tokens` tokens (at cold boot: between its two
    # canaries, the engine's own spread); None when not measured (gate.max_logprob_drift null, no logprobs).
    logprob_drift: Optional[float] = None
    logprob_drift_largest: Optional[float] = None
    logprob_tokens: Optional[int] = None
    # Which canary was judged: "full" (gate.max_tokens) or "wake" (gate.wake_max_tokens, after a wake
    # that moved no weights from disk), and the tokens it decoded; None when no canary ran.
    canary: Optional[str] = None
    canary_tokens: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def allowed(self) -> "Verdict":
        return replace(self, passed=True, result="allowed", reason=f"promoted despite: {self.reason}")


def skipped(reason: str) -> Verdict:
    return Verdict(passed=True, result="skipped", reason=reason)


class MidlifeWatch:
    """The acceptance watch while an engine serves: MAL over the last `midlife_window_s` seconds of
    traffic, judged like a canary against the cold-boot baseline. Pure bookkeeping (the engine
    scrapes its counters, the proxy hands over the numbers answers carry; this counts), so the
    arithmetic is the canary's own. Answers that carried their own numbers in the window are
    judged by those alone (exactly the served traffic); without any, the counter deltas."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.collapsed = False
        self.last_collapse: Optional[dict[str, Any]] = None  # kept across the restart that remedies it
        self.source: Optional[str] = None  # of the window's last MAL: FROM_ANSWER | FROM_COUNTERS
        self.last: Optional[dict[str, Any]] = None  # the window's last judgement: observed_mal, drafts, source, at
        self._samples: collections.deque[tuple[float, Counters]] = collections.deque()
        self._answers: collections.deque[tuple[float, int, int]] = collections.deque()
        self._answer_steps = 0  # running sums over _answers, so neither side walks the window
        self._answer_accepted = 0

    def reset(self) -> None:
        """A fresh process (or a verified wake): its counters and acceptance start over."""
        self._samples.clear()
        self._answers.clear()
        self._answer_steps = self._answer_accepted = 0
        self.collapsed = False

    def answered(self, now: float, steps: int, accepted: int) -> None:
        """One served answer's own numbers (called on the proxy's path: O(1) amortized). Trimmed here
        too: nothing may grow while no scrape judges (gate disabled, no baseline yet)."""
        self._answers.append((now, steps, accepted))
        self._answer_steps += steps
        self._answer_accepted += accepted
        self._trim_answers(now - self.gate.midlife_window_s)

    def _trim_answers(self, since: float) -> None:
        while self._answers and self._answers[0][0] < since:
            _, steps, accepted = self._answers.popleft()
            self._answer_steps -= steps
            self._answer_accepted -= accepted

    def _window(self, now: float, counters: Counters) -> tuple[float, float, str]:
        since = now - self.gate.midlife_window_s
        self._samples.append((now, counters))
        while self._samples[0][0] < since:
            self._samples.popleft()
        self._trim_answers(since)
        if self._answers:
            return self._answer_steps, self._answer_accepted, FROM_ANSWER
        first = self._samples[0][1]
        return counters.drafts - first.drafts, counters.accepted - first.accepted, FROM_COUNTERS

    def observe(self, now: float, counters: Counters, baseline_mal: float) -> tuple[Optional[float], list[str]]:
        """Take one scrape: the window's MAL (None while it holds fewer than midlife_min_drafts
        drafts) and what is wrong with it. `collapsed` follows; `last_collapse` records each new one."""
        drafts, accepted, source = self._window(now, counters)
        if drafts < self.gate.midlife_min_drafts:
            return None, []
        mal = mean_acceptance_length(drafts, accepted)
        self.source = source
        self.last = {"observed_mal": mal, "drafts": drafts, "source": source, "at": time.time()}
        problems = acceptance_problems(baseline_mal, mal, self.gate)
        if problems and not self.collapsed:
            self.last_collapse = {"reason": "; ".join(problems), "observed_mal": mal, "at": time.time(), "source": source}
        self.collapsed = bool(problems)
        return mal, problems


def judge(baseline: Canary, observed: Canary, gate: Gate) -> Verdict:
    """Compare a canary after a wake with the cold-boot baseline. Refusal reasons carry the numbers."""
    problems = []
    output_match = _output_matches(baseline.text, observed.text, gate.output_check)
    if not observed.text.strip():
        problems.append("the canary produced no output")
    elif output_match is False:
        problems.append(_output_difference(baseline.text, observed.text, gate.output_check))
    if baseline.mal is not None:
        problems += acceptance_problems(baseline.mal, observed.mal, gate)
    drift, drifted = drift_problems(baseline, observed, gate)
    problems += drifted
    return Verdict(
        passed=not problems,
        result="refused" if problems else "passed",
        reason="; ".join(problems) if problems else _summary(baseline, observed, drift),
        baseline_mal=baseline.mal,
        observed_mal=observed.mal,
        output_match=output_match,
        seconds=observed.seconds,
        acceptance_source=observed.source,
        canary="full",
        canary_tokens=observed.tokens,
        **_drift_fields(drift),
    )


def drift_problems(baseline: Canary, observed: Canary, gate: Gate) -> tuple[Optional[Drift], list[str]]:
    """The observed canary's logprob drift from the baseline, and the refusal it earns past
    gate.max_logprob_drift. Not measured when the key is null or the baseline has no logprobs (an
    engine that does not return them); an engine that returned them at boot and not now is refused."""
    if gate.max_logprob_drift is None or baseline.token_logprobs is None or baseline.token_texts is None:
        return None, []
    if observed.token_logprobs is None or observed.token_texts is None:
        return None, ["the canary's answer carries no logprobs, though the cold-boot canary's did"]
    drift = logprob_drift(baseline.token_texts, baseline.token_logprobs, observed.token_texts, observed.token_logprobs)
    if drift is None or drift.mean <= gate.max_logprob_drift:
        return drift, []  # None: the first tokens differ, which the output check names
    return drift, [f"logprob drift {describe(drift, gate.max_logprob_drift)}: the target answers the same tokens with "
                   "other numbers, so it came back numerically wrong (a wake bug such as vLLM #45617 or #44972)"]


def _drift_fields(drift: Optional[Drift]) -> dict[str, Any]:
    if drift is None:
        return {}
    return {"logprob_drift": drift.mean, "logprob_drift_largest": drift.largest, "logprob_tokens": drift.positions}


def judge_adapter(verdict: Verdict, adapter: str, baseline: Canary, observed: Canary, gate: Gate) -> Verdict:
    """Add the LoRA canary's output check (gate.lora_canary) to the model's verdict."""
    match = _output_matches(baseline.text, observed.text, gate.output_check)
    if observed.text.strip() and match is not False:
        return verdict
    problem = "no output" if not observed.text.strip() else _output_difference(baseline.text, observed.text, gate.output_check)
    problem = f"LoRA adapter '{adapter}': {problem}"
    reason = problem if verdict.passed else f"{verdict.reason}; {problem}"
    return replace(verdict, passed=False, result="refused", reason=reason, output_match=False, seconds=verdict.seconds + observed.seconds,
                   at=time.time())


def acceptance_problems(baseline: float, observed: Optional[float], gate: Gate) -> list[str]:
    if observed is None:
        return ["no drafts were counted during the canary (speculative decoding stopped?)"]
    problems = []
    floor = 1 + gate.min_acceptance_ratio * (baseline - 1)
    if observed - 1 < gate.min_acceptance_ratio * (baseline - 1):
        problems.append(f"mean acceptance length {observed:.2f} is below {floor:.2f} "
                        f"(min_acceptance_ratio {gate.min_acceptance_ratio:g} of the baseline {baseline:.2f}): "
                        "the draft model looks lost (vLLM #52479)")
    if observed < gate.min_acceptance_length:
        problems.append(f"mean acceptance length {observed:.2f} is below min_acceptance_length {gate.min_acceptance_length:g}")
    return problems


def _output_matches(expected: str, got: str, check: str) -> Optional[bool]:
    if check == "off":
        return None
    if check == "exact":
        return expected == got
    n = int(check.split(":", 1)[1])
    return expected[:n] == got[:n]


def _output_difference(expected: str, got: str, check: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return (f"canary output differs from the cold-boot baseline ({check}) at character {at}: "
            f"expected {expected[at:at + 24]!r}, got {got[at:at + 24]!r}")


def _summary(baseline: Canary, observed: Canary, drift: Optional[Drift]) -> str:
    if baseline.mal is None:
        text = "canary output matches the baseline (no draft model)"
    else:
        text = f"mean acceptance length {observed.mal:.2f} vs baseline {baseline.mal:.2f}{_from(observed)}; output matches"
    return text if drift is None else f"{text}; logprob drift {describe(drift)}"


def _from(canary: Canary) -> str:
    return {FROM_ANSWER: " (from the canary's own answer)", FROM_COUNTERS: " (from the engine's counters)"}.get(canary.source or "", "")


def baseline_verdict(canary: Canary, replay: Optional[Canary], gate: Gate, wake: Optional[Canary] = None) -> Verdict:
    """The cold-boot canary becomes the baseline. `replay`, a second canary right after it, measures the
    engine's own spread: a baseline it cannot reproduce within gate.max_logprob_drift would refuse every
    healthy wake (and cold-restart it each time), so the boot is refused instead, with the numbers.
    `wake`: the short wake canary's baseline (gate.wake_max_tokens), recorded beside it."""
    if canary.mal is None:
        reason = f"baseline recorded: {canary.tokens} tokens (no draft model)"
    else:
        reason = f"baseline recorded: mean acceptance length {canary.mal:.2f} over {canary.drafts:g} drafts{_from(canary)}"
    drift, problem = None, None if canary.text.strip() else "the cold-boot canary produced no output"
    if problem is None and replay is not None and canary.token_logprobs is not None and canary.token_texts is not None:
        if replay.token_logprobs is None or replay.token_texts is None:
            problem = "the second cold-boot canary carries no logprobs, though the first one's did"
        elif (drift := logprob_drift(canary.token_texts, canary.token_logprobs, replay.token_texts, replay.token_logprobs)) is None:
            reason += "; its two cold-boot canaries differ from the first token on: no logprob spread measured"
        elif gate.max_logprob_drift is not None and drift.mean > gate.max_logprob_drift:
            problem = (f"two cold-boot canaries differ by logprob drift {describe(drift, gate.max_logprob_drift)}: at that "
                       f"threshold every healthy wake would be refused; raise gate.max_logprob_drift above this engine's "
                       f"own spread {drift.mean:.2g} (docs/gate.md)")
        else:
            reason += f"; its own logprob spread {describe(drift)}"
    if problem is None and wake is not None:
        problem, reason = _wake_baseline(wake, reason)
    seconds = canary.seconds + sum(c.seconds for c in (replay, wake) if c is not None)
    return Verdict(passed=problem is None, result="baseline", reason=problem or reason, baseline_mal=canary.mal,
                   observed_mal=canary.mal, output_match=True, seconds=seconds, acceptance_source=canary.source,
                   canary="full", canary_tokens=canary.tokens, **_drift_fields(drift))


def _wake_baseline(wake: Canary, reason: str) -> tuple[Optional[str], str]:
    """The short wake canary's cold-boot run: it must have answered, and its numbers join the reason."""
    if not wake.text.strip():
        return f"the cold-boot {wake.tokens}-token wake canary produced no output", reason
    if wake.mal is None:
        return None, f"{reason}; {wake.tokens}-token wake canary recorded"
    return None, f"{reason}; {wake.tokens}-token wake canary: mean acceptance length {wake.mal:.2f} over {wake.drafts:g} drafts"
