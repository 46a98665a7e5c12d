"""The promotion gate: a canary generation compared with the engine's own cold-boot baseline.

After a Level-2 wake vLLM reloads only the target model; a draft that was not restored
proposes garbage, every draft token is rejected, and decode runs at about half speed while
outputs stay correct (vLLM #52479). The gate catches that by measuring the mean acceptance
length of a fixed canary,

    MAL = 1 + d(accepted) / d(drafts)

from the engine's own `vllm:spec_decode_*` counters around it, and by comparing the
canary's output with the baseline's (a target that was not reloaded answers gibberish).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

from prometheus_client.parser import text_string_to_metric_families

from config.schema import Gate
from engines.client import EngineError, VLLMClient

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
GENERATED = "vllm:generation_tokens"
COUNTER_WAIT_S = 10.0  # vLLM's counters can lag a finished response by a scheduler step or two
POLL_S = 0.05


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
    drafts: float
    accepted: float
    seconds: float


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def allowed(self) -> "Verdict":
        return Verdict(True, "allowed", f"promoted despite: {self.reason}", self.baseline_mal, self.observed_mal, self.output_match, self.seconds, self.at)


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


async def run_canary(client: VLLMClient, model: str, gate: Gate, has_draft: bool, timeout: float) -> Canary:
    """One canary generation with the counter deltas around it. Nothing else may run on the engine."""
    started = time.monotonic()
    before = read_counters(await client.metrics(timeout=timeout))
    if has_draft and not before.has_spec:
        raise GateError("GET /metrics", f"no {DRAFTS}_total / {ACCEPTED}_total counters: is speculative decoding on, "
                                        "and --disable-log-stats off?")
    body = {"model": model, "prompt": gate.prompt, "max_tokens": gate.max_tokens, "temperature": 0, "ignore_eos": True}
    answer = await client.completion(body, timeout=timeout)
    try:
        text = answer["choices"][0]["text"] or ""
        tokens = int(answer["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise GateError("POST /v1/completions", f"canary answer has no choices[0].text / usage: {str(answer)[:200]}") from None
    after = await _landed(client, before, tokens, has_draft, started + timeout)
    drafts, accepted = after.drafts - before.drafts, after.accepted - before.accepted
    mal = mean_acceptance_length(drafts, accepted) if has_draft else None
    return Canary(text, tokens, mal, drafts, accepted, time.monotonic() - started)


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
    traffic, judged like a canary against the cold-boot baseline. Pure bookkeeping over counter
    samples (the engine scrapes, this counts), so the arithmetic is the canary's own."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.collapsed = False
        self.last_collapse: Optional[dict[str, Any]] = None  # kept across the restart that remedies it
        self._samples: collections.deque[tuple[float, Counters]] = collections.deque()

    def reset(self) -> None:
        """A fresh process (or a verified wake): its counters and acceptance start over."""
        self._samples.clear()
        self.collapsed = False

    def observe(self, now: float, counters: Counters, baseline_mal: float) -> tuple[Optional[float], list[str]]:
        """Take one scrape: the window's MAL (None while it holds fewer than midlife_min_drafts
        drafts) and what is wrong with it. `collapsed` follows; `last_collapse` records each new one."""
        self._samples.append((now, counters))
        while self._samples[0][0] < now - self.gate.midlife_window_s:
            self._samples.popleft()
        first = self._samples[0][1]
        drafts = counters.drafts - first.drafts
        if drafts < self.gate.midlife_min_drafts:
            return None, []
        mal = mean_acceptance_length(drafts, counters.accepted - first.accepted)
        problems = acceptance_problems(baseline_mal, mal, self.gate)
        if problems and not self.collapsed:
            self.last_collapse = {"reason": "; ".join(problems), "observed_mal": mal, "at": time.time()}
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
    )


def judge_adapter(verdict: Verdict, adapter: str, baseline: Canary, observed: Canary, gate: Gate) -> Verdict:
    """Add the LoRA canary's output check (gate.lora_canary) to the model's verdict."""
    match = _output_matches(baseline.text, observed.text, gate.output_check)
    if observed.text.strip() and match is not False:
        return verdict
    problem = "no output" if not observed.text.strip() else _output_difference(baseline.text, observed.text, gate.output_check)
    problem = f"LoRA adapter '{adapter}': {problem}"
    reason = problem if verdict.passed else f"{verdict.reason}; {problem}"
    return Verdict(False, "refused", reason, verdict.baseline_mal, verdict.observed_mal, False, verdict.seconds + observed.seconds)


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
    return f"mean acceptance length {observed.mal:.2f} vs baseline {baseline.mal:.2f}; output matches"


def baseline_verdict(canary: Canary) -> Verdict:
    if canary.mal is None:
        reason = f"baseline recorded: {canary.tokens} tokens (no draft model)"
    else:
        reason = f"baseline recorded: mean acceptance length {canary.mal:.2f} over {canary.drafts:g} drafts"
    return Verdict(passed=bool(canary.text.strip()), result="baseline", reason=reason if canary.text.strip() else
                   "the cold-boot canary produced no output", baseline_mal=canary.mal, observed_mal=canary.mal,
                   output_match=True, seconds=canary.seconds)
