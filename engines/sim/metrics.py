"""vLLM's Prometheus metrics, by their real names, on a private registry.

prometheus_client appends `_total` to counters itself, so counters are declared
without it and come out exactly as vLLM exposes them (`vllm:..._total`, plus the
`_created` series vLLM's prometheus_client also emits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class StatsDelta:
    """What one request adds to the engine's counters, applied as a unit so the
    metrics lag can hold it back."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_s: float | None = None  # from admission to the first token (vllm:request_prefill_time_seconds)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # What the request's own answer reports (vLLM's RequestSpecDecodeMetrics, vllm/v1/metrics/stats.py:350):
    # histogram[j] counts the verify steps that accepted exactly j draft tokens.
    histogram: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    def observe_step(self, k: int, accepted: int, *, detailed: bool) -> None:
        if len(self.histogram) < k + 1:
            self.histogram = [0] * (k + 1)
        self.histogram[accepted] += 1
        if detailed:
            self.per_step_accepted.append(accepted)
            self.per_step_drafted.append(k)


def answer_metrics(mode: str, k: int, d: StatsDelta) -> dict:
    """An answer's `metrics` key (merged into its JSON): `speculative_decoding` from this request's
    own steps with --per-request-spec-decode-metrics (vllm/entrypoints/openai/completion/serving.py:636),
    else nothing. `k` is 0 without a draft."""
    if mode == "none" or k == 0:
        return {}
    return {"metrics": {"speculative_decoding": spec_decoding_json(d, k)}}


def spec_decoding_json(d: StatsDelta, k: int) -> dict:
    """`metrics.speculative_decoding` of one answer, in vLLM 0.32's shape and arithmetic
    (RequestSpecDecodeMetrics.to_dict, vllm/v1/metrics/stats.py:393; the field list is
    SpeculativeDecodingMetrics, vllm/entrypoints/generate/base/protocol.py:100)."""
    histogram = d.histogram or [0] * (k + 1)
    steps = sum(histogram)
    accepted = sum(j * n for j, n in enumerate(histogram))
    out: dict = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / d.draft_tokens if d.draft_tokens else 0.0,
        "acceptance_histogram": list(histogram),
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": d.draft_tokens,
        "num_spec_tokens": k,
    }
    if d.per_step_accepted:
        out["per_step_accepted"] = list(d.per_step_accepted)
        out["per_step_drafted"] = list(d.per_step_drafted)
    return out


class EngineMetrics:
    def __init__(self, model_name: str, num_spec_tokens: int | None, log_stats: bool) -> None:
        self.registry = CollectorRegistry()
        # With --disable-log-stats vLLM builds no Prometheus stat logger at all.
        self.enabled = log_stats
        if not log_stats:
            return
        self.labels = {"model_name": model_name, "engine": "0"}
        names = ["model_name", "engine"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        )
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", names, registry=r)
        self.sleep_state = Gauge(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping.", names + ["sleep_state"], registry=r
        )
        self.sleep_op_seconds = Histogram(
            "vllm:sleep_mode_operation_duration_seconds",
            "Histogram of sleep mode operation durations in seconds.",
            names + ["operation"],
            registry=r,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", names,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0), registry=r,
        )
        for c in (self.prompt_tokens, self.generation_tokens, self.prefill_time):
            c.labels(**self.labels)
        self.spec = num_spec_tokens is not None
        if self.spec:
            self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", names, registry=r)
            self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", names, registry=r)
            self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", names, registry=r)
            self.accepted_per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                names + ["position"],
                registry=r,
            )
            for c in (self.drafts, self.draft_tokens, self.accepted):
                c.labels(**self.labels)
            for pos in range(num_spec_tokens or 0):
                self.accepted_per_pos.labels(**self.labels, position=str(pos))

    def apply(self, d: StatsDelta) -> None:
        if not self.enabled:
            return
        self.prompt_tokens.labels(**self.labels).inc(d.prompt_tokens)
        self.generation_tokens.labels(**self.labels).inc(d.generation_tokens)
        if d.prefill_s is not None:
            self.prefill_time.labels(**self.labels).observe(d.prefill_s)
        if self.spec and d.drafts:
            self.drafts.labels(**self.labels).inc(d.drafts)
            self.draft_tokens.labels(**self.labels).inc(d.draft_tokens)
            self.accepted.labels(**self.labels).inc(d.accepted)
            for pos, n in enumerate(d.accepted_per_pos):
                if n:
                    self.accepted_per_pos.labels(**self.labels, position=str(pos)).inc(n)

    def observe_sleep_op(self, operation: str, seconds: float) -> None:
        if self.enabled:
            self.sleep_op_seconds.labels(**self.labels, operation=operation).observe(seconds)

    def render(self, running: int, waiting: int, sleep_state: str) -> bytes:
        if self.enabled:
            self.running.labels(**self.labels).set(running)
            self.waiting.labels(**self.labels).set(waiting)
            for s in SLEEP_STATES:
                self.sleep_state.labels(**self.labels, sleep_state=s).set(1 if s == sleep_state else 0)
        return generate_latest(self.registry)
