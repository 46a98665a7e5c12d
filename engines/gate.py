"""The promotion gate: a canary generation compared with the engine's own cold-boot baseline.

After a Level-2 wake vLLM reloads only the target model; a draft that was not restored
proposes garbage, every draft token is rejected, and decode runs at about half speed while
outputs stay correct (vLLM #52479). The gate catches that by measuring the mean acceptance
length of a fixed canary,

    MAL = 1 + d(accepted) / d(drafts)

from the canary's own answer when it reports it (`metrics.speculative_decoding`, which
vLLM adds with --per-request-spec-decode-metrics, a router-owned flag), else from the
engine's `vllm:spec_decode_*` counters around it (then nothing else may run on the engine:
the counters are engine-wide), and by comparing the canary's output with the baseline's (a
target that was not reloaded answers gibberish).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, Optional

from prometheus_client.parser import text_string_to_metric_families

from config.schema import Gate
from engines.client import EngineError, VLLMClient

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
GENERATED = "vllm:generation_tokens"
COUNTER_WAIT_S = 10.0  # vLLM's counters can lag a finished response by a scheduler step or two
POLL_S = 0.05
# Where a mean acceptance length came from: the answer's own numbers, or the counter deltas around it.
FROM_ANSWER = "answer"
FROM_COUNTERS = "counters"
_SPEC_KEY = b'"speculative_decoding":'  # JSON escapes a quote inside a string, so generated text cannot match
_DECODER = json.JSONDecoder()


class GateError(EngineError):
    """The canary could not be run or measured (not a refusal: the engine could not be judged)."""


class Counters(NamedTuple):
    generated: float
    drafts: float
    accepted: float
    has_spec: bool


@dataclass(frozen=True)
class Canary:
    text: str
    tokens: int
    mal: Optional[float]  # None for a model without a draft
    drafts: float  # verify steps (vLLM's num_drafts counter; num_spec_steps in an answer)
    accepted: float
    seconds: float
    source: Optional[str] = None  # FROM_ANSWER | FROM_COUNTERS; None without a draft


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def allowed(self) -> "Verdict":
        return replace(self, passed=True, result="allowed", reason=f"promoted despite: {self.reason}")


def skipped(reason: str) -> Verdict:
    return Verdict(passed=True, result="skipped", reason=reason)


def read_counters(exposition: str) -> Counters:
    """Sum the counters the gate needs over every `engine` label (data-parallel engines)."""
    totals = {GENERATED: 0.0, DRAFTS: 0.0, ACCEPTED: 0.0}
    seen = set()
    try:
        for family in text_string_to_metric_families(exposition):
            # A typed counter's family drops `_total`; an untyped one (no `# TYPE` line) keeps it.
            name = family.name.removesuffix("_total")
            if name in totals:
                seen.add(name)
                totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    except ValueError as exc:  # the parser's word for text that is not Prometheus exposition
        raise GateError("GET /metrics", f"the answer is not Prometheus text ({exc}): {exposition[:120]!r}") from None
    return Counters(totals[GENERATED], totals[DRAFTS], totals[ACCEPTED], DRAFTS in seen and ACCEPTED in seen)


def spec_counts(numbers: Any) -> Optional[tuple[int, int]]:
    """(verify steps, accepted draft tokens) from an answer's `metrics.speculative_decoding`
    (vLLM 0.32: vllm/entrypoints/generate/base/protocol.py:100, filled by
    vllm/v1/metrics/stats.py:393), or None when it does not carry them in that shape."""
    if not isinstance(numbers, dict):
        return None
    steps, accepted = numbers.get("num_spec_steps"), numbers.get("num_accepted_draft_tokens")
    if type(steps) is not int or type(accepted) is not int or steps < 0 or not 0 <= accepted:
        return None
    return steps, accepted


def answer_spec_counts(payload: bytes) -> Optional[tuple[int, int]]:
    """spec_counts of a raw answer (a JSON body, or the tail of an SSE stream whose final usage
    event carries the metrics), without parsing the rest of it: the proxy calls this on every answer."""
    at = payload.rfind(_SPEC_KEY)
    if at < 0:
        return None
    try:
        numbers, _ = _DECODER.raw_decode(payload[at + len(_SPEC_KEY):].decode("utf-8").lstrip())
    except (ValueError, UnicodeDecodeError):  # a tail cut inside the event: this answer just goes uncounted
        return None
    return spec_counts(numbers)


async def run_canary(client: VLLMClient, model: str, gate: Gate, has_draft: bool, timeout: float) -> Canary:
    """One canary generation and its acceptance: the answer's own numbers when it carries them (decided per
    answer), else the counter deltas around it, for which nothing else may run on the engine."""
    started = time.monotonic()
    before = read_counters(await client.metrics(timeout=timeout))
    body = {"model": model, "prompt": gate.prompt, "max_tokens": gate.max_tokens, "temperature": 0, "ignore_eos": True}
    answer = await client.completion(body, timeout=timeout)
    try:
        text = answer["choices"][0]["text"] or ""
        tokens = int(answer["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise GateError("POST /v1/completions", f"canary answer has no choices[0].text / usage: {str(answer)[:200]}") from None
    if not has_draft:
        return Canary(text, tokens, None, 0.0, 0.0, time.monotonic() - started)
    metrics = answer.get("metrics") if isinstance(answer, dict) else None
    own = spec_counts(metrics.get("speculative_decoding")) if isinstance(metrics, dict) else None
    if own is not None:
        steps, accepted = own
        return Canary(text, tokens, mean_acceptance_length(steps, accepted), steps, accepted, time.monotonic() - started, FROM_ANSWER)
    if not before.has_spec:
        raise GateError("GET /metrics", f"the canary's answer has no metrics.speculative_decoding and /metrics has no "
                                        f"{DRAFTS}_total / {ACCEPTED}_total counters: is speculative decoding on, and, for an "
                                        "engine the router does not compose (command: or url:), --per-request-spec-decode-metrics "
                                        "summary set or --disable-log-stats off?")
    after = await _landed(client, before, tokens, has_draft, started + timeout)
    drafts, accepted = after.drafts - before.drafts, after.accepted - before.accepted
    return Canary(text, tokens, mean_acceptance_length(drafts, accepted), drafts, accepted, time.monotonic() - started, FROM_COUNTERS)


async def _landed(client: VLLMClient, before: Counters, tokens: int, has_draft: bool, deadline: float) -> Counters:
    """Poll /metrics until this canary's tokens (and drafts) show in the counters."""
    wait_until = min(deadline, time.monotonic() + COUNTER_WAIT_S)
    while True:
        after = read_counters(await client.metrics(timeout=max(0.1, deadline - time.monotonic())))
        if after.generated - before.generated >= tokens and (not has_draft or after.drafts > before.drafts):
            return after
        if time.monotonic() >= wait_until:
            moved = f"generation tokens +{after.generated - before.generated:g} of {tokens}, drafts +{after.drafts - before.drafts:g}"
            raise GateError("GET /metrics", f"counters did not take in the canary within {COUNTER_WAIT_S:g} s ({moved})")
        await asyncio.sleep(POLL_S)


