"""GET /metrics/model-server, read the way the Inference Extension's endpoint picker reads it.

`Picker` below restates the picker's rules (llm-d-router, commit ebab687927f5, pkg/epp/framework/plugins/
datalayer; docs/multi-node.md cites each file): the text is parsed as Prometheus text; a plain series is
the first one of its family (no series carries a timestamp) and must be a gauge or counter, else it
reads 0; of `vllm:lora_requests_info` it takes the series with the largest value (vLLM's timestamp),
splits `running_lora_adapters` and `waiting_lora_adapters` on commas (trimmed, empty dropped) and reads
`max_lora` as an integer; the lora-affinity scorer gives 1.0 where the model is running, 0.8 where
len(running) + len(waiting) < max_lora, 0.6 where it is waiting, else 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.engine import State
from router.fleet import ModelServerMetrics
from router.scheduling import Capacity
from tests.support import sim_model, sim_roster


@dataclass
class Picker:
    waiting_queue: int
    running_requests: int
    kv_cache: float
    active: set[str]
    waiting: set[str]
    max_active: int

    @classmethod
    def scrape(cls, text: str) -> "Picker":
        families = {f.name: f for f in text_string_to_metric_families(text)}

        def first(name: str) -> float:
            family = families[name]  # the picker reports a missing family as an error
            assert family.type in ("gauge", "counter"), f"{name} is a {family.type}: the picker reads 0 of it"
            return family.samples[0].value

        lora = families["vllm:lora_requests_info"]
        assert lora.type == "gauge"
        newest = max(lora.samples, key=lambda s: s.value)

        def names(label: str) -> set[str]:
            return {n.strip() for n in newest.labels.get(label, "").split(",") if n.strip()}

        return cls(int(first("vllm:num_requests_waiting")), int(first("vllm:num_requests_running")),
                   first("vllm:kv_cache_usage_perc"), names("running_lora_adapters"), names("waiting_lora_adapters"),
                   int(newest.labels["max_lora"]))

    def lora_affinity(self, model: str) -> float:
        if model in self.active:
            return 1.0
        if len(self.active) + len(self.waiting) < self.max_active:
            return 0.8
        if model in self.waiting:
            return 0.6
        return 0.0


class FakeNode:
    """What the exposition reads of a Router: engines with states, queues, leases, adapters."""

    def __init__(self, models: list[dict], states: dict[str, State], queued: dict[str, int] | None = None,
                 in_flight: dict[str, int] | None = None, adapters: list[tuple[str, str]] = ()):
        roster = sim_roster(*models)
        queued, in_flight = queued or {}, in_flight or {}
        self.engines = {m.name: SimpleNamespace(name=m.name, spec=m, state=states.get(m.name, State.SLEEPING),
                                                in_flight=in_flight.get(m.name, 0), retiring=False)
                        for m in roster.models}
        self.placement = SimpleNamespace(capacity=Capacity({0: 80.0}, ram_budget_gb=100.0),
                                         queued=lambda e: queued.get(e.name, 0))
        self._adapters = [(name, self.engines[base], base) for name, base in adapters]

    def adapters(self):
        return self._adapters


def share(name: str, fraction: float, **extra) -> dict:
    return sim_model(name, args=("--gpu-memory-utilization", str(fraction)), **extra)


def scrape(node: FakeNode) -> Picker:
    return Picker.scrape(ModelServerMetrics(node).render().decode())


def test_an_awake_model_scores_highest_and_a_waking_one_counts_against_the_room():
    node = FakeNode([share("chat", 0.4), share("code", 0.4), share("vision", 0.4)],
                    {"chat": State.AWAKE, "code": State.WAKING}, queued={"code": 3}, in_flight={"chat": 2})
    picker = scrape(node)
    assert (picker.active, picker.waiting) == ({"chat"}, {"code"})
    assert picker.max_active == 2  # two 0.4 shares fit on the GPU, not three
    assert (picker.waiting_queue, picker.running_requests, picker.kv_cache) == (3, 2, 0.0)
    assert picker.lora_affinity("chat") == 1.0
    assert picker.lora_affinity("code") == 0.6  # full: chat awake + code waking = what fits
    assert picker.lora_affinity("vision") == 0.0  # waking it here would park one


def test_a_node_with_nothing_awake_has_room_for_any_model():
    node = FakeNode([share("chat", 0.4), share("code", 0.4)], {})
    picker = scrape(node)
    assert (picker.active, picker.waiting, picker.max_active) == (set(), set(), 2)
    assert picker.lora_affinity("chat") == picker.lora_affinity("code") == 0.8


def test_aliases_and_adapters_are_running_names_without_taking_the_room():
    node = FakeNode([share("chat", 0.4, aliases=["gpt-4o", "assistant"]), share("code", 0.4)],
                    {"chat": State.AWAKE}, adapters=[("chat-sql", "chat")])
    picker = scrape(node)
    assert picker.active == {"chat", "gpt-4o", "assistant", "chat-sql"}
    for name in ("gpt-4o", "assistant", "chat-sql"):
        assert picker.lora_affinity(name) == 1.0
    # One engine is awake of two that fit: another model still wakes here without a park.
    assert picker.lora_affinity("code") == 0.8


def test_a_group_allows_one_of_its_models_awake():
    node = FakeNode([share("a", 0.2, group="big"), share("b", 0.2, group="big"), share("c", 0.2)], {"a": State.AWAKE})
    picker = scrape(node)
    assert picker.max_active == 2  # a or b, and c
    assert picker.lora_affinity("c") == 0.8


def test_between_two_nodes_the_picker_prefers_the_one_where_the_model_is_awake():
    models = [share("chat", 0.6), share("code", 0.6)]
    awake_here = scrape(FakeNode(models, {"chat": State.AWAKE}))
    parked_there = scrape(FakeNode(models, {"code": State.AWAKE}))
    # A wake on the second node parks `code` (two 0.6 shares do not fit one GPU): 0.
    assert parked_there.max_active == 1
    assert awake_here.lora_affinity("chat") > parked_there.lora_affinity("chat") == 0.0


def test_a_pinned_model_counts_first_even_when_smaller_ones_would_fit_more():
    # Smallest first would fit three 0.3s; the pinned 0.6 is always awake, so one 0.3 fits beside it.
    node = FakeNode([share("big", 0.6, pin=True), share("x", 0.3), share("y", 0.3), share("z", 0.3)], {"big": State.AWAKE})
    assert scrape(node).max_active == 2


@pytest.mark.parametrize("state", [State.BOOTING, State.WAKING, State.VERIFYING])
def test_on_its_way_to_serve_is_waiting(state):
    picker = scrape(FakeNode([share("chat", 0.4)], {"chat": state}))
    assert (picker.active, picker.waiting) == (set(), {"chat"})


@pytest.mark.parametrize("state", [State.DRAINING, State.SLEEPING, State.COLD, State.FAILED])
def test_not_serving_and_not_coming_is_neither(state):
    picker = scrape(FakeNode([share("chat", 0.4)], {"chat": state}))
    assert (picker.active, picker.waiting) == (set(), set())


def test_one_series_per_family_and_lora_info_carries_the_time_like_vllm():
    text = ModelServerMetrics(FakeNode([share("chat", 0.4)], {"chat": State.AWAKE})).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                             "vllm:lora_requests_info", "vllm:cache_config_info"}
    assert all(len(f.samples) == 1 for f in families.values())
    assert families["vllm:cache_config_info"].samples[0].labels == {}  # the picker reads no block size from it
    assert abs(families["vllm:lora_requests_info"].samples[0].value - time.time()) < 60
