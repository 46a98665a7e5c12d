"""The worker extension's host-memory methods (engines/vllm_worker/extension.py mixes them in): report and
release the pinned host memory a Level-1 sleep leaves behind. The router reads them after every
sleep and wake (engines/memory/host.py). Imported only inside vLLM engine processes; torch is
imported inside the methods.
"""

from __future__ import annotations

from typing import Any


class HostMemoryMethods:
    """Mixed into vLLM's worker through HotswapWorkerExtension: `self` is the worker."""

    def hotswap_host_memory(self) -> dict[str, Any]:
        """The pinned host memory PyTorch's caching host allocator owns in this worker: where vLLM's
        Level-1 backup lives (vllm/device_allocator/cumem.py:268, a pinned `torch.empty` per GPU
        allocation). `allocated_bytes` counts active and cached blocks, each rounded up to a power of
        two (torch/cuda/memory.py:399, torch 2.13). Without CUDA there is no such allocator: the
        answer says so, and the router reads /proc instead."""
        import torch

        if not torch.cuda.is_available():
            return {"available": False, "reason": "no CUDA in this worker: no pinned host allocator to report"}
        return {"available": True, **_pinned(torch.cuda.host_memory_stats())}

    def hotswap_empty_host_cache(self) -> dict[str, Any]:
        """Give the cached pinned blocks back to the system (torch/accelerator/memory.py:35
        `empty_host_cache`): after a Level-1 wake the backup is freed into that cache, not returned."""
        import torch

        if not torch.cuda.is_available():
            return {"available": False, "reason": "no CUDA in this worker: no pinned host cache to empty"}
        before = _pinned(torch.cuda.host_memory_stats())
        torch.accelerator.empty_host_cache()
        after = _pinned(torch.cuda.host_memory_stats())
        return {"available": True, "before": before, "after": after,
                "released_bytes": before["allocated_bytes"] - after["allocated_bytes"]}


def _pinned(stats: dict[str, Any]) -> dict[str, int]:
    """The current bytes of torch.cuda.host_memory_stats() (empty before CUDA is initialised: nothing pinned)."""
    allocated = int(stats.get("allocated_bytes.current", 0))
    active = int(stats.get("active_bytes.current", 0))
    return {"allocated_bytes": allocated, "active_bytes": active, "cached_bytes": allocated - active}
