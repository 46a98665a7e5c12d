"""What the Gateway API Inference Extension's endpoint picker reads of this node: GET /metrics/model-server.

The picker (llm-d-router's EPP) scrapes each pod of an InferencePool for vLLM's own series and parses
them with Prometheus' text parser; its lora-affinity scorer prefers a pod whose
`vllm:lora_requests_info{running_lora_adapters}` names the requested model. Reporting this node's awake
models there gives the stock picker awake-affinity with no plugin. What the picker parses, file by
file, and why each series is shaped as it is: docs/multi-node.md ("Inference Extension").

The router's own /metrics keeps its `hotswap_` names; this is a second registry on its own path.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.engine import Engine, State
from router.scheduling import Scheduler, most_awake

RUNNING = frozenset({State.AWAKE})  # only a promoted engine serves (DESIGN.md: engine states)
WAITING = frozenset({State.BOOTING, State.WAKING, State.VERIFYING})  # on its way to serve
LORA_LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]  # vLLM 0.32's order (v1/metrics/loggers.py)


class Node(Protocol):
    """What the exposition reads at scrape time (`router.live.Router`)."""

    engines: dict[str, Engine]
    placement: Scheduler

    def adapters(self) -> list[tuple[str, Engine, Optional[str]]]: ...


class ModelServerView(Collector):
    """vLLM's series, as one model server would report them, for the whole node."""

    def __init__(self, node: Node):
        self.node = node

    def collect(self) -> Iterable[GaugeMetricFamily]:
        node = self.node
        engines = [e for e in node.engines.values() if not e.retiring]
        # One unlabelled series per family: the picker takes the first series of a family whose
        # labels match its spec (none by default), so a per-model series would hide the others.
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting: queued for their model to wake.",
                                value=sum(node.placement.queued(e) for e in engines))
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests in flight on this node's awake engines.",
                                value=sum(e.in_flight for e in engines))
        # The router does not read its engines' KV use (a scrape of each awake engine every time the picker
        # polls, 20 times a second by default, is not worth it). 0 keeps the picker's kv-cache scorer
        # neutral between hotswap nodes, so the queue and lora-affinity scorers decide.
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "Not measured by hotswap: always 0 (docs/multi-node.md).", value=0.0)
        yield self._lora_info(engines)
        # The picker looks this family up on every scrape and counts an error when it is missing. Its
        # labels (block_size, num_gpu_blocks) differ per engine and the router does not know them: none.
        yield GaugeMetricFamily("vllm:cache_config_info", "Present for the picker; no labels (engines' KV layouts differ).",
                                value=1.0)

    def _lora_info(self, engines: list[Engine]) -> GaugeMetricFamily:
        running = [e for e in engines if e.state in RUNNING]
        waiting = [e for e in engines if e.state in WAITING]
        adapters = [name for name, engine, _ in self.node.adapters() if engine.state in RUNNING]
        running_names = [*listed(running), *adapters]
        waiting_names = listed(waiting)
        # The picker splits both lists on commas and counts names; it calls a pod roomy when
        # len(running) + len(waiting) < max_lora. Aliases and adapters are extra names, not extra
        # engines awake, so they are added to max_lora too: the comparison stays "fewer engines up
        # than fit awake at once", which is when a wake here needs no park.
        extra_names = len(running_names) + len(waiting_names) - len(running) - len(waiting)
        max_lora = most_awake(engines, self.node.placement.capacity) + extra_names
        info = GaugeMetricFamily("vllm:lora_requests_info", "This node's awake models (running) and waking ones "
                                 "(waiting), and max_lora: how many fit awake at once. Value: the time it was read, "
                                 "as vLLM sets it.", labels=LORA_LABELS)
        info.add_metric([str(max_lora), ",".join(waiting_names), ",".join(running_names)], time.time())
        return info


def listed(engines: Iterable[Engine]) -> list[str]:
    # A name with a comma cannot be told apart in a comma-separated label; the picker never matches it.
    return [name for engine in engines for name in engine.spec.names if "," not in name]


class ModelServerMetrics:
    """The registry behind GET /metrics/model-server."""

    def __init__(self, node: Node):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ModelServerView(node))

    def render(self) -> bytes:
        return generate_latest(self.registry)


MODEL_SERVER_KEY = web.AppKey("model_server_metrics", ModelServerMetrics)


async def serve_model_server(request: web.Request) -> web.Response:
    """GET /metrics/model-server, in Prometheus' text format (what the picker's text parser reads)."""
    return web.Response(body=request.app[MODEL_SERVER_KEY].render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
