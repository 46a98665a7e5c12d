"""The simulator's KV tier, with real sim processes on loopback: `/sleep?level=0` pauses,
`/release_kv_cache_memory` frees the KV cache (the memory oracle sees the share less the weights go),
and `/wake_up?tags=kv_cache` maps it back, as vLLM 0.32 does (v1/engine/core.py:959-1039; the refusals'
texts are those the CPU tier answered). A generation sent meanwhile hangs until the wake.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.component.test_sim_memory import call, holdings, http, ledger, start  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(30)


async def release(http, sim) -> tuple[int, dict]:
    """POST /release_kv_cache_memory on a connection of its own, as hotswap's client sends it: a refusal
    raises through vLLM's ASGI app, and uvicorn drops the connection after its 500."""
    async with http.post(sim.url + "/release_kv_cache_memory", headers={"Connection": "close"}) as r:
        return r.status, json.loads(await r.text())


def refused(why: str) -> dict:
    return {"error": {"message": f"Call to release_kv_cache_memory method failed: release_kv_cache_memory() requires {why}",
                      "type": "InternalServerError", "param": None, "code": 500}}


async def test_a_kv_release_frees_the_share_less_the_weights_and_its_wake_maps_it_back(start, ledger, http):
    a = start(0.5, "0", None, "--sim-weights-gb", "8", "--sim-sleep-residual-gb", "1")
    assert await release(http, a) == (500, refused("a completed pause first"))
    assert await call(http, a, "POST", "/sleep", {"level": "0", "mode": "wait"}) == (200, {"status": "sleeping", "level": 0})
    assert holdings(ledger) == {a.pid: {"0": 40.0}}, "level 0 only pauses"
    assert await release(http, a) == (200, {"status": "kv_cache_released"})
    assert holdings(ledger) == {a.pid: {"0": 9.0}}, "the weights (8) and the residual (1) stay; the KV cache (31) is free"
    assert await release(http, a) == (500, refused("all executor memory to be resident"))

    b = start(0.75)  # 60 GB fits beside the weights
    status, body = await call(http, a, "POST", "/wake_up", {"tags": "kv_cache"})
    assert status == 500 and "out of memory" in body["error"]["message"], "re-allocating the KV cache needs its room back"
    b.stop()
    assert (await call(http, a, "POST", "/wake_up", {"tags": "weights"}))[1]["status"] == "sleeping", \
        "a tag that does not sleep wakes nothing (vLLM's executor)"
    assert holdings(ledger) == {a.pid: {"0": 9.0}}
    assert (await call(http, a, "POST", "/wake_up", {"tags": "kv_cache"}))[1]["status"] == "awake"
    assert holdings(ledger) == {a.pid: {"0": 40.0}}


async def test_a_generation_sent_to_a_kv_parked_engine_hangs_until_the_kv_wake(start, ledger, http):
    a = start(0.5, "0", None, "--sim-weights-gb", "8", "--sim-step-delay", "wake_kv_cache=0.3")
    await call(http, a, "POST", "/sleep", {"level": "0"})
    await release(http, a)
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 4}
    generation = asyncio.ensure_future(http.post(a.url + "/v1/completions", json=body))
    done, _ = await asyncio.wait({generation}, timeout=0.5)
    assert not done, "vLLM accepts it and holds it while paused"
    started = time.monotonic()
    assert (await call(http, a, "POST", "/wake_up", {"tags": "kv_cache"}))[1]["status"] == "awake"
    assert time.monotonic() - started >= 0.3, "the KV re-allocation costs what --sim-step-delay says"
    async with await generation as r:
        assert r.status == 200


async def test_from_a_kv_park_an_engine_goes_down_to_level_2_without_waking(start, ledger, http):
    a = start(0.5, "0", None, "--sim-weights-gb", "8", "--sim-sleep-residual-gb", "1")
    await call(http, a, "POST", "/sleep", {"level": "0"})
    await release(http, a)
    assert (await call(http, a, "POST", "/sleep", {"level": "2"}))[0] == 200
    assert holdings(ledger) == {a.pid: {"0": 1.0}}
    for tags in ("weights", "kv_cache"):
        await call(http, a, "POST", "/wake_up", {"tags": tags})
    state = (await call(http, a, "GET", "/sim/state"))[1]
    assert state["target"] == "discarded", "a Level-2 wake still needs its reload_weights"


async def test_after_a_refused_release_the_connection_it_came_on_is_dropped_as_uvicorn_does(start_sim_engine):
    a = start_sim_engine()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as pooled:
        async with pooled.post(a.url + "/release_kv_cache_memory") as r:
            assert r.status == 500
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with pooled.post(a.url + "/sleep", params={"level": "0"}) as r:
                await r.read()

