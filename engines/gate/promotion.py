"""The gate step of a boot or a wake: run the canaries, then record the baseline or judge against it.

At the first cold boot the canary runs twice: the first is the baseline, the second measures
how far the engine's own logprobs move between two identical requests (its spread, which a
threshold below it would turn into a refusal of every healthy wake). Every later gate, after
a wake or a restart, runs it once and is judged against that baseline (`engines.gate.verdict.judge`).
A gate.lora_canary runs through its adapter too, for the output check alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from config.schema import Gate
from engines.gate.canary import Canary, run_canary
from engines.gate.verdict import Verdict, baseline_verdict, judge, judge_adapter, skipped
from engines.vllm.client import VLLMClient


class Baseline(NamedTuple):
    model: Canary
    lora: Optional[Canary]  # gate.lora_canary's


def canaries(config: Gate, first: bool) -> int:
    """How many canaries the gate step runs (each gets swap.timeouts.gate): the model's, its replay at
    the first cold boot when logprobs are compared, and the LoRA adapter's."""
    if not config.enabled:
        return 1
    return 1 + (first and config.max_logprob_drift is not None) + (config.lora_canary is not None)


async def run_gate(client: VLLMClient, served_name: str, served_names: frozenset[str], config: Gate, has_draft: bool,
                   baseline: Optional[Baseline], timeout: float) -> tuple[Verdict, Optional[Baseline]]:
    """The verdict, and the baseline it recorded (None unless this was the first, passed, cold-boot gate).
    `timeout`: each canary's (the step as a whole is bounded by its caller)."""
    if not config.enabled:
        return skipped("gate.enabled is false: promoted without a canary"), None
    adapter = config.lora_canary
    if adapter is not None and adapter not in served_names:
        return Verdict(False, "refused", f"gate.lora_canary '{adapter}' is not served by this engine "
                            f"(it serves {sorted(served_names)}): start it with --enable-lora --lora-modules {adapter}=PATH"), None
    logprobs = config.max_logprob_drift is not None
    canary = await run_canary(client, served_name, config, has_draft, timeout, logprobs)
    # The adapter's canary checks output only: acceptance and logprobs are the model's, measured above.
    lora = await run_canary(client, adapter, config, False, timeout) if adapter else None
    if baseline is None:
        replay = await run_canary(client, served_name, config, has_draft, timeout, logprobs) if logprobs else None
        verdict = baseline_verdict(canary, replay, config)
        return verdict, Baseline(canary, lora) if verdict.passed else None
    verdict = judge(baseline.model, canary, config)
    if lora is not None and baseline.lora is not None:
        verdict = judge_adapter(verdict, adapter, baseline.lora, lora, config)
    return verdict, None
