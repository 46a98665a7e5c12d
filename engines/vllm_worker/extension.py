"""The router's vLLM worker extension: restore a speculative draft after a Level-2 wake, report
(and release) the pinned host memory a Level-1 sleep leaves behind, and stage a Level-2 sleeper's
checkpoint into the page cache before its reload.

Loaded INSIDE the vLLM engine process with
`--worker-extension-cls engines.vllm_worker.HotswapWorkerExtension`; vLLM mixes the class
into every worker, and each public method becomes callable as

    POST /collective_rpc {"method": "hotswap_reload_draft"}  ->  {"results": [one per worker]}

so every method returns JSON-serialisable values. The router never imports this module
(it has no torch); importing it has no side effects, vLLM and torch are imported inside
the methods.

Why: vLLM's Level-2 sleep discards the draft's parameters with the target's, but the
documented `reload_weights` restores only the target (vLLM issue #52479; the upstream
fix, PR #52487, is not in 0.32/0.33). The draft then drafts garbage: acceptance falls to
1.0 while outputs stay correct, so the only symptom is a ~2x slower decode.
`hotswap_reload_draft` reloads the draft checkpoint from disk in place, through vLLM's
own loader and layerwise-reload lifecycle (the same calls the upstream fix makes), BEFORE
the router's target `reload_weights`, so the target stays authoritative for any storage
the two share.

On CPU (the integration tier) sleep is bookkeeping only, so `hotswap_discard_draft`
(test-only) stands in for the Level-2 loss, and `hotswap_draft_digest` tells whether the
weights the kernels actually use are the checkpoint's.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Iterable, Iterator

from engines.vllm_worker.host_memory import HostMemoryMethods
from engines.vllm_worker.staging import StagingMethods, draft_model

PROBE_ROWS = 4
PROBE_SEED = 0x5EED


class HotswapWorkerExtension(HostMemoryMethods, StagingMethods):
    """Mixed into vLLM's worker class: `self` is the worker (vllm_config, model_runner, ...). The
    host-memory methods are `engines.vllm_worker.host_memory`'s, the staging one
    `engines.vllm_worker.staging`'s (vLLM's worker_base.py:301 mixes the class in
    with its bases, so inherited methods are callable the same way)."""

    # --- the production method -------------------------------------------------------

    def hotswap_reload_draft(self) -> dict[str, Any]:
        """Reload the speculative draft's checkpoint from disk, in place, draft-private tensors only."""
        import torch

        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.utils import get_draft_load_config

        draft = draft_model(self)
        if draft is None:
            return {"reloaded": False, "reason": "no draft model"}
        vllm_config = self.vllm_config
        spec = vllm_config.speculative_config
        cfg = getattr(spec, "draft_model_config", None) if spec is not None else None
        if cfg is None:
            return {"reloaded": False, "reason": "no draft model config"}
        loader = get_model_loader(get_draft_load_config(vllm_config))
        if not hasattr(loader, "get_all_weights"):
            raise NotImplementedError(f"draft reload from {type(loader).__name__} is not supported")

        started = time.perf_counter()
        target = self.model_runner.get_model()
        shared = _shared_submodules(draft, target)
        loaded = 0

        def counted(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            nonlocal loaded
            for name, tensor in weights:
                if _lands_in(name, shared):
                    continue  # the target's reload restores it
                loaded += 1
                yield name, tensor

        with set_current_vllm_config(vllm_config), torch.no_grad(), _detached(draft, shared):
            initialize_layerwise_reload(draft)
            draft.load_weights(counted(loader.get_all_weights(cfg, draft)))
            finalize_layerwise_reload(draft, cfg)
            # DFlash/DSpark drafters cache fused copies of their weights (and a rotary
            # reference) at the end of load_weights, i.e. inside the layerwise window where
            # some buffers are still placeholders: rebuild them from the restored tree.
            for module in draft.modules():
                rebuild = getattr(module, "_build_fused_kv_buffers", None)
                if callable(rebuild):
                    rebuild()
        return {
            "reloaded": True,
            "tensors": loaded,
            "skipped_shared": sorted(shared),
            "model": str(cfg.model),
            "seconds": round(time.perf_counter() - started, 4),
        }

    # --- observation -----------------------------------------------------------------

    def hotswap_draft_digest(self) -> str | None:
        """sha256 (hex) of the draft's weights as the kernels use them; None without a draft.

        On CPU most linear layers keep their weight only inside a packed kernel handle
        (`layer.cpu_linear`; the weight parameter is left empty), so hashing parameters
        alone would miss exactly what a discard or a reload changes. For every layer with
        a `cpu_linear`, the digest hashes that kernel's output on a fixed probe input (a
        deterministic function of the packed weight); every non-empty parameter and
        buffer is hashed by value.
        """
        draft = draft_model(self)
        return None if draft is None else _model_digest(draft)

    def hotswap_versions(self) -> dict[str, Any]:
        """What this worker runs on, for `hotswap trial`'s report head: vLLM, torch, CUDA and the device (the
        router's own environment may have neither vLLM nor torch: a separate venv or container runs them)."""
        import torch
        import vllm

        gpu = torch.cuda.is_available()
        # Plain strings: torch.__version__ is a TorchVersion, which vLLM's msgpack encoder refuses (and the engine
        # core with it).
        return {"vllm": str(getattr(vllm, "__version__", "")) or None, "torch": str(torch.__version__),
                "cuda": None if torch.version.cuda is None else str(torch.version.cuda),
                "device": str(torch.cuda.get_device_name(torch.cuda.current_device())) if gpu else "cpu"}

    def hotswap_target_digest(self) -> str:
        """sha256 (hex) of the target's weights as the kernels use them (as `hotswap_draft_digest`).

        Lets a test tell that a perturbed target (`hotswap_perturb_target`) is back to its
        checkpoint, e.g. after the cold restart the gate's refusal leads to.
        """
        return _model_digest(self.model_runner.get_model())

    # --- test-only -------------------------------------------------------------------

    def hotswap_discard_draft(self, fill: str = "zeros") -> dict[str, Any]:
        """TEST ONLY: overwrite the draft's private weights in place, as Level-2 sleep does on GPU.

        `fill` is "zeros" (what a discarded allocation reads back as on GPU) or "noise".
        Tensors sharing storage with the target, and target modules installed in the
        draft, are left alone. On CPU, layers whose weight lives in a packed kernel handle
        are repacked from the overwritten weight, so the kernels really see the loss.
        """
        import torch

        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        draft = draft_model(self)
        if draft is None:
            return {"discarded": False, "reason": "no draft model"}
        if fill not in ("zeros", "noise"):
            raise ValueError(f"fill must be 'zeros' or 'noise', not {fill!r}")
        target = self.model_runner.get_model()
        shared = _shared_submodules(draft, target)
        target_storage = _storage_ptrs(target)
        gen = torch.Generator().manual_seed(PROBE_SEED + 1)

        def overwrite(t: torch.Tensor) -> None:
            if fill == "zeros" or not t.is_floating_point():
                t.zero_()
            else:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))

        tensors = repacked = 0
        started = time.perf_counter()
        with torch.no_grad():
            for mod_name, module in draft.named_modules():
                if _under(mod_name, shared):
                    continue
                for _, p in module.named_parameters(recurse=False):
                    if p.numel() == 0 or _storage_ptr(p) in target_storage:
                        continue
                    overwrite(p.data)
                    tensors += 1
                if not hasattr(module, "cpu_linear") or not hasattr(module, "weight"):
                    continue
                weight = module.weight
                if weight.numel() > 0:  # kept beside its pack (lm_head, embeddings): repack it
                    if _storage_ptr(weight) in target_storage:
                        continue
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                else:  # the weight lives only in the pack: build the overwritten one, repack
                    shape = _packed_weight_shape(module)
                    if shape is None:
                        continue
                    module.weight = torch.nn.Parameter(torch.empty(shape, dtype=weight.dtype, device=weight.device), requires_grad=False)
                    overwrite(module.weight.data)
                    dispatch_cpu_unquantized_gemm(module, remove_weight=True)
                    tensors += 1
                repacked += 1
        return {
            "discarded": True,
            "fill": fill,
            "tensors": tensors,
            "repacked": repacked,
            "skipped_shared": sorted(shared),
            "seconds": round(time.perf_counter() - started, 4),
        }


    def hotswap_perturb_target(self, scale: float | str = 1.05) -> dict[str, Any]:
        """TEST ONLY: scale the target's final norm weight in place: logprobs move, greedy tokens cannot.

        Stands in for the wake bugs the gate's logprob-drift check exists for (an FP8 KV scale
        reset to 1.0, KV pages remapped with stale contents): the target is numerically wrong
        while the canary's tokens still match. The final RMSNorm's weight multiplies the
        hidden state just before the (bias-free) lm_head, so scaling it by `scale` > 0 scales
        every logit by `scale`: argmax, hence the greedy text and speculative acceptance
        (the draft proposes the same tokens, verification picks the same argmax), stay the
        same, and every logprob moves (log_softmax(s*z) != log_softmax(z) unless s == 1).
        On CPU this weight is a plain parameter read at every forward (RMSNorm is not packed
        into a oneDNN handle), so no repack is needed.

        `scale` is relative to the CHECKPOINT's weight, not cumulative: the first call keeps a
        copy of the original, every call writes original * scale, so calls are idempotent
        and `scale=1.0` restores the checkpoint bit for bit (the digest says so). The
        collective_rpc endpoint passes JSON args through, so a string scale is accepted too.

        vLLM's `reload_weights` (the Level-2 wake) rewrites this weight from the checkpoint
        and so erases the perturbation (measured on CPU: drift 0.46 -> 0, digest back): perturb
        at Level 1, or after the wake's `reload_weights` and before the `kv_cache` wake.
        """
        import torch

        scale = float(scale)
        if not scale > 0:
            raise ValueError(f"scale must be > 0 (a negative one flips the argmax), not {scale}")
        model = self.model_runner.get_model()
        name, norm = _final_norm(model)
        weight = norm.weight
        before = _model_digest(model)
        saved = getattr(self, "_hotswap_norm_checkpoint", None)
        if saved is None or saved[0] != name or saved[1].shape != weight.shape:
            saved = (name, weight.detach().clone())
            self._hotswap_norm_checkpoint = saved
        with torch.no_grad():
            weight.data.copy_((saved[1].float() * scale).to(weight.dtype))
        return {
            "perturbed": f"{name}.weight",
            "scale": scale,
            "dtype": str(weight.dtype).removeprefix("torch."),
            "restored": bool(torch.equal(weight.data, saved[1])),
            "digest_before": before,
            "digest_after": _model_digest(model),
        }


