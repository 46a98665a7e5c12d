"""The worker extension's staging method (engines/vllm_worker/extension.py mixes it in): make the
checkpoint files a Level-2 wake's reloads will read resident in the page cache first.

Which files: the worker asks vLLM's own default loader, the one `reload_weights` and the draft's
reload read through, rather than taking a list from the router. vLLM 0.32's
`DefaultModelLoader._prepare_weights` (vllm/model_executor/model_loader/default_loader.py:147-263)
resolves the model (a hub id to its snapshot), picks the load format's patterns (the Mistral
`consolidated*` files, safetensors before .bin, .pt as a fallback), narrows safetensors to the index
and drops training files; `get_all_weights` (default_loader.py:367) calls it with the model class's
own `fall_back_to_pt_during_load` and `allow_patterns_overrides`. Asking it here reads exactly those
files even where the router's mirror of that logic (engines/memory/weights.py) would differ: inside a
container with other paths, a model class with its own patterns. A loader that is not a
DefaultModelLoader (tensorizer, sharded_state, ...) answers `files: 0` with the reason.

Only rank 0 reads: the page cache is the host's, shared by every worker on it.
"""

from __future__ import annotations

from typing import Any

from engines.vllm_worker import page_cache


class StagingMethods:
    """Mixed into vLLM's worker through HotswapWorkerExtension: `self` is the worker."""

    def hotswap_stage_weights(self, read: bool = True) -> dict[str, Any]:
        """Read the target's and the draft's weight files so their pages are resident:
        `{"files", "bytes", "read_bytes", "seconds", "resident_before"}` (resident_before: the fraction
        of those bytes already cached, by mincore). `read=False`: only look (read_bytes 0)."""
        if getattr(self, "rank", 0) != 0:
            return {"files": 0, "bytes": 0, "read_bytes": 0, "seconds": 0.0, "resident_before": 1.0,
                    "skipped": f"rank {self.rank}: rank 0 reads for the host"}
        files, why = _checkpoint_files(self)
        if not files:
            return {"files": 0, "bytes": 0, "read_bytes": 0, "seconds": 0.0, "resident_before": 1.0, "reason": why}
        return page_cache.stage(files, read=read)

    def hotswap_weights_residency(self) -> dict[str, Any]:
        """What fraction of the checkpoint's bytes is in the page cache now (for the bench and operators)."""
        files, why = _checkpoint_files(self)
        return {"files": files, "resident": page_cache.residency(files), **({"reason": why} if why else {})}


def draft_model(worker: Any) -> Any:
    """The worker's draft module, or None. vLLM's worker asks its runner (`get_draft_model`, gpu_worker.py:1132 in
    0.32): Model Runner V2, the default on GPU, keeps the draft in `speculator`, not in a `drafter`."""
    get = getattr(worker, "get_draft_model", None) or getattr(worker.model_runner, "get_draft_model", None)
    if get is not None:
        return get()
    drafter = getattr(worker.model_runner, "drafter", None)
    return getattr(drafter, "model", None)


def _checkpoint_files(worker: Any) -> tuple[list[str], str]:
    """The weight files vLLM's loader reads for the target and the draft, and why none when empty."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    vllm_config = worker.vllm_config
    model = worker.model_runner.get_model()
    sources = [(vllm_config.model_config, vllm_config.load_config, model)]
    spec = vllm_config.speculative_config
    draft_cfg = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft_cfg is not None and draft_cfg.model != vllm_config.model_config.model:
        sources.append((draft_cfg, get_draft_load_config(vllm_config), draft_model(worker)))
    files: list[str] = []
    reasons = []
    for model_config, load_config, module in sources:
        loader = get_model_loader(load_config)
        if not isinstance(loader, DefaultModelLoader):
            reasons.append(f"{type(loader).__name__} does not read checkpoint files vLLM's default way")
            continue
        _, found, _, _ = loader._prepare_weights(
            model_config.model, None, model_config.revision,
            getattr(module, "fall_back_to_pt_during_load", True),
            getattr(module, "allow_patterns_overrides", None))
        files += [f for f in found if f not in files]
    return files, "; ".join(reasons)
