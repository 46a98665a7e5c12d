"""Why a request waited: its wait's parts in its activity record (`swap_s`, `held` and `held_s`), in `hotswap
activity` and /ui, and a log line once per hold (router.scheduling.history.WaitParts, costs.py `_why_waiting`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import openai

from tests.support import ask, client, eventually, http, metric_lines, roster_dict, sim_model
from tests.component.test_activity import newest


def activity_cli(router) -> str:
    done = subprocess.run([sys.executable, "-m", "router.cli", "activity", "--url", router.url], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_request_held_by_min_active_s_says_so_in_its_record_the_cli_the_ui_and_the_log(start_router):
    # a and b take turns (vLLM's default share each). a is woken for a request, so min_active_s protects it.
    router = await start_router(roster_dict(sim_model("a"), sim_model("b"), swap={"min_active_s": 2}))
    c = client(router)
    assert await ask(c, "a")
    b = asyncio.create_task(ask(c, "b"))

    async def held_in_status() -> dict | None:
        waiting = (await router.engine("b"))["waiting_for"]
        return waiting if waiting and waiting["reason"] == "min_active" else None

    waiting = await eventually(held_in_status, what="b's waiter held by min_active in /admin/status")
    assert "'a' has been awake" in waiting["why"] and "swap.min_active_s=2" in waiting["why"]
    assert await b
    assert (await router.engine("b"))["waiting_for"] is None  # nobody waits now
    record = (await newest(router, 2))[0]
    assert record["model"] == "b" and record["found_awake"] is False
    assert set(record["held"]) >= {"min_active"} and record["held"]["min_active"] > 1.0, record
    assert record["held_s"] >= record["held"]["min_active"] - 0.001 and record["swap_s"] < record["queue_wait_s"]
    assert abs(record["queue_wait_s"] - record["held_s"] - record["swap_s"]) < 0.3, record  # the parts add up
    line = next(line for line in activity_cli(router).splitlines() if " b " in line)
    assert "min_active 1." in line or "min_active 2." in line, line
    log = router.log()
    assert log.count("b: 1 request(s) waiting are held (min_active): 'a' has been awake") == 1, log  # once, not per pass
    async with aiohttp.ClientSession() as s, s.get(router.url + "/ui") as r:
        page = await r.text()
    assert "held " in page and "min_active</span>" in page


async def test_a_request_held_behind_a_stream_until_max_hold_s_says_max_hold_and_the_stream_says_it_was_resumed(start_router):
    slow = sim_model("a", default=True, args=("--sim-token-rate", "20"))
    router = await start_router(roster_dict(slow, sim_model("b"), swap={"max_hold_s": 1.5, "drain_timeout_s": 0.3}))
    c = client(router)
    stream = await c.completions.create(model="a", prompt="long", max_tokens=60, temperature=0, stream=True)
    first = await stream.__anext__()

    async def rest() -> str:
        return first.choices[0].text + "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    a_task = asyncio.create_task(rest())
    assert await ask(c, "b")
    assert await asyncio.wait_for(a_task, 60)
    records = {r["model"]: r for r in await newest(router, 2)}
    b, a = records["b"], records["a"]
    assert b["held"] and b["held"]["max_hold"] > 1.0, b
    assert "max_hold" in next(line for line in activity_cli(router).splitlines() if " b " in line)
    assert "b: 1 request(s) waiting are held (max_hold): 'a' is serving 1 request(s)" in router.log()
    assert a["status"] == 200 and a["resumed"] == "drain_deadline" and a["paused_s"] > 0, a  # paused, resumed: said so
    assert a["found_awake"] is True and a["held"] is None, a  # its lease and wait are its first; the pause is paused_s
    assert "resumed ×1 (drain_deadline)" in next(line for line in activity_cli(router).splitlines() if " a " in line)


async def test_a_wait_that_runs_out_while_held_says_what_held_it_in_its_503(start_router):
    router = await start_router(roster_dict(sim_model("a"), sim_model("b"), swap={"min_active_s": 30}, queue={"max_wait_s": 1}))
    c = client(router)
    assert await ask(c, "a")
    try:
        await ask(c, "b")
    except openai.InternalServerError as exc:
        message = str(exc)
    else:
        raise AssertionError("b was served inside a's min_active_s")
    assert "did not become ready within queue.max_wait_s=1 s" in message
    assert "held (min_active): 'a' has been awake" in message and "swap.min_active_s=30" in message, message
    record = (await newest(router, 2))[0]
    assert record["model"] == "b" and record["status"] == 503 and record["found_awake"] is False, record
    assert record["held"] and record["held"]["min_active"] > 0.9, "a refused wait's record says what held it"
    assert 0.9 < record["queue_wait_s"] < 5 and abs(record["queue_wait_s"] - record["held_s"] - record["swap_s"]) < 0.3, record
    assert "min_active" in next(line for line in activity_cli(router).splitlines() if " b " in line)
    # The queue-wait histogram stays the wait for an awake engine: b never had one.
    assert 'model="b"} 0.0' in await metric_lines(router, "hotswap_queue_wait_seconds_count"), "a refused wait is no queue wait"


async def test_a_request_whose_engine_fails_its_boot_while_it_waits_says_how_long_the_boot_took(start_router):
    broken = sim_model("b", args=("--sim-fail-boot",))
    router = await start_router(roster_dict(sim_model("a"), broken, swap={"boot_timeout_s": 30}), booted=False)
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "engine_failed", body
    record = (await newest(router, 1, "?model=b"))[0]
    assert record["status"] == 503 and record["found_awake"] is False, record
    assert record["swap_s"] is not None and record["swap_s"] > 0, "the boot it waited for is its swap"
