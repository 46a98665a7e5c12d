"""engines.vllm_worker.staging: which files a stage reads, as vLLM's own loader picks them, for the target
and the draft. vLLM is not installed in the router's environment: its loader is stood in for by the
few names the worker extension imports, shaped as in vLLM 0.32/0.33."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

from engines.vllm_worker.staging import StagingMethods


class DefaultModelLoader:
    """vLLM's default loader, reduced to what staging asks of it: each call's arguments, answered with one file."""

    calls: list[tuple[Any, ...]] = []

    def _prepare_weights(self, model, subfolder, revision, fall_back_to_pt, allow_patterns_overrides):
        self.calls.append((model, fall_back_to_pt, allow_patterns_overrides))
        return model, [f"{model}/model.safetensors"], True, model


@pytest.fixture
def vllm_loader(monkeypatch):
    DefaultModelLoader.calls = []
    names = {
        "vllm.model_executor.model_loader": {"get_model_loader": lambda load_config: DefaultModelLoader()},
        "vllm.model_executor.model_loader.default_loader": {"DefaultModelLoader": DefaultModelLoader},
        "vllm.model_executor.model_loader.utils": {"get_draft_load_config": lambda vllm_config: "draft load config"},
    }
    for parent in ("vllm", "vllm.model_executor"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return DefaultModelLoader.calls


class EagleDraft:
    """A draft model class with load patterns of its own (as vLLM's model classes may declare)."""

    fall_back_to_pt_during_load = False
    allow_patterns_overrides = ["draft-*.safetensors"]


def worker_on_model_runner_v2(draft: Any) -> Any:
    """Model Runner V2 (the default on GPU): its drafter is a `speculator`; the worker's
    get_draft_model() (vllm/v1/worker/gpu_worker.py) finds the draft either way."""
    model = lambda name: SimpleNamespace(model=name, revision=None)  # noqa: E731
    config = SimpleNamespace(model_config=model("/ckpt/target"), load_config="target load config",
                             speculative_config=SimpleNamespace(draft_model_config=model("/ckpt/draft")))
    runner = SimpleNamespace(get_model=lambda: object(), speculator=SimpleNamespace(model=draft))
    worker = type("Worker", (StagingMethods,), {"get_draft_model": lambda self: draft})()
    worker.vllm_config, worker.model_runner, worker.rank = config, runner, 0
    return worker


def test_a_draft_on_model_runner_v2_is_staged_with_its_own_load_patterns(vllm_loader, monkeypatch):
    from engines.vllm_worker import page_cache

    monkeypatch.setattr(page_cache, "stage", lambda files, read=True: {"files": len(files), "staged": files})
    report = worker_on_model_runner_v2(EagleDraft()).hotswap_stage_weights()
    assert report["staged"] == ["/ckpt/target/model.safetensors", "/ckpt/draft/model.safetensors"]
    assert vllm_loader[1] == ("/ckpt/draft", False, ["draft-*.safetensors"]), \
        "the files vLLM's loader picks for this draft class, not the defaults"