# --- helpers (module level so they never collide with worker attributes) ----------------


def _storage_ptr(t: Any) -> int:
    return t.untyped_storage().data_ptr()


def _storage_ptrs(model: Any) -> set[int]:
    return {
        _storage_ptr(t)
        for t in [*model.parameters(), *model.buffers()]
        if t.numel() > 0  # empty tensors all share one data pointer
    }


def _shared_submodules(draft: Any, target: Any) -> set[str]:
    """Every path in the draft to a top-most submodule that is (or holds storage of) the target's.

    EAGLE-style drafters install the target's embedding or lm_head in the draft, and vLLM
    caches rotary embeddings so draft and target hold the same object; a plain draft model
    shares nothing else. All aliases are listed (a module reachable under several names
    is reported under each), so detaching them really cuts the draft off from the target.
    """
    target_modules = {id(m) for m in target.modules()}
    target_storage = _storage_ptrs(target)
    shared: set[str] = set()
    for name, module in draft.named_modules(remove_duplicate=False):
        if not name or _under(name, shared):
            continue
        own = [t for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)] if t.numel() > 0]
        if id(module) in target_modules or any(_storage_ptr(t) in target_storage for t in own):
            shared.add(name)
    return shared


def _under(name: str, modules: set[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _lands_in(name: str, modules: set[str]) -> bool:
    """Whether checkpoint/parameter `name` belongs under one of `modules` (also without a `model.` prefix)."""
    for m in modules:
        for prefix in {m, m.removeprefix("model.")}:
            if name == prefix or name.startswith(prefix + "."):
                return True
    return False


class _detached:
    """Temporarily swap shared submodules out of the draft, so the reload cannot touch them."""

    def __init__(self, root: Any, names: set[str]):
        self.root, self.names, self.saved = root, names, []

    def __enter__(self) -> None:
        import torch

        for name in sorted(self.names):
            parent_name, _, attr = name.rpartition(".")
            parent = self.root.get_submodule(parent_name) if parent_name else self.root
            self.saved.append((parent, attr, getattr(parent, attr)))
            setattr(parent, attr, torch.nn.Module())

    def __exit__(self, *exc: Any) -> None:
        for parent, attr, module in reversed(self.saved):
            setattr(parent, attr, module)


def _final_norm(model: Any) -> tuple[str, Any]:
    """(path, module) of the target's final norm: `model.norm` in vLLM's decoder-only models."""
    for name in ("model.norm", "language_model.model.norm", "model.language_model.norm", "norm"):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if getattr(module, "weight", None) is not None and module.weight.dim() == 1:
            return name, module
    raise NotImplementedError(f"no final norm with a 1-d weight found in {type(model).__name__}")


def _model_digest(model: Any) -> str:
    """sha256 (hex) of a model's weights as its kernels use them (see hotswap_draft_digest)."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.numel() == 0:
                    continue
                _hash_tensor(h, f"{mod_name}.{name}", tensor)
            probe = _kernel_probe(module)
            if probe is not None:
                _hash_tensor(h, f"{mod_name}.<cpu_linear>", probe)
    return h.hexdigest()


def _packed_weight_shape(module: Any) -> tuple[int, int] | None:
    n = getattr(module, "output_size_per_partition", None)
    k = getattr(module, "input_size_per_partition", None)
    return (int(n), int(k)) if n and k else None


def _kernel_probe(module: Any) -> Any:
    """The output of a CPU layer's packed kernel on a fixed input, or None for other layers."""
    import torch

    linear = getattr(module, "cpu_linear", None)
    weight = getattr(module, "weight", None)
    if linear is None or weight is None:
        return None
    if weight.numel() > 0:
        k = weight.shape[-1]
    else:
        shape = _packed_weight_shape(module)
        if shape is None:
            return None
        k = shape[1]
    gen = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randn(PROBE_ROWS, k, generator=gen, dtype=torch.float32).to(weight.dtype)
    bias = getattr(module, "bias", None)
    if bias is not None and getattr(module, "skip_bias_add", False):
        bias = None
    return linear(x, weight, bias)


def _hash_tensor(h: Any, name: str, t: Any) -> None:
    import torch

    t = t.detach().to("cpu").contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
