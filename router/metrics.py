"""The router's Prometheus metrics. Names start with `hotswap_`; labels come from the roster only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.engine import Engine, Observer, State
from engines.gate import Verdict

if TYPE_CHECKING:
    from router.app import Router
    from router.scheduler import SwapRecord

UNKNOWN_MODEL = "_unknown"  # requests naming no roster model share one label value
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SWAP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics(Observer):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hotswap_requests", "Proxied requests by model, endpoint and HTTP status.", ["model", "endpoint", "status"], registry=r)
        self.latency = Histogram("hotswap_request_duration_seconds", "Request latency, streaming included, as the router saw it.", ["model", "endpoint", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("hotswap_queue_wait_seconds", "Time a request waited for its model to be awake.", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.swaps = Counter("hotswap_swaps", "Swaps by group, from, to and result.", ["group", "from_model", "to_model", "result"], registry=r)
        self.swap_seconds = Histogram("hotswap_swap_duration_seconds", "Whole swap duration.", ["group"], buckets=SWAP_BUCKETS, registry=r)
        self.phase_seconds = Histogram("hotswap_swap_phase_duration_seconds", "Duration of each sleep/wake step.", ["model", "phase"], buckets=SWAP_BUCKETS, registry=r)
        self.step_failures = Counter("hotswap_swap_phase_failures", "Sleep/wake steps that failed.", ["model", "phase"], registry=r)
        self.verdicts = Counter("hotswap_gate_verdicts", "Promotion gate verdicts.", ["model", "result"], registry=r)
        self.restarts = Counter("hotswap_engine_restarts", "Engine cold restarts by reason (failed, gate, midlife, admin).", ["model", "reason"], registry=r)
        self.collapses = Counter("hotswap_midlife_collapses", "Acceptance collapses detected while serving.", ["model"], registry=r)
        self.transitions = Counter("hotswap_engine_transitions", "Engine state transitions.", ["model", "to_state"], registry=r)

    def attach(self, router: "Router") -> None:
        self.registry.register(_LiveState(router))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- Observer ----------------------------------------------------------------------------

    def state_changed(self, engine: Engine, old: State, new: State) -> None:
        self.transitions.labels(engine.name, new.value).inc()

    def step_done(self, engine: Engine, phase: str, seconds: float, ok: bool) -> None:
        self.phase_seconds.labels(engine.name, phase).observe(seconds)
        if not ok:
            self.step_failures.labels(engine.name, phase).inc()

    def verdict(self, engine: Engine, verdict: Verdict) -> None:
        self.verdicts.labels(engine.name, verdict.result).inc()

    def restarted(self, engine: Engine, reason: str) -> None:
        self.restarts.labels(engine.name, reason).inc()

    def midlife_collapse(self, engine: Engine, observed_mal: float, reason: str) -> None:
        self.collapses.labels(engine.name).inc()

    def swap_done(self, record: "SwapRecord") -> None:
        self.swaps.labels(record.group, record.from_model or "", record.to_model, record.result).inc()
        self.swap_seconds.labels(record.group).observe(record.seconds)


class _LiveState(Collector):
    """Gauges read at scrape time from the engines themselves, so they can never drift."""

    def __init__(self, router: "Router"):
        self.router = router

    def collect(self) -> Iterable[GaugeMetricFamily]:
        state = GaugeMetricFamily("hotswap_engine_state", "1 for the state each engine is in.", labels=["model", "group", "state"])
        in_flight = GaugeMetricFamily("hotswap_in_flight_requests", "Requests being served per model.", labels=["model"])
        queued = GaugeMetricFamily("hotswap_queued_requests", "Requests waiting for their model per model.", labels=["model"])
        baseline = GaugeMetricFamily("hotswap_acceptance_baseline", "Mean acceptance length of the cold-boot canary.", labels=["model"])
        observed = GaugeMetricFamily("hotswap_acceptance_observed", "Last observed mean acceptance length (gate or mid-life watch).", labels=["model"])
        for engine in self.router.engines.values():
            if engine.baseline is not None and engine.baseline.mal is not None:
                baseline.add_metric([engine.name], engine.baseline.mal)
            if engine.observed_mal is not None:
                observed.add_metric([engine.name], engine.observed_mal)
            for s in State:
                state.add_metric([engine.name, engine.spec.group, s.value], 1.0 if engine.state is s else 0.0)
            in_flight.add_metric([engine.name], engine.in_flight)
            queued.add_metric([engine.name], self.router.scheduler(engine).queued(engine))
        return [state, in_flight, queued, baseline, observed]
