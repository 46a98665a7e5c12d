"""Placement by memory with real `vllm serve` engines on CPU: two engines whose shares fit
together are awake at the same time, and requests alternating between them never park either.

config/examples/vllm-cpu.yaml's two models, each given `--gpu-memory-utilization 0.4`
(the CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE and ignores the share; the
router's arithmetic is what is under test: 0.4 + 0.4 fits in one device).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.integration.harness import BOOT_TIMEOUT_S, REPORT
from tests.integration.live_router import LiveRouter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "vllm-cpu.yaml"
PROMPT = "The router wakes the model and"


def roster() -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(min_active_s=0, boot_timeout_s=BOOT_TIMEOUT_S)
    for model in data["models"]:
        model["args"] = ["--gpu-memory-utilization", "0.4"]  # appended to the defaults' args
    return data


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    with LiveRouter.booted(roster(), tmp_path_factory.mktemp("placement"), timeout=3 * BOOT_TIMEOUT_S) as live:
        yield live


def test_two_real_engines_that_fit_together_are_both_awake_and_alternating_requests_never_park_either(router: LiveRouter):
    names = [m["name"] for m in roster()["models"]]
    assert sorted(router.awake()) == sorted(names), "both booted and both stayed awake: 0.4 + 0.4 fits"
    client = router.client()
    answers: dict[str, set[str]] = {name: set() for name in names}
    for name in names * 5:
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert answer.model == name and answer.usage.completion_tokens == 8
        answers[name].add(answer.choices[0].text)
    assert all(len(texts) == 1 for texts in answers.values()), f"temperature 0 answers the same each time: {answers}"
    status = router.status()
    assert status["swaps"] == [] and sorted(router.awake()) == sorted(names)
    values = router.metrics()
    sleeps = sum(router.metric(values, "hotswap_swap_phase_duration_seconds_count", model=n, group="", phase="sleep")
                 for n in names)
    evictions = sum(v for (metric, _), v in values.items() if metric == "hotswap_evictions_total")
    assert sleeps == 0 and evictions == 0, (sleeps, evictions)
    for name in names:  # and vLLM itself was never asked to sleep
        assert not any("POST /sleep" in line for line in router.log_since(name, 0)), name
    REPORT["placement_two_awake"] = {"requests": 10, "sleeps": 0,
                                     "gpu0_planned": status["placement"]["devices"][0]["planned"]}
