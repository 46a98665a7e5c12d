"""The gate step of a boot or a wake: run the canaries, then record the baseline or judge against it.

At the first cold boot the canary runs twice: the first is the baseline, the second measures
how far the engine's own logprobs move between two identical requests (its spread, which a
threshold below it would turn into a refusal of every healthy wake). Every later gate, after
a wake or a restart, runs it once and is judged against that baseline (`engines.gate.verdict.judge`).
A gate.lora_canary runs through its adapter too, for the output check alone.

A wake that moved no weights from disk (`SHORT_WAKE_LEVELS`) runs the short wake canary instead
(gate.wake_max_tokens), judged against its own baseline of that length, recorded at the first
cold boot by one canary more: a 16-token MAL is not a 64-token one (the first tokens draft
differently), so comparing across lengths would refuse healthy wakes. docs/gate.md has the numbers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

from config.schema import Gate
from engines.gate.canary import Canary, run_canary
from engines.gate.verdict import Verdict, baseline_verdict, judge, judge_adapter, skipped
from engines.vllm.client import VLLMClient
from engines.waking.ladder import KV_PARKED

# The wakes whose weights never left the machine's memory: the KV-only rung re-maps the KV cache alone,
# Level 1 copies the weights back from host RAM. The Level-2 draft loss (vLLM #52479) cannot happen
# there; garbage KV pages, gibberish and numeric drift show from the first tokens on.
SHORT_WAKE_LEVELS = (KV_PARKED, 1)


class Baseline(NamedTuple):
    model: Canary
    lora: Optional[Canary]  # gate.lora_canary's
    wake: Optional[Canary] = None  # the short wake canary's (gate.wake_max_tokens); None without one


def canaries(config: Gate, first: bool) -> int:
    """How many canaries the gate step runs (each gets swap.timeouts.gate): the model's, its replay at
    the first cold boot when logprobs are compared, the short wake canary's baseline then, and the LoRA
    adapter's."""
    if not config.enabled:
        return 1
    replay = first and config.max_logprob_drift is not None
    short = first and config.wake_tokens is not None
    return 1 + replay + short + (config.lora_canary is not None)


def wake_canary(config: Gate, woke_from: Optional[int], baseline: Optional[Baseline]) -> Optional[int]:
    """The short canary's length for this gate step, or None for the full canary: a cold boot or a
    restart (`woke_from` None), a Level-2 wake, gate.wake_max_tokens null, or no short baseline."""
    if woke_from not in SHORT_WAKE_LEVELS or baseline is None or baseline.wake is None:
        return None
    return config.wake_tokens


async def run_gate(client: VLLMClient, served_name: str, served_names: frozenset[str], config: Gate, has_draft: bool,
                   baseline: Optional[Baseline], timeout: float, woke_from: Optional[int] = None) -> tuple[Verdict, Optional[Baseline]]:
    """The verdict, and the baseline it recorded (None unless this was the first, passed, cold-boot gate).
    `timeout`: each canary's (the step as a whole is bounded by its caller). `woke_from`: the sleep level
    of the wake this gate follows (None: a boot)."""
    if not config.enabled:
        return skipped("gate.enabled is false: promoted without a canary"), None
    adapter = config.lora_canary
    if adapter is not None and adapter not in served_names:
        return Verdict(False, "refused", f"gate.lora_canary '{adapter}' is not served by this engine "
                            f"(it serves {sorted(served_names)}): start it with --enable-lora --lora-modules {adapter}=PATH"), None
    logprobs = config.max_logprob_drift is not None
    short = wake_canary(config, woke_from, baseline)
    canary = await run_canary(client, served_name, config, has_draft, timeout, logprobs, short)
    # The adapter's canary checks output only: acceptance and logprobs are the model's, measured above.
    lora = await run_canary(client, adapter, config, False, timeout) if adapter else None
    if baseline is None:
        replay = await run_canary(client, served_name, config, has_draft, timeout, logprobs) if logprobs else None
        # The short canary's baseline: its spread is the replay's (the same engine, the same first tokens).
        tokens = config.wake_tokens
        wake = await run_canary(client, served_name, config, has_draft, timeout, logprobs, tokens) if tokens else None
        verdict = baseline_verdict(canary, replay, config, wake)
        return verdict, Baseline(canary, lora, wake) if verdict.passed else None
    if short is not None and baseline.wake is not None:
        verdict = judge(baseline.wake, canary, config)
        verdict = replace(verdict, reason=f"{short}-token wake canary: {verdict.reason}", canary="wake")
    else:
        verdict = judge(baseline.model, canary, config)
    if lora is not None and baseline.lora is not None:
        verdict = judge_adapter(verdict, adapter, baseline.lora, lora, config)
    return verdict, None
