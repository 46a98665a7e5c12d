"""An Inference Extension endpoint picker scraping a real router: GET /metrics/model-server follows the
node's engines as one is woken for a request (the picker's reading is `Picker` in
tests/unit/test_model_server.py)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support import ask, client, eventually, roster_dict, sim_model
from tests.unit.test_model_server import Picker

# Two models that do not fit awake together (0.6 of one GPU each); b's wake takes a second, so the
# picker's scrape can see it waiting.
ROSTER = roster_dict(sim_model("a", default=True, args=("--gpu-memory-utilization", "0.6")),
                     sim_model("b", aliases=["bee"], args=("--gpu-memory-utilization", "0.6", "--sim-step-delay", "reload_weights=1")))


async def scrape(router, headers=None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics/model-server", headers=headers or {}) as r:
        return r.status, await r.text()


async def picker(router) -> Picker:
    status, text = await scrape(router)
    assert status == 200, text
    return Picker.scrape(text)


async def test_a_request_that_wakes_b_moves_it_from_waiting_to_running_and_a_out(start_router):
    router = await start_router(ROSTER)
    c = client(router)
    assert await ask(c, "a")
    before = await picker(router)
    assert (before.active, before.waiting, before.max_active) == ({"a"}, set(), 1)
    assert before.lora_affinity("a") == 1.0 and before.lora_affinity("bee") == 0.0

    wake = asyncio.create_task(ask(c, "bee"))
    during = await eventually(lambda: _waking(router), timeout=10, what="b waiting in the picker's scrape")
    assert during.waiting_queue == 1  # the request for bee waits for its wake
    assert during.lora_affinity("b") == 0.6

    assert await wake
    after = await picker(router)
    assert (after.active, after.waiting) == ({"b", "bee"}, set())
    assert after.lora_affinity("bee") == 1.0 and after.lora_affinity("a") == 0.0
    assert (after.waiting_queue, after.running_requests) == (0, 0)


async def _waking(router):
    p = await picker(router)
    return p if "b" in p.waiting else None


async def test_with_client_keys_the_scrape_takes_a_metrics_key_as_metrics_does(start_router):
    keys = {"ALL_KEY": "all-secret-0003", "PROM_KEY": "prometheus-secret-0004"}
    auth = {"api_keys": ["${ALL_KEY}"], "keys": [{"key": "${PROM_KEY}", "name": "picker", "metrics": True}]}
    router = await start_router(roster_dict(sim_model("a", default=True), auth=auth), env=keys)
    status, text = await scrape(router)
    assert status == 401 and "/metrics/model-server" in text
    status, _ = await scrape(router, {"Authorization": "Bearer " + keys["ALL_KEY"]})  # a client key is not enough
    assert status == 401
    status, text = await scrape(router, {"Authorization": "Bearer " + keys["PROM_KEY"]})
    assert status == 200 and Picker.scrape(text).active == {"a"}
