"""The gate's own measurement (`engines.gate.canary.run_canary`) against real vLLM's counters on CPU.

vLLM's spec-decode counters overshoot a completion: a 32-token greedy completion with
`num_speculative_tokens: 2` counts 11 drafts and 22 accepted tokens (33 > 31 decoded
after the prefill: the last step's accepted drafts are counted though max_tokens cuts
them). The gate waits until `vllm:generation_tokens_total` has moved by the completion's
tokens and the drafts have moved; this proves that wait never reads a half-updated delta.
At temperature 0 the complete counts are known exactly: a healthy draft (the target as its
own draft) accepts everything, ceil((T-1)/(k+1)) drafts and k times as many accepted; a
discarded draft accepts nothing, T-1 drafts. Any early read would count fewer.
"""

from __future__ import annotations

import math

import aiohttp
import pytest

from config.schema import Gate
from engines.gate.canary import FROM_COUNTERS, read_counters, run_canary
from engines.vllm.client import VLLMClient
from tests.integration.harness import REPORT, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

K = 2
REPEATS = 3


async def test_the_gates_counter_wait_reads_complete_deltas_on_real_vllm(spec_engine: VllmServer) -> None:
    engine = spec_engine
    (result,), _ = engine.rpc("hotswap_reload_draft")
    assert result["reloaded"] is True, result
    report = REPORT.setdefault("gate_counters", {})
    try:
        async with aiohttp.ClientSession() as session:
            client = VLLMClient(engine.url, session)
            for state in ("healthy", "discarded"):
                if state == "discarded":
                    engine.rpc("hotswap_discard_draft")
                for tokens in (8, 16, 32, 64):
                    cfg = Gate(max_tokens=tokens)
                    for _ in range(REPEATS):
                        before = read_counters(await client.metrics())
                        canary = await run_canary(client, engine.name, cfg, True, timeout=60)
                        now = read_counters(await client.metrics())
                        assert canary.tokens == tokens and canary.source == FROM_COUNTERS, canary  # no per-request flag here
                        if state == "healthy":
                            drafts = math.ceil((tokens - 1) / (K + 1))
                            expected = (drafts, K * drafts, 1.0 + K)
                        else:
                            expected = (tokens - 1, 0, 1.0)
                        assert (canary.drafts, canary.accepted, canary.mal) == expected, (state, tokens, canary)
                        # Nothing landed after the gate's last read: a read after it agrees.
                        assert (now.drafts - before.drafts, now.accepted - before.accepted) == expected[:2]
                        assert now.generated - before.generated == tokens
                    report[f"{state} T={tokens}"] = {"drafts": canary.drafts, "accepted": canary.accepted,
                                                     "mal": canary.mal, "seconds": round(canary.seconds, 3)}
    finally:
        (result,), _ = engine.rpc("hotswap_reload_draft")  # leave the shared engine healthy
        assert result["reloaded"] is True, result
