"""The simulated model's per-token logprobs, and the numeric faults a GPU engine can wake up with.

A healthy engine's logprob for the token at a position is a pure function of (model, prompt,
position, sampling salt), like the token itself, so two canaries at temperature 0 agree to the
bit, as a GPU engine running the same batch shape does. What a real host adds, each behind a
flag (engines/sim/flags.py) with its effect on the numbers only — the tokens never change,
which is what makes these faults invisible to acceptance and to the output check:

- `--sim-logprob-jitter J`: healthy batch-shape nondeterminism. While other requests run
  alongside, each logprob moves by up to J (a GPU's kernels reduce in another order for
  another batch; bf16 makes that visible). Alone, it is exact.
- `--sim-wake-logprob-shift S`: after every wake from sleep, every logprob is off by S, as
  when FP8 KV-cache scales come back as 1.0 (vLLM #45617). A cold (re)start is clean.
- `--sim-wake-logprob-noise N`: after every wake, each logprob is off by a random amount up to
  N, as when discarded KV pages are remapped with undefined contents (vLLM #44972).
- the worker extension's test method `hotswap_perturb_target(scale)` (through
  /collective_rpc, as on real vLLM): logits scaled by `scale` — the real method scales the
  target's final norm weight — until `reload_weights` (a Level-2 wake) or a restart rewrites
  it from the checkpoint. Greedy tokens are unchanged.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from . import lm


@dataclass
class NumericFaults:
    jitter: float = 0.0
    wake_shift: float = 0.0
    wake_noise: float = 0.0


class Numerics:
    def __init__(self, model: str, faults: NumericFaults) -> None:
        self.model = model
        self.faults = faults
        self.shift = 0.0  # in force since the last wake
        self.noise = 0.0
        self.scale = 1.0  # hotswap_perturb_target's

    def woke(self) -> None:
        """A wake from sleep completed: the wake faults the flags ask for take hold."""
        self.shift, self.noise = self.faults.wake_shift, self.faults.wake_noise

    def perturb(self, scale: float) -> dict:
        """The real method's contract (engines/vllm_worker/extension.py): relative to the checkpoint, not cumulative
        (1.0 restores it), refused for scale <= 0, and undone by reload_weights (`reloaded`)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0 (a negative one flips the argmax), not {scale}")
        before = self.digest()
        self.scale = scale
        return {"perturbed": "model.norm.weight", "scale": scale, "dtype": "bfloat16", "restored": scale == 1.0,
                "digest_before": before, "digest_after": self.digest()}

    def reloaded(self) -> None:
        """reload_weights rewrote the target from its checkpoint: a perturbation is gone."""
        self.scale = 1.0

    def digest(self) -> str:
        return hashlib.sha256(f"{self.model}:norm:{self.scale!r}".encode()).hexdigest()

    def logprob(self, prompt: str, pos: int, salt: str, others: int) -> float:
        """The logprob of the token at `pos`, with `others` requests running alongside."""
        healthy = -0.05 - 3.0 * lm.unit("lp", self.model, salt, prompt, pos)
        # log_softmax(s * z) for the argmax token, approximated: s times its healthy logprob.
        value = healthy * self.scale + self.shift
        if self.noise:
            value += random.uniform(-self.noise, self.noise)
        if others and self.faults.jitter:
            value += random.uniform(-self.faults.jitter, self.faults.jitter)
        return min(value, 0.0)


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def asked(body: dict, chat: bool) -> int | None:
    """How many top logprobs a request asks for besides the sampled token's (None: no logprobs), or
    ValueError with vLLM's complaint. Completions: `logprobs: N`; chat: `logprobs: true` (+ `top_logprobs`)."""
    if chat:
        if body.get("logprobs") in (None, False):
            if body.get("top_logprobs") not in (None, 0):
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
            return None
        if body["logprobs"] is not True:
            raise ValueError("logprobs must be a boolean.")
        n = body.get("top_logprobs") or 0
    else:
        n = body.get("logprobs")
        if n is None:
            return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError("`logprobs` must be a non-negative integer.")
    if n > MAX_LOGPROBS:
        raise ValueError(f"Requested sample logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}")
    return n


def completion_logprobs(tokens: list[str], values: list[float], top: int) -> dict:
    """vLLM's CompletionLogProbs (vllm/entrypoints/openai/completion/protocol.py:647). The sim knows
    no alternatives to its tokens: each top_logprobs entry holds the sampled token alone."""
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
            "top_logprobs": [{t: v} for t, v in zip(tokens, values)] if top else None}


def chat_logprobs(tokens: list[str], values: list[float], top: int) -> dict:
    """The chat shape: one entry per token under `content`."""
    return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}] if top else []}
                        for t, v in zip(tokens, values)]}


def answer_logprobs(chat: bool, tokens: list[str], values: list[float], top: int) -> dict:
    return (chat_logprobs if chat else completion_logprobs)(tokens, values, top)
