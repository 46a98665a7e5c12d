"""The KV tier (level 0, engines/waking/ladder.py) against one real `vllm serve` on CPU.

What the CPU tier can and cannot show. vLLM 0.32's level-0 pause is real here: `/sleep?level=0`
answers as on a GPU and a generation sent meanwhile hangs until the wake. The release is not:
the CPU worker's `discard` raises "Selective discard is not supported on CPU"
(vllm/v1/worker/cpu_worker.py:187-188), so `/release_kv_cache_memory` answers 500 once the pause is
complete, yet the executor marks `kv_cache` asleep regardless (its `finally`,
v1/executor/abstract.py:424-428), so the KV wake (`/wake_up?tags=kv_cache`) resumes the engine.
The router's KV park of a real CPU engine therefore fails at its `release_kv_cache` step, naming
vLLM's cause, and the engine is FAILED rather than left counted as parked. The GPU measurement to
make (wake time, memory freed) is listed in docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from config.schema import ModelSpec, Swap
from engines.waking import ladder, steps
from engines.engine import Engine, EngineFailed, State
from engines.vllm import EngineHTTPError, VLLMClient
from tests.integration.harness import REPORT, Background, VllmServer, poll

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "The router wakes the model and"
CPU_DISCARD = "Selective discard is not supported on CPU."


async def test_the_kv_tiers_endpoints_on_cpu_pause_refuse_the_release_and_wake(spec_engine: VllmServer) -> None:
    answers = REPORT.setdefault("kv_tier", {})
    mal, baseline = spec_engine.canary(PROMPT)
    async with aiohttp.ClientSession() as session:
        client = VLLMClient(spec_engine.url, session)
        with pytest.raises(EngineHTTPError) as early:
            await client.release_kv_cache_memory(timeout=30)
        assert early.value.status == 500 and "requires a completed pause first" in early.value.body
        sleep, release = ladder.down(ladder.KV_PARKED, "wait")
        assert await sleep.run(client, 30) == {"status": "sleeping", "level": 0}
        assert await client.is_sleeping() is True

        pending = Background(lambda: spec_engine.complete(PROMPT, timeout=300))
        pending.thread.join(1.0)  # a bounded negative check: it must not finish while paused
        assert not pending.done(), f"a request finished on a paused engine: {pending.result or pending.error}"

        with pytest.raises(EngineHTTPError) as refused:
            await release.run(client, 30)
        assert refused.value.status == 500 and CPU_DISCARD in refused.value.body, refused.value.body
        answers["release_on_cpu"] = refused.value.body[:300]

        for step in steps.LEVEL0:  # the KV wake as the router runs it
            await step.run(client, 30)
        poll(pending.done, 60, "the request held while KV-parked to finish after the KV wake")
        assert pending.error is None, pending.error
        assert await client.is_sleeping() is False
    again, after = spec_engine.canary(PROMPT)
    assert again == pytest.approx(mal)
    assert after["choices"][0]["text"] == baseline["choices"][0]["text"], "the canary after the KV wake is the same"


async def test_the_routers_kv_park_of_a_cpu_engine_fails_at_the_release_naming_vllms_cause(
        spec_engine: VllmServer, tmp_path: Path) -> None:
    spec = ModelSpec(name="tiny-spec", url=spec_engine.url, sleep_level=0,
                     speculative={"model": "tiny", "num_speculative_tokens": 2}, gate={"max_tokens": 16})
    async with aiohttp.ClientSession() as session:
        engine = Engine(spec, Swap(), session, tmp_path)
        await engine.boot()
        assert engine.state is State.AWAKE
        with pytest.raises(EngineFailed) as failed:
            await engine.sleep(ladder.KV_PARKED)
        assert engine.state is State.FAILED and "release_kv_cache failed" in str(failed.value) and CPU_DISCARD in str(failed.value)
        assert list(engine.last_phases) == ["drain", "sleep", "release_kv_cache"]
        REPORT.setdefault("kv_tier", {})["router_kv_park_on_cpu"] = str(failed.value)[:300]
        # The shared engine is left as found: awake.
        client = VLLMClient(spec_engine.url, session)
        for step in steps.LEVEL0:
            await step.run(client, 30)
        assert await client.is_sleeping() is False
    assert json.dumps(REPORT["kv_tier"])
