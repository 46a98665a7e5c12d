"""The KV tier end to end: the real router process with simulated engines on the memory oracle
(80 GB per device). A small model's KV cache is released to make room for another, the swap
record and the metrics show its phases, /admin/status shows level 0, and it comes back with a KV
wake (no weight step), gated like any wake."""

from __future__ import annotations

import asyncio

import pytest

from tests.component.test_gate import metric, router_metrics
from tests.component.test_placement import ledger, model, sim_steps
from tests.support import ask, client, eventually, roster_dict

pytestmark = pytest.mark.timeout(60)

# small: 0.5 of 80 GB, of which 8 GB weights (the router's weights_gb and the sim's alike) and 1 GB residual.
SMALL = model("small", 0.5, "--sim-weights-gb", "8", weights_gb=8, default=True)
BIG = model("big", 0.6)


async def test_a_small_models_kv_cache_makes_room_for_another_and_it_comes_back_with_a_kv_wake(start_router):
    router = await start_router(roster_dict(SMALL, BIG))
    c = client(router)
    assert await ask(c, "small")
    assert await ask(c, "big")
    small = await router.engine("small")
    assert (small["state"], small["sleep_level"]) == ("sleeping", 0), "KV-parked, its weights on the GPU"
    assert ledger(router)["devices"]["0"]["used_gb"] == pytest.approx(48 + 9, abs=0.01), \
        "the oracle: big's share beside small's weights and residual"
    [swap] = [s for s in (await router.status())["swaps"] if s["to"] == "big"]
    assert swap["from"] == ["small"] and {"sleep", "release_kv_cache"} <= set(swap["phases"])
    assert (await sim_steps(router, "small"))[-2:] == ["sleep", "release_kv_cache_memory"]

    assert await ask(c, "small")
    back = [s for s in (await router.status())["swaps"] if s["to"] == "small"][0]
    assert [p for p in back["phases"] if p in ("wake_weights", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate")] \
        == ["wake_kv_cache", "reset_prefix_cache", "gate"], "a KV re-allocation, then the gate: no weight copy"
    assert (await router.engine("small"))["last_verdict"]["result"] == "passed"
    values = await router_metrics(router)
    for phase in ("release_kv_cache", "wake_kv_cache"):
        assert metric(values, "hotswap_swap_phase_duration_seconds_count", model="small", group="", phase=phase) >= 1


async def test_a_kv_wake_with_undefined_pages_is_refused_by_the_gate(start_router):
    noisy = model("small", 0.5, "--sim-weights-gb", "8", "--sim-wake-logprob-noise", "2.0", weights_gb=8, default=True,
                  gate={"max_tokens": 16, "on_fail": "refuse"})
    router = await start_router(roster_dict(noisy, BIG))
    c = client(router)
    assert await ask(c, "big")
    assert (await router.engine("small"))["sleep_level"] == 0
    with pytest.raises(Exception):
        await ask(c, "small")
    small = await router.engine("small")
    assert small["state"] == "failed" and "gate refused" in (small["failure"] or ""), \
        "a wake that moved no weights is still checked: the garbage-KV-page fault is a KV fault"


async def test_a_kv_parked_model_goes_down_a_rung_when_the_room_its_weights_keep_is_needed(start_router):
    slow = ("--sim-token-rate", "20")
    router = await start_router(roster_dict(
        SMALL, model("big", 0.6, *slow), model("mid", 0.25, "--sim-boot-s", "1.5"), model("tiny", 0.1)))
    c = client(router)
    assert await ask(c, "small")
    for _ in range(3):
        assert await ask(c, "mid")  # mid is asked for more than small, and its boot is slow: dear to park
    assert await ask(c, "big")
    small = await router.engine("small")
    assert (small["state"], small["sleep_level"]) == ("sleeping", 0), "its KV cache was enough for big"
    pid = small["pid"]
    streaming = asyncio.create_task(ask(c, "big", max_tokens=60))  # ~3 s: big is busy meanwhile
    await eventually(lambda: _in_flight(router, "big"), what="big serving")
    assert await ask(c, "tiny")
    small = await router.engine("small")
    assert small["state"] == "sleeping" and small["sleep_level"] in (1, 2) and small["pid"] == pid, \
        "the weights left the GPU, the process stayed: no cold boot next time"
    assert (await sim_steps(router, "small"))[-3:] == ["sleep", "release_kv_cache_memory", "sleep"], "no wake between"
    assert (await router.engine("mid"))["state"] == "awake"
    assert await streaming, "big's stream was not cut"
    assert f"parking small further, from its KV park down to level {small['sleep_level']}" in router.log()


async def _in_flight(router, name: str) -> bool:
    return (await router.engine(name))["in_flight"] > 0