def mean_acceptance_length(drafts: float, accepted: float) -> Optional[float]:
    """MAL = 1 + d(accepted) / d(drafts): tokens each verification step yields; None without drafts."""
    return 1.0 + accepted / drafts if drafts > 0 else None


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
    return Verdict(
        passed=not problems,
        result="refused" if problems else "passed",
        reason="; ".join(problems) if problems else _summary(baseline, observed),
        baseline_mal=baseline.mal,
        observed_mal=observed.mal,
        output_match=output_match,
        seconds=observed.seconds,
        acceptance_source=observed.source,
    )


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


def _summary(baseline: Canary, observed: Canary) -> str:
    if baseline.mal is None:
        return "canary output matches the baseline (no draft model)"
    return f"mean acceptance length {observed.mal:.2f} vs baseline {baseline.mal:.2f}{_from(observed)}; output matches"


def _from(canary: Canary) -> str:
    return {FROM_ANSWER: " (from the canary's own answer)", FROM_COUNTERS: " (from the engine's counters)"}.get(canary.source or "", "")


def baseline_verdict(canary: Canary) -> Verdict:
    if canary.mal is None:
        reason = f"baseline recorded: {canary.tokens} tokens (no draft model)"
    else:
        reason = f"baseline recorded: mean acceptance length {canary.mal:.2f} over {canary.drafts:g} drafts{_from(canary)}"
    return Verdict(passed=bool(canary.text.strip()), result="baseline", reason=reason if canary.text.strip() else
                   "the cold-boot canary produced no output", baseline_mal=canary.mal, observed_mal=canary.mal,
                   output_match=True, seconds=canary.seconds, acceptance_source=canary.source)
