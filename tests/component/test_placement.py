"""Placement by GPU memory, against the simulator's memory oracle: every simulated engine
charges a shared ledger (80 GB per device) and fails to boot or wake exactly as vLLM does
when the memory is not there, so a router that miscounts shows up as a failed engine."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.sim.memory import read_ledger
from tests.support import FAST_SIM, SIM_LAUNCHER, RouterProcess, ask, client, dev_steps, eventually, roster_dict, sim_model

SHARE = "--gpu-memory-utilization"

# Without GPU sizes the KV tier (level 0) is not offered, since what a release frees cannot be sized, so
# every park here is a full one: these scenarios are about Level 1 against Level 2 and host RAM.
FULL_PARKS = {"gpus": None}


def model(name: str, share: float, *args: str, **extra) -> dict:
    return sim_model(name, args=(SHARE, str(share), *args), **extra)


async def states(router: RouterProcess) -> dict[str, str]:
    return {e["name"]: e["state"] for e in (await router.status())["engines"]}


async def sim_steps(router: RouterProcess, name: str) -> list[str]:
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/log") as r:
        return dev_steps(await r.json())


def ledger(router: RouterProcess) -> dict:
    return read_ledger(router.env["HOTSWAP_SIM_GPU_LEDGER"])


async def test_two_small_models_alternate_with_zero_swaps_and_a_big_one_parks_exactly_one(start_router):
    router = await start_router(roster_dict(
        model("small1", 0.3, default=True), model("small2", 0.3, default=True), model("big", 0.6)))
    assert await states(router) == {"small1": "awake", "small2": "awake", "big": "sleeping"}, \
        "boot parks the non-default model to make room for the defaults"
    c = client(router)
    for name in ["small1", "small2"] * 5:
        assert await ask(c, name)
    assert (await router.status())["swaps"] == [], "both fit: alternating needs no swap at all"
    assert await ask(c, "big")
    awake = {n for n, s in (await states(router)).items() if s == "awake"}
    assert "big" in awake and len(awake) == 2, f"0.6 + 0.3 fit: exactly one small model was parked ({awake})"
    [swap] = (await router.status())["swaps"]
    assert swap["to"] == "big" and len(swap["from"]) == 1
    used = ledger(router)["devices"]["0"]["used_gb"]
    assert used == pytest.approx(80 * 0.9 + 1.0, abs=0.01), "the oracle holds two shares and one residual"


async def test_two_command_engines_that_fit_together_alternate_with_zero_swaps(start_router):
    # The router adds nothing to a `command:` engine's argv: its share is the one written there, not in args.
    def command_engine(name: str) -> dict:
        return {"name": name, "default": True, "command": [*SIM_LAUNCHER, f"sim/{name}", "--port", "{port}",
                "--served-model-name", "{name}", "--enable-sleep-mode", *FAST_SIM, SHARE, "0.3"]}

    router = await start_router(roster_dict(command_engine("small1"), command_engine("small2")))
    assert await states(router) == {"small1": "awake", "small2": "awake"}, "0.3 + 0.3 fit: both boot awake"
    assert {e["name"]: e["gpu_share"] for e in (await router.status())["engines"]} == {"small1": 0.3, "small2": 0.3}
    c = client(router)
    for name in ["small1", "small2"] * 2:
        assert await ask(c, name)
    assert (await router.status())["swaps"] == [], "both fit: alternating needs no swap at all"


async def test_a_big_model_waits_for_room_while_both_small_ones_serve_then_takes_it_after_max_hold(start_router):
    slow = ("--sim-token-rate", "20")
    router = await start_router(roster_dict(
        model("small1", 0.5, *slow, default=True), model("small2", 0.5, *slow, default=True), model("big", 0.6),
        swap={"max_hold_s": 1.5}))
    c = client(router)
    streams = [asyncio.create_task(ask(c, name, max_tokens=60)) for name in ("small1", "small2")]  # ~3 s each
    await eventually(lambda: _serving(router), what="both small models serving")
    waited = asyncio.get_running_loop().time()
    assert await ask(c, "big")
    waited = asyncio.get_running_loop().time() - waited
    assert waited >= 1.5, "the small ones were busy: big waited max_hold_s before one was parked"
    results = await asyncio.gather(*streams, return_exceptions=True)
    parked = [r for r in results if isinstance(r, Exception)]
    assert len(parked) <= 1, f"only the one parked small model's stream may have been cut at the drain: {results}"


async def _serving(router: RouterProcess) -> bool:
    return all(e["in_flight"] for e in (await router.status())["engines"] if e["name"].startswith("small"))


async def test_a_pinned_model_is_never_parked_even_when_it_is_the_least_used(start_router):
    router = await start_router(roster_dict(
        model("pinned", 0.3, pin=True), model("a", 0.3, default=True), model("big", 0.6)))
    c = client(router)
    for _ in range(5):
        assert await ask(c, "a")
    assert await ask(c, "big")
    assert (await states(router)) == {"pinned": "awake", "a": "sleeping", "big": "awake"}


async def test_models_in_one_group_are_never_awake_together_though_memory_fits(start_router):
    router = await start_router(roster_dict(
        model("a", 0.2, group="g", default=True), model("b", 0.2, group="g"), model("free", 0.2)))
    c = client(router)
    assert await ask(c, "b")
    assert await states(router) == {"a": "sleeping", "b": "awake", "free": "awake"}
    assert await ask(c, "a")
    assert await states(router) == {"a": "awake", "b": "sleeping", "free": "awake"}


def checkpoint(tmp_path: Path, name: str, gb: float) -> str:
    folder = tmp_path / name
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(int(gb * 1e9))  # sparse: any apparent size, no disk used
    return str(folder)


# The simulator's Level-1 backup in host RAM, at real size (engines/sim/host_memory.py): with a 20 MB
# checkpoint a sleeper holds 33.6 MB (its tensors rounded up to powers of two); estimated 27 MB.
HOST_MODEL = ("--sim-host-bytes-per-gb", "1e9")


async def test_the_sleep_level_is_chosen_by_the_host_ram_budget(start_router, tmp_path):
    # Each 0.6: one awake at a time. 20 MB of weights each; the budget holds one at Level 1. Speculative,
    # so the worker extension empties the host cache after a Level-1 wake.
    spec = {"speculative": {"num_speculative_tokens": 3}}
    roster = roster_dict(
        model("a", 0.6, *HOST_MODEL, model=checkpoint(tmp_path, "a", 0.02), **spec),
        model("b", 0.6, *HOST_MODEL, model=checkpoint(tmp_path, "b", 0.02), **spec),
        model("c", 0.6, *HOST_MODEL, model=checkpoint(tmp_path, "c", 0.02), default=True, **spec), **FULL_PARKS, host={"ram_budget_gb": 0.05})
    router = await start_router(roster)
    levels = {e["name"]: (e["state"], e["sleep_level"], e["weights_gb"]) for e in (await router.status())["engines"]}
    assert levels == {"a": ("sleeping", 1, 0.02), "b": ("sleeping", 2, 0.02), "c": ("awake", None, 0.02)}, \
        "a took the budget at Level 1; b, parked next, did not fit in host RAM and went to Level 2"
    a = (await router.engine("a"))["host_memory"]
    assert (await router.status())["placement"]["host"] == {"ram_budget_gb": 0.05, "level1_gb": pytest.approx(a["measured_gb"], abs=1e-4),
                                                            "page_cache_budget_gb": 0.0, "staged_gb": 0.0}
    assert await ask(client(router), "a")
    assert (await sim_steps(router, "a"))[-2:] == ["wake", "reset_prefix_cache"], "a Level-1 wake: no reload, no draft step"
    assert (await router.engine("c"))["sleep_level"] == 2, "c parked while a, waiting for its room, still held its copy"
    assert (await router.engine("a"))["host_memory"]["measured_gb"] == 0, "a's wake emptied its host cache"
    assert await ask(client(router), "c")
    assert (await router.engine("a"))["sleep_level"] == 1, "nothing else is held for sleep: a fits in RAM at Level 1 again"


async def test_a_level1_sleeper_nobody_asks_for_is_demoted_to_make_ram_for_a_busy_model(start_router, tmp_path):
    slow_l2 = ("--sim-step-delay", "reload_weights=0.4")
    # Speculative, so their Level-1 wakes give the host RAM back (the worker extension empties the cache).
    spec = {"speculative": {"num_speculative_tokens": 3}}
    roster = roster_dict(
        model("idle", 0.6, *slow_l2, *HOST_MODEL, model=checkpoint(tmp_path, "idle", 0.02), **spec),
        model("hot", 0.6, *slow_l2, *HOST_MODEL, model=checkpoint(tmp_path, "hot", 0.02), default=True, **spec),
        model("other", 0.6, *slow_l2, *HOST_MODEL, model=checkpoint(tmp_path, "other", 0.02), **spec),
        **FULL_PARKS, host={"ram_budget_gb": 0.05})
    router = await start_router(roster)
    c = client(router)
    # Measure their Level-1 and Level-2 wakes, and make them the popular ones.
    for name in ["other", "hot"] * 4 + ["other"]:
        assert await ask(c, name)
    # idle was parked first, at Level 1, and never asked for; once the others' wakes were measured,
    # parking one of them at Level 1 was worth more than keeping idle there, and idle made way. The
    # budget holds one copy: the one parked while the other still holds its own (until its wake ends)
    # goes to Level 2, so the slot stays with the engine that took it.
    assert await ask(c, "hot")
    other, idle = await router.engine("other"), await router.engine("idle")
    assert other["sleep_level"] == 1, other
    assert idle["state"] in ("sleeping", "cold") and idle["sleep_level"] != 1, idle
    assert re.search(r"(stopping|demoting) idle .*host RAM for (hot|other) at level 1", router.log())
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        metrics = await r.text()
    assert 'hotswap_evictions_total{group="",model="idle",reason="stop"} 1.0' in metrics \
        or 'hotswap_evictions_total{group="",model="idle",reason="demote"} 1.0' in metrics, metrics


@pytest.fixture(scope="module")
def oracle_router(tmp_path_factory):
    """One router with six engines of uneven shares on two GPUs (one spans both), for the randomized sequences."""
    path = tmp_path_factory.mktemp("oracle")
    roster = roster_dict(
        model("w", 0.5, devices=[0]), model("x", 0.3, devices=[0]), model("y", 0.4, devices=[0, 1]),
        model("z", 0.7, devices=[1], default=True), model("g1", 0.2, devices=[1], group="g"),
        model("g2", 0.2, devices=[1], group="g"))
    router = RouterProcess(roster, path, {"HOTSWAP_SIM_GPU_LEDGER": str(path / "ledger.json")})
    asyncio.run(router.wait_ready(60))
    yield router
    router.stop()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(["w", "x", "y", "z", "g1", "g2"]), min_size=1, max_size=4), min_size=2, max_size=5))
def test_no_request_sequence_makes_the_router_overcommit_a_gpu(oracle_router, waves):
    async def run() -> None:
        # Its own client: each example runs in its own event loop.
        async with openai.AsyncOpenAI(base_url=oracle_router.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            for wave in waves:  # each wave at once: concurrent wakes on both GPUs
                answers = await asyncio.gather(*(ask(c, name) for name in wave), return_exceptions=True)
                assert all(isinstance(a, str) and a for a in answers), answers
        status = await oracle_router.status()
        assert not [e["failure"] for e in status["engines"] if e["failure"]], "an engine failed: the oracle refused memory"
        for device, held in ledger(oracle_router)["devices"].items():
            assert held["used_gb"] <= 80 + 0.01, (device, held)

    asyncio.run(run())


async def test_the_predicted_wait_is_shown_and_a_client_may_refuse_to_wait_longer_than_it_likes(start_router):
    router = await start_router(roster_dict(
        model("a", 0.6, default=True), model("b", 0.6, "--sim-step-delay", "reload_weights=1")))
    c = client(router)
    assert await ask(c, "b") and await ask(c, "a")  # b's Level-2 wake is measured: about 1 s
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/v1/models") as r:
            listed = {m["id"]: m["wake_estimate_s"] for m in (await r.json())["data"]}
        assert listed["a"] == 0 and listed["b"] >= 1.0, listed
        body = {"model": "b", "prompt": "x", "max_tokens": 4}
        async with s.post(router.url + "/v1/completions", json=body, headers={"X-Hotswap-Max-Wait": "0.2"}) as r:
            assert r.status == 503 and float(r.headers["Retry-After"]) >= 1
            error = (await r.json())["error"]
            assert error["code"] == "model_not_ready" and "exceeds X-Hotswap-Max-Wait: 0.2" in error["message"], error
        async with s.post(router.url + "/v1/completions", json=body, headers={"X-Hotswap-Max-Wait": "soon"}) as r:
            assert r.status == 400 and "X-Hotswap-Max-Wait must be a number of seconds" in (await r.json())["error"]["message"]
        async with s.post(router.url + "/v1/completions", json=body, headers={"X-Hotswap-Max-Wait": "30"}) as r:
            assert r.status == 200, "a limit above the prediction waits as usual"
    assert (await router.engine("b"))["state"] == "awake"
    assert (await router.engine("a"))["wake_estimate_s"] > 0


async def test_an_engine_whose_load_format_cannot_reload_is_stopped_when_host_ram_has_no_room_at_level_1(start_router):
    """--load-format tensorizer cannot reload weights from disk (vLLM 0.32), so a Level-2 wake would
    fail: with no host RAM for Level 1 the router stops it instead, and it boots cold when asked for."""
    router = await start_router(roster_dict(
        model("tz", 0.6, "--load-format", "tensorizer", weights_gb=8), model("other", 0.6, weights_gb=8),
        **FULL_PARKS, host={"ram_budget_gb": 1}))
    assert await states(router) == {"tz": "cold", "other": "awake"}, "tz made room to boot other by stopping"
    log = router.log()
    assert "stopping tz (awake): room to boot other; no room for it at level 1 in host RAM, and its --load-format " \
           "cannot reload weights from disk" in log, log
    assert await ask(client(router), "tz"), "tz boots cold when asked for"
    assert await states(router) == {"tz": "awake", "other": "sleeping"}
    assert (await router.engine("other"))["sleep_level"] == 2, "other, which can reload, sleeps at level 2 as before"
    assert "reload_weights" not in await sim_steps(router, "tz"), "tz was never asked to reload"

