"""A test instrument loaded into real vLLM (`--logits-processors vllm_pace:Pace`, this folder on the engine's
PYTHONPATH): a request that asks for it with `vllm_xargs: {"hotswap_pace_ms": MS}` gets one token every
MS milliseconds at least, so a test can act between two tokens of a stream however fast this machine
generates (a tiny model on CPU writes 64 tokens in about 0.2 s). It changes no logit; other requests run
at full speed. Runs inside vLLM's Python: the standard library, torch and vllm only."""

from __future__ import annotations

import time

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

KEY = "hotswap_pace_ms"


class Pace(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.paced: dict[int, float] = {}  # batch row -> seconds per token

    def is_argmax_invariant(self) -> bool:
        return False  # so that vLLM runs apply() for greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.paced.pop(index, None)
        for index, params, *_ in batch_update.added:
            ms = ((getattr(params, "extra_args", None) or {}).get(KEY)) if params is not None else None
            if ms:
                self.paced[index] = float(ms) / 1000
            else:
                self.paced.pop(index, None)
        for a, b, direction in batch_update.moved:
            pa, pb = self.paced.pop(a, None), self.paced.pop(b, None)
            if pa is not None:
                self.paced[b] = pa
            if pb is not None and str(direction).endswith("SWAP"):
                self.paced[a] = pb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.paced:
            time.sleep(max(self.paced.values()))
        return logits
