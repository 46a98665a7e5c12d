"""The canary: one fixed greedy generation, and what it measured.

`run_canary` sends it and reads its mean acceptance length,

    MAL = 1 + d(accepted) / d(drafts)

from the canary's own answer when it reports it (`metrics.speculative_decoding`, which
vLLM adds with --per-request-spec-decode-metrics, a router-owned flag), else from the
engine's `vllm:spec_decode_*` counters around it (then nothing else may run on the engine:
the counters are engine-wide). Judging it against the baseline is `engines.gate`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from prometheus_client.parser import text_string_to_metric_families

from config.schema import Gate
from engines.vllm.client import EngineError, VLLMClient

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
    # Each generated token's text and logprob (vLLM's choices[0].logprobs); None when not asked for.
    token_texts: Optional[tuple[str, ...]] = None
    token_logprobs: Optional[tuple[float, ...]] = None


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


async def run_canary(client: VLLMClient, model: str, gate: Gate, has_draft: bool, timeout: float,
                     logprobs: bool = False, max_tokens: Optional[int] = None) -> Canary:
    """One canary generation and its acceptance: the answer's own numbers when it carries them (decided per
    answer), else the counter deltas around it, for which nothing else may run on the engine. `logprobs`:
    ask for each generated token's logprob too (`"logprobs": 0` is the sampled token's alone). `max_tokens`:
    the short wake canary's length (gate.wake_max_tokens) instead of gate.max_tokens."""
    started = time.monotonic()
    before = read_counters(await client.metrics(timeout=timeout))
    body = {"model": model, "prompt": gate.prompt, "max_tokens": max_tokens or gate.max_tokens, "temperature": 0,
            "ignore_eos": True}
    if logprobs:
        body["logprobs"] = 0
    answer = await client.completion(body, timeout=timeout)
    try:
        text = answer["choices"][0]["text"] or ""
        tokens = int(answer["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise GateError("POST /v1/completions", f"canary answer has no choices[0].text / usage: {str(answer)[:200]}") from None
    texts, lps = _token_logprobs(answer["choices"][0].get("logprobs")) if logprobs else (None, None)
    if not has_draft:
        return Canary(text, tokens, None, 0.0, 0.0, time.monotonic() - started, token_texts=texts, token_logprobs=lps)
    metrics = answer.get("metrics") if isinstance(answer, dict) else None
    own = spec_counts(metrics.get("speculative_decoding")) if isinstance(metrics, dict) else None
    if own is not None:
        steps, accepted = own
        return Canary(text, tokens, mean_acceptance_length(steps, accepted), steps, accepted, time.monotonic() - started,
                      FROM_ANSWER, texts, lps)
    if not before.has_spec:
        raise GateError("GET /metrics", f"the canary's answer has no metrics.speculative_decoding and /metrics has no "
                                        f"{DRAFTS}_total / {ACCEPTED}_total counters: is speculative decoding on, and, for an "
                                        "engine the router does not compose (command: or url:), --per-request-spec-decode-metrics "
                                        "summary set or --disable-log-stats off?")
    after = await _landed(client, before, tokens, has_draft, started + timeout)
    drafts, accepted = after.drafts - before.drafts, after.accepted - before.accepted
    return Canary(text, tokens, mean_acceptance_length(drafts, accepted), drafts, accepted, time.monotonic() - started,
                  FROM_COUNTERS, texts, lps)


def _token_logprobs(logprobs: Any) -> tuple[Optional[tuple[str, ...]], Optional[tuple[float, ...]]]:
    """(tokens, token_logprobs) of a completion choice's `logprobs` (vLLM 0.32: CompletionLogProbs,
    vllm/entrypoints/openai/completion/protocol.py:647), or (None, None) when the engine sent none: an
    engine that ignores the field is judged without them. A shape that is neither is an error."""
    if logprobs is None:
        return None, None
    texts = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if (not isinstance(texts, list) or not isinstance(values, list) or len(texts) != len(values)
            or not all(isinstance(t, str) for t in texts)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise GateError("POST /v1/completions", "canary answer's choices[0].logprobs is not equally long `tokens` (strings) "
                                                f"and `token_logprobs` (numbers) lists: {str(logprobs)[:200]}")
    return tuple(texts), tuple(float(v) for v in values)


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
