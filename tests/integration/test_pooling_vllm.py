"""The pooling, scoring and tokenizer routes through the real router in front of a real
`vllm serve --runner pooling --convert embed` on CPU (the tiny target as an embedding model):
each answer equal to the engine's own, before and after a Level-2 sleep and wake.

A pooling engine cannot generate, so its promotion gate (a completion canary) is off:
`gate.enabled: false`, as an operator must write for such a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.integration.harness import BOOT_TIMEOUT_S, http
from tests.integration.live_router import LiveRouter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "vllm-cpu.yaml"
NAME = "tiny-pool"
ROUTES = [
    ("/pooling", {"input": "the cat sees the ball"}),
    ("/v1/embeddings", {"input": ["the cat", "a dog"]}),
    ("/v2/embed", {"texts": ["the cat"], "embedding_types": ["float"]}),
    ("/score", {"queries": "the cat", "documents": ["a cat", "the river"]}),
    ("/v1/score", {"text_1": "the cat", "text_2": "a cat"}),
    ("/rerank", {"query": "the cat", "documents": ["a cat", "the river"]}),
    ("/v1/rerank", {"query": "the cat", "documents": ["a cat", "the river"], "top_n": 1}),
    ("/v2/rerank", {"query": "the cat", "documents": ["a cat", "the river"]}),
    ("/tokenize", {"prompt": "the cat"}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
]


def roster() -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(min_active_s=0, max_hold_s=5, drain_timeout_s=30, boot_timeout_s=BOOT_TIMEOUT_S,
                        timeouts={"sleep": 30, "stage": 60, "wake_weights": 30, "reload_draft": 60, "reload_weights": 60,
                                  "wake_kv_cache": 30, "reset_prefix_cache": 30, "gate": 60})
    data["models"] = [{"name": NAME, "model": "${HOTSWAP_TINY_MODELS}/target", "default": True, "sleep_level": 2,
                       "args": ["--runner", "pooling", "--convert", "embed"], "gate": {"enabled": False}}]
    return data


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    with LiveRouter.booted(roster(), tmp_path_factory.mktemp("router"), timeout=2 * BOOT_TIMEOUT_S) as live:
        yield live


def without_ids(answer: Any) -> Any:
    if isinstance(answer, dict):
        return {k: ("*" if k in ("id", "created") else without_ids(v)) for k, v in answer.items()}
    if isinstance(answer, list):
        return [without_ids(v) for v in answer]
    return answer


def answers(base: str, named: bool = True) -> dict[str, Any]:
    out = {}
    for path, body in ROUTES:
        status, answer = http("POST", base + path, {**body, **({"model": NAME} if named else {})}, timeout=120)
        assert status == 200, (path, status, answer)
        out[path] = without_ids(answer)
    return out


def test_pooling_routes_answer_like_the_engine_before_and_after_a_level2_wake(router: LiveRouter):
    direct = answers(router.engine_url(NAME))
    assert answers(router.url) == direct
    assert answers(router.url, named=False) == direct  # no model: the default
    status, body = http("POST", f"{router.url}/admin/sleep?model={NAME}", timeout=120)
    assert status == 200 and router.engine(NAME)["state"] == "sleeping", body
    assert answers(router.url) == direct  # the first request wakes it
    assert router.engine(NAME)["state"] == "awake"
