"""The simulated engine's host memory: vLLM's Level-1 backup of the weights in pinned host RAM,
through PyTorch's caching host allocator, really allocated and touched, so `/proc` sees it.

What it reproduces (read in vLLM 0.32 and torch 2.13):
- a Level-1 sleep copies every weight allocation into its own pinned CPU tensor
  (vllm/device_allocator/cumem.py:268); Level 2 backs nothing up;
- the host allocator rounds every block up to the next power of two and keeps a freed block
  cached for reuse (torch/cuda/memory.py:399 `host_memory_stats`), so after the wake
  (cumem.py:360 drops each backup) the memory stays held;
- until `torch.accelerator.empty_host_cache()` (torch/accelerator/memory.py:35) gives the
  cached blocks back.

Each block is its own anonymous shared mapping, touched page by page: it is resident (RssShmem
in /proc/PID/status) from the sleep until it is released. The weights are a Llama-3.1-8B's
tensors (vLLM's fused qkv and gate_up, bf16) scaled to the checkpoint's size, so the rounding
costs what it would on tensors of those proportions. `--sim-host-bytes-per-gb N` turns it on and
scales what is really allocated: N real bytes per GB of weights (1e9: one byte per byte; unset: not
modelled, nothing allocated). What `hotswap_host_memory` reports is the modelled bytes (the real
ones × 1e9 / N): what the extension would report on the GPU host modelled, so a bench of 70B
checkpoints at N = 1e6 is accounted against host.ram_budget_gb as that host would be, while /proc
sees (and a test of the router's `proc` source measures) the real, scaled-down bytes. A test of the
accounting runs at 1e9 with a checkpoint of a few MB, where the two agree.

Reported as the worker extension reports (engines/vllm_worker/extension.py `hotswap_host_memory`,
`hotswap_empty_host_cache`), through POST /collective_rpc (routes_dev.py).
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

log = logging.getLogger("vllm.sim")

PAGE = mmap.PAGESIZE
EMBED, QKV, O_PROJ, GATE_UP, DOWN, NORM, LAYERS = 1_050_673_152, 50_331_648, 33_554_432, 234_881_024, 117_440_512, 8_192, 32
# Llama-3.1-8B in bf16, in bytes: embed_tokens, then per layer input_layernorm, qkv_proj, o_proj,
# post_attention_layernorm, gate_up_proj, down_proj; then norm and lm_head (16.06 GB in all).
LLAMA_8B = (EMBED, *[t for _ in range(LAYERS) for t in (NORM, QKV, O_PROJ, NORM, GATE_UP, DOWN)], NORM, EMBED)


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tensor_bytes(weights_gb: float, bytes_per_gb: float) -> list[int]:
    """The weight tensors' sizes, in real bytes: LLAMA_8B's proportions over `weights_gb` GB, scaled."""
    total = weights_gb * bytes_per_gb
    whole = sum(LLAMA_8B)
    return [size for size in (round(t * total / whole) for t in LLAMA_8B) if size > 0]


class HostModel:
    """The pinned blocks one engine's host allocator owns: in use by a Level-1 backup, or cached."""

    def __init__(self, weights_gb: float, bytes_per_gb: float):
        self.weights_gb = weights_gb
        self.tensors = tensor_bytes(weights_gb, bytes_per_gb)
        self.modelled_per_real = 1e9 / bytes_per_gb
        self.active: list[mmap.mmap] = []  # the backup of a Level-1 sleep
        self.cached: dict[int, list[mmap.mmap]] = {}  # block size -> freed blocks kept for reuse

    def sleep(self, level: int) -> None:
        if level != 1 or self.active:  # vLLM keeps an allocation already asleep as it is (cumem.py:257)
            return
        self.active = [self._block(next_power_of_two(size)) for size in self.tensors]
        log.info("sim: level-1 backup of %d weight tensors in %.1f MiB of pinned host memory (%.1f MiB cached before)",
                 len(self.active), self.allocated / 2**20, (self.allocated - self.active_bytes) / 2**20)

    def wake(self, tags: list[str]) -> None:
        """Waking the weights copies the backup back and frees it into the cache, which keeps it."""
        if tags and "weights" not in tags:
            return
        for block in self.active:
            self.cached.setdefault(len(block), []).append(block)
        self.active = []

    def empty_cache(self) -> dict[str, Any]:
        before = self.stats()
        for blocks in self.cached.values():
            for block in blocks:
                block.close()
        self.cached = {}
        after = self.stats()
        log.info("sim: empty_host_cache gave back %.1f MiB", (before["allocated_bytes"] - after["allocated_bytes"]) / 2**20)
        return {"available": True, "before": before, "after": after,
                "released_bytes": before["allocated_bytes"] - after["allocated_bytes"]}

    @property
    def active_bytes(self) -> int:
        return sum(len(b) for b in self.active)

    @property
    def allocated(self) -> int:
        return self.active_bytes + sum(len(b) for blocks in self.cached.values() for b in blocks)

    def stats(self) -> dict[str, Any]:
        """What `hotswap_host_memory` answers on a CUDA worker (torch.cuda.host_memory_stats' current bytes),
        in modelled bytes."""
        allocated, active = (round(n * self.modelled_per_real) for n in (self.allocated, self.active_bytes))
        return {"available": True, "allocated_bytes": allocated, "active_bytes": active, "cached_bytes": allocated - active}

    def _block(self, size: int) -> mmap.mmap:
        reuse = self.cached.get(size)
        if reuse:
            return reuse.pop()
        block = mmap.mmap(-1, size)  # anonymous and shared, like pinned pages: RssShmem once touched
        block[0:size:PAGE] = b"\x01" * len(range(0, size, PAGE))  # the copy writes every page
        return block


NOT_MODELLED = {"available": False, "reason": "host memory is not modelled (the simulator runs without "
                "--sim-host-bytes-per-gb)"}
