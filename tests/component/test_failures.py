"""Failures are loud and contained: scenarios against the real router process and simulated engines."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import openai
import pytest

from router.cli.status import render
from tests.support import RouterProcess, ask, client, eventually, http, metric_lines, pid_alive, roster_dict, sim_fault, sim_model


async def test_when_every_engine_fails_to_boot_the_log_says_so_plainly(tmp_path):
    broken = ("--sim-fail-boot",)
    router = RouterProcess(roster_dict(sim_model("a", args=broken), sim_model("b", args=broken)), tmp_path)
    try:
        await eventually(lambda: "boot finished" in router.log(), timeout=30, what="the end-of-boot summary")
        log = router.log()
        assert "boot finished: EVERY engine failed (2 of 2); nothing can be served and /ready answers 503" in log
        summary = log[log.index("boot finished"):]
        assert "  a: engine a: exited during boot (process exited with code 1)" in summary
        assert "  b: engine b: exited during boot (process exited with code 1)" in summary
        assert "simulated boot failure" in summary, "the reason, quoted from the engine's own log"
        assert (await http(router, "GET", "/ready"))[0] == 503
    finally:
        assert router.stop() == 0


async def test_a_partial_boot_names_the_engine_that_failed(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), sim_model("b", args=("--sim-fail-boot",))))
    await eventually(lambda: "boot finished" in router.log(), what="the end-of-boot summary")
    assert "boot finished: 1 of 2 engines FAILED (b); serving the others." in router.log()
    assert await ask(client(router), "a")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
async def test_a_second_signal_while_draining_stops_at_once(tmp_path, sig, code):
    slow = sim_model("a", args=("--sim-token-rate", "5"))  # a stream that would outlast any test
    router = RouterProcess(roster_dict(slow, swap={"drain_timeout_s": 300}), tmp_path)
    try:
        await router.wait_ready()
        stream = await client(router).completions.create(model="a", prompt="long", max_tokens=1000, stream=True)
        await stream.__anext__()  # in flight: the drain would wait for it
        engine_pid = (await router.engine("a"))["pid"]
        router.proc.send_signal(sig)
        await eventually(lambda: "a second signal stops at once" in router.log(), what="draining")
        started = time.monotonic()
        router.proc.send_signal(sig)
        assert await asyncio.to_thread(router.proc.wait, 10) == code
        assert time.monotonic() - started < 5
        assert f"second {sig.name}: stopping now" in router.log()
        await eventually(lambda: not pid_alive(engine_pid), what="the engine stopped with the router")
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    finally:
        router.stop()


async def test_a_midlife_collapse_under_steady_load_restarts_without_waiting_for_idle(start_router):
    watched = sim_model("a", spec=True, default=True,
                        gate={"on_midlife": "restart", "midlife_window_s": 2, "midlife_min_drafts": 20})
    router = await start_router(roster_dict(watched, swap={"drain_timeout_s": 5}))
    port = (await router.engine("a"))["port"]
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/collective_rpc", json={"method": "hotswap_discard_draft"}) as r:
        assert r.status == 200
    c = client(router)
    done = asyncio.Event()
    answered, failed = [0], []

    async def back_to_back() -> None:  # the load never lets the engine go idle
        while not done.is_set():
            try:
                await ask(c, "a", max_tokens=24)
                answered[0] += 1
            except openai.APIError as exc:
                failed.append(repr(exc))

    clients = [asyncio.create_task(back_to_back()) for _ in range(4)]
    try:
        engine = await eventually(lambda: _restarted(router, "midlife"), timeout=30, what="a mid-life restart under load")
    finally:
        done.set()
        await asyncio.gather(*clients)
    assert not failed, f"requests failed across the restart: {failed[:3]}"
    assert answered[0] > 0
    collapse = engine["last_collapse"]
    assert collapse is not None, "the collapse that caused the restart stays visible after it"
    assert collapse["observed_mal"] < 1.5 and "below" in collapse["reason"] and collapse["at"] > 0
    assert engine["collapsed"] is False and engine["restart_pending"] is None
    assert "a last acceptance collapse at " in render(await router.status()), "`hotswap status` shows it too"


async def _restarted(router: RouterProcess, reason: str):
    engine = await router.engine("a")
    return engine if engine["restarts_by_reason"].get(reason) == 1 and engine["state"] == "awake" else None


async def uncut_answer(c: openai.AsyncOpenAI) -> str:
    answer = await c.completions.create(model="a", prompt="x", max_tokens=16, temperature=0)
    return answer.choices[0].text


async def a_stream_that_breaks_off_and_resumes(c: openai.AsyncOpenAI, router: RouterProcess, uncut: str) -> None:
    """The engine closes the connection mid-answer: the client still reads one whole answer, word for word."""
    stream = await c.completions.create(model="a", prompt="x", max_tokens=16, temperature=0, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == uncut
    assert "paused an answer of a to 127.0.0.1 (engine_failed): engine 'a' failed mid-stream" in router.log()


async def test_a_cut_stream_from_a_healthy_engine_is_resumed_and_the_engine_keeps_serving(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True)))
    c = client(router)
    uncut = await uncut_answer(c)
    await sim_fault(router, "a", "generate", "cut")
    await a_stream_that_breaks_off_and_resumes(c, router, uncut)
    await eventually(lambda: "/health answers ok, so it keeps serving" in router.log(), what="the health probe")
    engine = await router.engine("a")
    assert engine["state"] == "awake" and engine["restarts"] == 0, "one broken connection is no reason for a cold restart"
    assert await ask(c, "a")


async def test_a_cut_stream_from_an_engine_whose_core_died_fails_it_and_its_restart_finishes_the_stream(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True)))
    first_pid = (await router.engine("a"))["pid"]
    c = client(router)
    uncut = await uncut_answer(c)
    await sim_fault(router, "a", "generate", "cut")
    await sim_fault(router, "a", "health", "http500", times=None)  # vLLM's API server up, its engine core dead
    await a_stream_that_breaks_off_and_resumes(c, router, uncut)
    assert "unhealthy after an answer broke off" in router.log(), "FAILED by the health probe, before the resume"
    engine = await router.engine("a")
    assert engine["pid"] != first_pid and engine["restarts_by_reason"] == {"failed": 1}
    assert await ask(c, "a")


async def test_a_request_the_engine_reads_and_drops_unanswered_is_resumed_and_one_it_cannot_resume_is_a_502_sent_once(start_router):
    """The engine read the request (on a pooled connection) and closed the connection without a byte of answer.
    From outside, that cannot be told from an engine that began the generation and died: an answer that can be
    resumed exactly is (issue 55: resume, never cut), sent again and answered once; one that cannot (a penalty
    counts its own tokens) is a 502 and never sent twice, as the engine may have begun it."""
    router = await start_router(roster_dict(sim_model("a", default=True)))
    c = client(router)
    assert await ask(c, "a")  # leaves a keep-alive connection to the engine in the router's pool
    port = (await router.engine("a"))["port"]

    async def generations() -> list:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/log") as r:
            return [call.get("fault") for call in await r.json() if call["step"] == "generate"]

    async with aiohttp.ClientSession() as s, s.delete(f"http://127.0.0.1:{port}/sim/log") as r:
        assert r.status == 200
    await sim_fault(router, "a", "generate", "cut")
    status, _, body = await http(router, "POST", "/v1/completions",
                                 json={"model": "a", "prompt": "once", "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert await generations() == ["cut", None], "dropped once, then answered: one answer to the client"
    assert 'reason="engine_failed"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")

    async with aiohttp.ClientSession() as s, s.delete(f"http://127.0.0.1:{port}/sim/log") as r:
        assert r.status == 200
    await sim_fault(router, "a", "generate", "cut")
    status, _, body = await http(router, "POST", "/v1/completions",
                                 json={"model": "a", "prompt": "once", "max_tokens": 8, "frequency_penalty": 0.5})
    assert status == 502 and body["error"]["code"] == "engine_error", body
    assert "the request was not sent again, as the engine may have begun it" in body["error"]["message"]
    assert await generations() == ["cut"], "the engine received the request exactly once"
    assert await ask(c, "a"), "one dropped request is no reason to stop serving"
