"""Acceptance per request on real vLLM (CPU): with --per-request-spec-decode-metrics summary (what
engines.process.compose_argv adds to a speculative engine), a canary's own
`metrics.speculative_decoding` gives the same mean acceptance length as the engine's
`vllm:spec_decode_*` counter deltas around it, healthy draft or discarded one, so the gate may
read it instead of the counters (and then needs no engine to itself).

Its own engine: the shared `spec_engine` runs without the flag, for the counter path's test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import aiohttp
import pytest

from config.schema import Gate
from engines.gate.canary import FROM_ANSWER, _landed, answer_spec_counts, mean_acceptance_length, read_counters, run_canary
from engines.vllm.client import VLLMClient
from tests.integration.harness import EXTENSION, REPORT, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

K = 2


@pytest.fixture(scope="module")
def per_request_engine(vllm_env: dict[str, str], tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    target = tiny_models / "target"
    server = VllmServer(
        "tiny-spec-per-request", target,
        [
            "--speculative-config", json.dumps({"model": str(target), "num_speculative_tokens": K}),
            "--per-request-spec-decode-metrics", "summary",
            "--worker-extension-cls", EXTENSION,
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        ],
        env={}, log_dir=tmp_path_factory.mktemp("engine-logs"),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_canarys_own_acceptance_equals_the_counters_around_it_on_real_vllm(per_request_engine: VllmServer) -> None:
    engine = per_request_engine
    report = REPORT.setdefault("acceptance_per_request", {})
    try:
        async with aiohttp.ClientSession() as session:
            client = VLLMClient(engine.url, session)
            for state in ("healthy", "discarded"):
                if state == "discarded":
                    engine.rpc("hotswap_discard_draft")
                for tokens in (16, 64):
                    before = read_counters(await client.metrics())
                    canary = await run_canary(client, engine.name, Gate(max_tokens=tokens), True, timeout=60)
                    assert canary.source == FROM_ANSWER, canary
                    # The gate did not wait for the counters; wait for them here, as the counter path does.
                    after = await _landed(client, before, tokens, True, deadline=time.monotonic() + 30)
                    drafts, accepted = after.drafts - before.drafts, after.accepted - before.accepted
                    from_counters = mean_acceptance_length(drafts, accepted)
                    assert canary.mal == pytest.approx(from_counters), (state, tokens, canary, drafts, accepted)
                    assert (canary.drafts, canary.accepted) == (drafts, accepted), (state, tokens, canary)
                    report[f"{state} T={tokens}"] = {"answer": [canary.drafts, canary.accepted, canary.mal],
                                                     "counters": [drafts, accepted, from_counters]}
                    if state == "healthy":
                        assert canary.mal == pytest.approx(1.0 + K)  # the target as its own draft accepts all
                    else:
                        assert canary.mal == pytest.approx(1.0)
            # A stream carries them on its final usage event, which the proxy reads for the mid-life watch.
            body = {"model": engine.name, "prompt": "hello", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(engine.url + "/v1/completions", json=body) as r:
                raw = await r.read()
            assert answer_spec_counts(raw[-4096:]) is not None, raw[-800:]
    finally:
        (result,), _ = engine.rpc("hotswap_reload_draft")
        assert result["reloaded"] is True, result

