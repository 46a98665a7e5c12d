"""A client that goes away before its answer is complete is recorded as 499 (nginx's "client closed
request") in the activity log and in hotswap_requests_total, never as a server error: the 5xx alerts
count what the router and its engines failed, not what clients gave up on."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ask, client, eventually, http, roster_dict, sim_model

pytestmark = pytest.mark.timeout(90)

SLOW_WAKE = ("--sim-step-delay", "reload_weights=3")
# `a` streams slowly enough to be left mid-stream; `b` shares a's group, so a request for it waits
# (queued) while a parks and b's slow Level-2 wake runs.
ROSTER = roster_dict(sim_model("a", group="g", args=("--sim-token-rate", "20")),
                     sim_model("b", group="g", sleep_level=2, args=SLOW_WAKE))


async def requests_by_status(router, model: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        text = await r.text()
    return {sample.labels["status"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "hotswap_requests" for sample in family.samples
            if sample.name == "hotswap_requests_total" and sample.labels["model"] == model}


async def the_record(router, model: str) -> dict:
    async def recorded() -> dict | None:
        _, _, body = await http(router, "GET", f"/admin/activity?model={model}", headers=router.admin_headers)
        return next(iter(body["records"]), None)

    return await eventually(recorded, 15, what=f"an activity record for {model}")


async def test_a_client_that_disconnects_mid_stream_is_recorded_as_499(start_router):
    router = await start_router(ROSTER)
    await ask(client(router), "a")
    async with aiohttp.ClientSession() as s:
        resp = await s.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 200, "stream": True})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")  # the stream is under way
        resp.close()  # and the client leaves

    async def the_second_record() -> dict | None:
        _, _, body = await http(router, "GET", "/admin/activity?model=a", headers=router.admin_headers)
        return body["records"][0] if len(body["records"]) == 2 else None

    record = await eventually(the_second_record, 15, what="the stream's record")
    assert record["status"] == 499 and record["engine"] == "a" and record["found_awake"] is True, record
    assert record["ttfb_s"] is not None and record["ttfb_s"] <= record["duration_s"], "its first byte did go out"
    assert await requests_by_status(router, "a") == {"200": 1, "499": 1}


@pytest.mark.parametrize("keepalive", [None, 0.2], ids=["plain", "with-keepalive-comments"])
async def test_a_client_that_gives_up_while_queued_for_a_swap_is_recorded_as_499(start_router, keepalive):
    router = await start_router({**ROSTER, "queue": {"stream_keepalive_s": keepalive}} if keepalive else ROSTER)
    await ask(client(router), "a")  # b is parked: a request for it waits for a's park and b's 3 s wake
    body = {"model": "b", "prompt": "x", "max_tokens": 4, "stream": keepalive is not None}
    async with aiohttp.ClientSession() as s:
        sent = asyncio.ensure_future(s.post(router.url + "/v1/completions", json=body))
        await eventually(lambda: _queued(router, "b"), 10, what="the request queued for b")
        if keepalive:
            resp = await sent
            assert (await resp.content.readline()).startswith(b": ")  # the comments' headers are out already
            resp.close()
        else:
            sent.cancel()  # the client gives up before any answer
    record = await the_record(router, "b")
    assert record["status"] == 499 and record["engine"] == "b" and record["found_awake"] is None, record
    assert await requests_by_status(router, "b") == {"499": 1}
    assert await requests_by_status(router, "a") == {"200": 1}


async def _queued(router, name: str) -> bool:
    return (await router.engine(name))["queued"] == 1
