"""Acceptance per request: the gate and the mid-life watch read each answer's own
`metrics.speculative_decoding` (vLLM's --per-request-spec-decode-metrics, router-owned), so
traffic of another acceptance on the same engine no longer mixes into the number; an engine
whose answers do not carry it is judged from the counter deltas, as before."""

from __future__ import annotations

import sys
import time

import aiohttp

from engines.gate.canary import FROM_ANSWER, FROM_COUNTERS, read_counters, mean_acceptance_length
from tests.support import FAST_SIM, client, eventually, roster_dict, sim_model, traffic_beside

NOISE = "noise"  # prompts containing it decode at NOISE_MAL (--sim-prompt-acceptance)
NOISE_MAL = 1.2
HEALTHY_MAL = 2.6  # the simulator's default, the canary's


def spec_model(name: str, **extra):
    return sim_model(name, spec=True, **extra)


def noise_on(base_url: str):
    """Other clients of engine `a`, straight to its port, at NOISE_MAL; yields the count answered.
    Short answers: the simulator counts a request's drafts when it ends, so many must end inside
    the canary for its counter deltas to show the mix (vLLM counts every step)."""
    return traffic_beside(base_url, "a", f"{NOISE} traffic", max_tokens=8, workers=4)


async def engine_counters(base_url: str):
    async with aiohttp.ClientSession() as s, s.get(base_url + "/metrics") as r:
        return read_counters(await r.text())


async def test_a_canary_judged_beside_traffic_of_another_acceptance_gets_its_own_number(engine_factory):
    engine = engine_factory(spec_model("a", args=("--sim-prompt-acceptance", f"{NOISE}={NOISE_MAL}", "--sim-token-rate", "200")))
    await engine.boot()
    assert engine.gate.baseline.source == FROM_ANSWER and abs(engine.gate.baseline.mal - HEALTHY_MAL) < 0.1, engine.gate.baseline
    await engine.sleep()
    base = engine.client.base_url
    before = await engine_counters(base)
    async with noise_on(base) as answered:
        await engine.wake()  # the noise waits for the wake, then decodes beside the canary
        assert not engine.restarts, f"the canary was refused and the engine restarted: {dict(engine.restarts)}"
        verdict = engine.gate.last_verdict
        assert verdict.result == "passed" and verdict.acceptance_source == FROM_ANSWER, verdict
        assert abs(verdict.observed_mal - HEALTHY_MAL) < 0.1, verdict
        assert "(from the canary's own answer)" in verdict.reason
        await eventually(lambda: answered[0] >= 12, timeout=20, what="noise answered after the wake")
    after = await engine_counters(base)
    # The engine-wide counters over the same time are mixed with the noise: what the gate used to read.
    mixed = mean_acceptance_length(after.drafts - before.drafts, after.accepted - before.accepted)
    assert mixed < HEALTHY_MAL - 0.5, mixed


async def test_an_engine_whose_answers_carry_no_numbers_is_judged_from_the_counters(engine_factory):
    # A `command:` engine: the router adds nothing to its argv, so no --per-request-spec-decode-metrics.
    command = [sys.executable, "-m", "engines.sim", "serve", "sim/a", "--port", "{port}", "--served-model-name", "a",
               "--enable-sleep-mode", "--speculative-config", '{{"num_speculative_tokens": 3}}',
               "--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension", *FAST_SIM]
    engine = engine_factory({"name": "a", "command": command, "speculative": {"num_speculative_tokens": 3}})
    await engine.boot()
    answer = await engine.client.completion({"model": "a", "prompt": "hello", "max_tokens": 8}, timeout=10)
    assert "metrics" not in answer  # the fallback is really taken, not chosen by a guess
    assert engine.gate.baseline.source == FROM_COUNTERS and abs(engine.gate.baseline.mal - HEALTHY_MAL) < 0.1, engine.gate.baseline
    await engine.sleep()
    await engine.wake()
    verdict = engine.gate.last_verdict
    assert verdict.result == "passed" and verdict.acceptance_source == FROM_COUNTERS, verdict
    assert "(from the engine's counters)" in verdict.reason


async def test_the_midlife_watch_judges_served_answers_by_their_own_numbers(start_router):
    # Served traffic (buffered and streamed, through the router) decodes at the healthy MAL; another
    # client of the same engine, straight to its port, at NOISE_MAL would drag the counters' window
    # below the floor and flag a collapse.
    watched = spec_model("a", default=True, args=("--sim-prompt-acceptance", f"{NOISE}={NOISE_MAL}"),
                         gate={"midlife_window_s": 2, "midlife_min_drafts": 20, "min_acceptance_ratio": 0.8})
    router = await start_router(roster_dict(watched))
    port = (await router.engine("a"))["port"]
    c = client(router)

    async def served_and_watched(since: float):
        await c.completions.create(model="a", prompt="hello", max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
        stream = await c.completions.create(model="a", prompt="hello", max_tokens=64, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for _ in stream:
            pass
        watch = (await router.engine("a"))["acceptance_watch"]
        return watch is not None and watch["at"] > since and watch

    async with noise_on(f"http://127.0.0.1:{port}") as answered:
        await eventually(lambda: answered[0] >= 3, timeout=20, what="noise answered")
        since = time.time() + 2  # a whole window after the noise began
        watch = await eventually(lambda: served_and_watched(since), timeout=20, interval=0.05, what="the watch judging")
        e = await router.engine("a")
    assert watch["source"] == FROM_ANSWER and abs(watch["observed_mal"] - HEALTHY_MAL) < 0.15, watch
    assert not e["collapsed"] and e["last_collapse"] is None, e
