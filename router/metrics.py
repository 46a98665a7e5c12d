"""The router's Prometheus metrics. Names start with `hotswap_`; label values come from the roster only.

Counters and histograms are updated as things happen (the engines report through the
Observer interface); gauges that describe current state are read from the engines at
scrape time, so they can never drift from what the router actually holds.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.engine import Engine, Observer, State
from engines.gate import Verdict
from router.scheduling import Events, Scheduler, SwapRecord, devices_view


class Served(Protocol):
    """What the gauges read at scrape time (`router.live.Router`)."""

    engines: dict[str, Engine]
    placement: Scheduler


UNKNOWN_MODEL = "_unknown"  # requests naming no roster model share one label value
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SWAP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BOOT_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200)
RATIO_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2, 4)
# Nats: from float32 noise to a wrong model, with the steps near the shipped threshold (0.05) fine.
DRIFT_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
EVICTION_REASONS = ("room", "idle", "admin", "boot", "demote", "stop", "preempt")
RESUME_REASONS = ("drain_deadline", "engine_failed", "restart", "preempted", "migrated")
CUT_REASONS = ("n", "tools", "reasoning", "structured_output", "penalties", "bad_words", "truncation", "media", "shape",
               "mid_event", "no_token_ids", "engine_error", "malformed", "mismatch", "detokenize", "wait", "too_many", "engine_failed")
AHEAD_OUTCOMES = ("woken", "used", "unused", "failed")
RESTART_REASONS = ("failed", "gate", "midlife", "admin", "roster")


def group_of(engine: Engine) -> str:
    return engine.spec.group or ""  # no group: the label is empty (Prometheus treats it as absent)


class Metrics(Observer, Events):
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created twin of every series doubles the count for nothing
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model", "group"]
        self.requests = Counter("hotswap_requests", "Proxied requests by model, endpoint and HTTP status.",
                                ["model", "endpoint", "status"], registry=r)
        self.latency = Histogram("hotswap_request_duration_seconds", "Request latency as the router saw it, streams to their end.",
                                 ["model", "endpoint", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("hotswap_request_ttfb_seconds", "Time to first byte of the answer (queue wait and swap included).",
                              ["model", "endpoint", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("hotswap_queue_wait_seconds", "Time a request waited for its model to be awake.",
                                    m, buckets=LATENCY_BUCKETS, registry=r)
        self.swaps = Counter("hotswap_swaps", "Swaps by group, from, to and result.", ["group", "from_model", "to_model", "result"], registry=r)
        self.swap_seconds = Histogram("hotswap_swap_duration_seconds", "Whole swap duration, drain to promotion.",
                                      ["group", "to_model", "result"], buckets=SWAP_BUCKETS, registry=r)
        self.phase_seconds = Histogram("hotswap_swap_phase_duration_seconds", "Duration of each sleep/wake step and of the gate.",
                                       [*m, "phase"], buckets=SWAP_BUCKETS, registry=r)
        self.phase_failures = Counter("hotswap_swap_phase_failures", "Sleep/wake steps that failed (the engine went FAILED).",
                                      [*m, "phase"], registry=r)
        # Apart from the step failures, whose alert pages: a failed stage fails nothing, its reload reads the disk.
        self.stage_failures = Counter("hotswap_stage_failures", "Stages (a Level-2 wake's checkpoint read into the page "
                                      "cache first) that failed or timed out; the wake went on.", m, registry=r)
        self.boot_failures = Counter("hotswap_engine_boot_failures", "Cold boots that did not end in a promoted engine.", m, registry=r)
        self.boot_seconds = Histogram("hotswap_engine_boot_duration_seconds", "Cold boot to healthy, per engine.", m,
                                      buckets=BOOT_BUCKETS, registry=r)
        self.verdicts = Counter("hotswap_gate_verdicts", "Promotion gate verdicts (baseline, passed, refused, allowed, skipped).",
                                [*m, "result"], registry=r)
        self.drift = Histogram("hotswap_gate_logprob_drift", "Each judged canary's mean per-token logprob change from the "
                               "cold-boot baseline, in nats (gate.max_logprob_drift refuses past it).", m, buckets=DRIFT_BUCKETS,
                               registry=r)
        self.restarts = Counter("hotswap_engine_restarts", "Engine cold restarts by reason (failed, gate, midlife, admin, "
                                "roster: its entry changed in a reload).",
                                [*m, "reason"], registry=r)
        self.collapses = Counter("hotswap_midlife_collapses", "Acceptance collapses detected while serving.", m, registry=r)
        self.wake_ahead = Counter("hotswap_wake_ahead", "Wakes ahead of demand (swap.wake_ahead) by outcome: woken (decided), "
                                  "used (it served a request), unused (parked before it did), failed.", [*m, "outcome"], registry=r)
        self.evictions = Counter("hotswap_evictions", "Engines moved out of the way, by reason (room, idle, admin, boot, "
                                 "demote: level 1 -> 2 for host RAM, stop: asleep -> cold).", [*m, "reason"], registry=r)
        self.wake_ratio = Histogram("hotswap_wake_actual_over_predicted", "A wake's actual seconds over the seconds "
                                    "predicted for it (1.0: the estimate was right).", m, buckets=RATIO_BUCKETS, registry=r)
        self.resumed = Counter("hotswap_streams_resumed", "Answers paused and resumed, by why they were paused (drain_deadline, "
                               "engine_failed, restart, preempted, migrated).", ["model", "reason"], registry=r)
        self.pause_seconds = Histogram("hotswap_stream_pause_seconds", "Each resumed answer's pause: from its cut until its "
                                       "model served it again.", ["model"], buckets=SWAP_BUCKETS, registry=r)
        self.cut = Counter("hotswap_streams_cut", "Answers cut that could not be resumed, by why not (n, tools, "
                           "structured_output, shape, mid_event, wait, too_many, ...).", ["model", "reason"], registry=r)
        self.key_requests = Counter("hotswap_key_requests", "Proxied requests by the name of the client key (auth.keys[].name; "
                                    "never the key), model and HTTP status.", ["key_name", "model", "status"], registry=r)
        # labels() takes a lock and validates on every call; the request path reuses the children.
        self._per_request: dict[tuple[str, str, str], tuple] = {}
        self._per_status: dict[tuple[str, str, int], Any] = {}
        self._per_key: dict[tuple[str, str, int], Any] = {}

    def request_done(self, model: str, group: str, endpoint: str, stream: str, status: int, queued_s: Optional[float],
                     first_byte_s: float, total_s: float, key: str = "") -> None:
        children = self._per_request.get((model, endpoint, stream))
        if children is None:
            children = self._per_request[(model, endpoint, stream)] = (
                self.latency.labels(model, endpoint, stream), self.ttfb.labels(model, endpoint, stream),
                self.queue_wait.labels(model, group))
        latency, ttfb, queue_wait = children
        counter = self._per_status.get((model, endpoint, status))
        if counter is None:
            counter = self._per_status[(model, endpoint, status)] = self.requests.labels(model, endpoint, str(status))
        counter.inc()
        if key:  # "": client auth is off
            per_key = self._per_key.get((key, model, status))
            if per_key is None:
                per_key = self._per_key[(key, model, status)] = self.key_requests.labels(key, model, str(status))
            per_key.inc()
        latency.observe(total_s)
        ttfb.observe(first_byte_s)
        if queued_s is not None:
            queue_wait.observe(queued_s)

    def attach(self, router: Served) -> None:
        self.registry.register(_LiveState(router))
        for engine in router.engines.values():
            self.engine_added(engine)

    def engine_added(self, engine: Engine) -> None:
        """Its series exist from the start, so increase() sees the first event."""
        labels = (engine.name, group_of(engine))
        self.collapses.labels(*labels)
        for reason in EVICTION_REASONS:
            self.evictions.labels(*labels, reason)
        for outcome in AHEAD_OUTCOMES:
            self.wake_ahead.labels(*labels, outcome)
        self.boot_failures.labels(*labels)
        for phase in engine.phases:
            if phase != "stage":
                self.phase_failures.labels(*labels, phase)
        self.stage_failures.labels(*labels)
        for reason in RESTART_REASONS:
            self.restarts.labels(*labels, reason)
        for result in ("refused", "allowed"):
            self.verdicts.labels(*labels, result)
        for reason in RESUME_REASONS:
            self.resumed.labels(engine.name, reason)
        self.pause_seconds.labels(engine.name)
        for reason in CUT_REASONS:
            self.cut.labels(engine.name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- Observer ----------------------------------------------------------------------------

    def step_done(self, engine: Engine, phase: str, seconds: float, ok: bool) -> None:
        labels = (engine.name, group_of(engine))
        if phase == "boot":
            (self.boot_seconds.labels(*labels).observe(seconds) if ok else self.boot_failures.labels(*labels).inc())
            return
        self.phase_seconds.labels(*labels, phase).observe(seconds)
        if ok:
            return
        if phase == "stage":
            self.stage_failures.labels(*labels).inc()
        else:
            self.phase_failures.labels(*labels, phase).inc()

    def verdict(self, engine: Engine, verdict: Verdict) -> None:
        self.verdicts.labels(engine.name, group_of(engine), verdict.result).inc()
        if verdict.logprob_drift is not None and verdict.result != "baseline":  # a baseline's is its own spread
            self.drift.labels(engine.name, group_of(engine)).observe(verdict.logprob_drift)

    def restarted(self, engine: Engine, reason: str) -> None:
        self.restarts.labels(engine.name, group_of(engine), reason).inc()

    def midlife_collapse(self, engine: Engine, observed_mal: float, reason: str) -> None:
        self.collapses.labels(engine.name, group_of(engine)).inc()

    # -- Events (the scheduler) ------------------------------------------------------------------

    def swap_done(self, record: SwapRecord) -> None:
        self.swaps.labels(record.group, "+".join(record.from_models), record.to_model, record.result).inc()
        self.swap_seconds.labels(record.group, record.to_model, record.result).observe(record.seconds)
        if record.result == "ok" and record.predicted_s > 0:
            self.wake_ratio.labels(record.to_model, record.group).observe(record.seconds / record.predicted_s)

    def stream_resumed(self, model: str, reason: str, paused_s: float) -> None:
        self.resumed.labels(model, reason).inc()
        self.pause_seconds.labels(model).observe(paused_s)

    def stream_cut(self, model: str, reason: str) -> None:
        self.cut.labels(model, reason).inc()

    def evicted(self, engine: Engine, reason: str) -> None:
        self.evictions.labels(engine.name, group_of(engine), reason).inc()

    def woke_ahead(self, engine: Engine, outcome: str) -> None:
        self.wake_ahead.labels(engine.name, group_of(engine), outcome).inc()


class _LiveState(Collector):
    """Gauges read at scrape time from the engines themselves."""

    def __init__(self, router: Served):
        self.router = router

    def collect(self) -> Iterable[GaugeMetricFamily]:
        m = ["model", "group"]
        state = GaugeMetricFamily("hotswap_engine_state", "1 for the state each engine is in, 0 for the others.", labels=[*m, "state"])
        level = GaugeMetricFamily("hotswap_engine_sleep_level", "vLLM sleep level of a parked engine "
                                  "(0: KV-parked, its weights on the GPU); 0 also when not asleep: tell them apart by hotswap_engine_state.", labels=m)
        in_flight = GaugeMetricFamily("hotswap_in_flight_requests", "Requests being served, per model.", labels=m)
        queued = GaugeMetricFamily("hotswap_queued_requests", "Requests waiting for their model to be awake, per model.", labels=m)
        by_class = GaugeMetricFamily("hotswap_queued_requests_by_class", "Requests waiting for their model to be awake, "
                                     "per model and request class (interactive, batch).", labels=[*m, "class"])
        baseline = GaugeMetricFamily("hotswap_acceptance_baseline", "Mean acceptance length of the cold-boot canary.", labels=m)
        observed = GaugeMetricFamily("hotswap_acceptance_observed", "Last observed mean acceptance length (gate or mid-life watch).", labels=m)
        estimate = GaugeMetricFamily("hotswap_wake_estimate_seconds", "Predicted seconds until the model could serve "
                                     "(0 when awake): its measured wake or boot, plus a park when it does not fit yet.", labels=m)
        scheduler = self.router.placement
        now = scheduler.clock()
        for engine in self.router.engines.values():
            labels = [engine.name, group_of(engine)]
            estimate.add_metric(labels, scheduler.predicted_wait(engine, now))
            for s in State:
                state.add_metric([*labels, s.value], 1.0 if engine.state is s else 0.0)
            level.add_metric(labels, float(engine.sleep_level or 0) if engine.state is State.SLEEPING else 0.0)
            in_flight.add_metric(labels, engine.in_flight)
            queued.add_metric(labels, scheduler.queued(engine))
            for klass, count in scheduler.queued_by_class(engine).items():
                by_class.add_metric([*labels, klass], count)
            if engine.gate.baseline is not None and engine.gate.baseline.mal is not None:
                baseline.add_metric(labels, engine.gate.baseline.mal)
            if engine.gate.observed_mal is not None:
                observed.add_metric(labels, engine.gate.observed_mal)
        return [state, level, in_flight, queued, by_class, baseline, observed, estimate, *self._placement(), self._host_memory()]

    def _placement(self) -> list[GaugeMetricFamily]:
        scheduler = self.router.placement
        planned = GaugeMetricFamily("hotswap_gpu_memory_planned_ratio", "Share of each GPU held by awake engines "
                                    "(and those waking, booting or draining), as placement counts it.", labels=["device"])
        residual = GaugeMetricFamily("hotswap_gpu_memory_residual_ratio", "Share of each GPU held by sleeping engines' "
                                     "residuals (CUDA context, allocator pools).", labels=["device"])
        for view in devices_view(scheduler.ledger()):
            planned.add_metric([str(view.index)], view.planned)
            residual.add_metric([str(view.index)], view.residual)
        ram = GaugeMetricFamily("hotswap_host_ram_level1_bytes", "Host RAM the engines hold for sleep (Level-1 copies, "
                                "and what stays cached after a wake), measured, else estimated: what the budget counts.",
                                value=scheduler.level1_gb() * 1e9)
        budget = GaugeMetricFamily("hotswap_host_ram_budget_bytes", "Host RAM Level-1 sleepers may hold (host.ram_budget_gb).",
                                   value=scheduler.capacity.ram_budget_gb * 1e9)
        return [planned, residual, ram, budget]

    def _host_memory(self) -> GaugeMetricFamily:
        held = GaugeMetricFamily("hotswap_engine_host_memory_bytes", "Host RAM each engine holds for sleep as "
                                 "host.ram_budget_gb counts it: measured after its last sleep or wake (worker "
                                 "extension, else /proc), else estimated from its checkpoint.", labels=["model", "group"])
        scheduler = self.router.placement
        for engine in self.router.engines.values():
            held.add_metric([engine.name, group_of(engine)], scheduler.host_gb(engine) * 1e9)
        return held


METRICS_KEY = web.AppKey("metrics", Metrics)


async def serve_metrics(request: web.Request) -> web.Response:
    """GET /metrics, in Prometheus' text format."""
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
