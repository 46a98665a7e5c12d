"""The router as a real process over loopback, simulated engines behind it, the real `openai` SDK in front."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import openai
import pytest

import engines.waking
from tests.support import HOST_MEMORY_RPCS, RouterProcess, ask, client, direct, eventually, free_port, http, roster_dict, sim_model


async def sim_log(router: RouterProcess, name: str) -> list[str]:
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/log") as r:
        return [c["step"] for c in await r.json() if c.get("method") not in HOST_MEMORY_RPCS]


TWO = roster_dict(sim_model("a", default=True), sim_model("b", spec=True, aliases=["bee"]))


async def test_alternating_requests_swap_in_order_and_all_succeed(start_router):
    router = await start_router(TWO)
    c = client(router)
    for model in ["a", "b", "a", "bee", "a"]:
        assert await ask(c, model)
    status = await router.status()
    assert [e["name"] for e in status["engines"] if e["state"] == "awake"] == ["a"]
    assert status["last_swap"]["from"] == ["b"] and status["last_swap"]["result"] == "ok"
    # b booted, slept, then was woken twice with the five steps, and slept once in between
    wake = engines.waking.phases(2, "reload")
    assert [s for s in await sim_log(router, "b") if s != "generate"] == ["sleep", *wake, "sleep", *wake, "sleep"]


async def test_answers_through_the_router_match_the_engines_direct_answers(start_router):
    router = await start_router(TWO)
    c, d = client(router), await direct(router, "a")
    via = await c.chat.completions.create(model="a", messages=[{"role": "user", "content": "tell me"}], max_tokens=12, temperature=0)
    own = await d.chat.completions.create(model="a", messages=[{"role": "user", "content": "tell me"}], max_tokens=12, temperature=0)
    assert via.choices[0].message.content == own.choices[0].message.content and via.model == "a"
    assert via.usage.completion_tokens == 12

    async def streamed(cl) -> tuple[list[str], object]:
        stream = await cl.completions.create(model="a", prompt="tell me", max_tokens=10, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [ch.text for ch in chunk.choices]
            usage = chunk.usage or usage
        return pieces, usage

    via_pieces, via_usage = await streamed(c)
    own_pieces, own_usage = await streamed(d)
    assert via_pieces == own_pieces and len(via_pieces) == 10
    assert via_usage.completion_tokens == own_usage.completion_tokens == 10
    assert await ask(c, "a", "tell me", 10) == "".join(own_pieces)


async def test_a_request_for_b_while_a_streams_waits_until_a_is_idle(start_router):
    slow = sim_model("a", default=True, args=("--sim-token-rate", "20"))
    router = await start_router(roster_dict(slow, sim_model("b"), swap={"max_hold_s": 60}))
    c = client(router)
    stream = await c.completions.create(model="a", prompt="long", max_tokens=20, stream=True)
    first = await stream.__anext__()  # a is streaming now
    b_done_at: list[float] = []

    async def ask_b():
        await ask(c, "b")
        b_done_at.append(time.monotonic())

    b = asyncio.create_task(ask_b())
    await eventually(lambda: router.engine("b"), what="status")
    assert (await router.engine("b"))["queued"] == 1
    rest = [chunk async for chunk in stream]
    a_done_at = time.monotonic()
    await asyncio.wait_for(b, 10)
    assert first.choices and len(rest) >= 19
    assert b_done_at[0] >= a_done_at - 0.05, "b was served while a was still streaming"


async def test_max_hold_s_forces_a_swap_away_from_a_model_that_never_goes_idle(start_router):
    # a streams for ~3 s; b's waiter forces the swap after max_hold_s; at the drain deadline a's stream is paused,
    # not cut, and a's next turn finishes it word for word.
    router = await start_router(roster_dict(sim_model("a", default=True, args=("--sim-token-rate", "20")), sim_model("b"),
                                            swap={"max_hold_s": 0.5, "drain_timeout_s": 0.3}))
    c = client(router)
    uncut = (await c.completions.create(model="a", prompt="long", max_tokens=60, temperature=0)).choices[0].text
    stream = await c.completions.create(model="a", prompt="long", max_tokens=60, temperature=0, stream=True)
    first = await stream.__anext__()

    async def drain_a() -> str:
        return first.choices[0].text + "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    a_task = asyncio.create_task(drain_a())
    started = time.monotonic()
    assert await ask(c, "b")
    waited = time.monotonic() - started
    assert 0.5 <= waited < 3, waited
    port = (await router.engine("a"))["port"]
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/sim/log") as r:
        sleeps = [c["query"] for c in await r.json() if c["step"] == "sleep"]
    assert sleeps[-1] == {"level": "2", "mode": "abort"}, "past drain_timeout_s the sleep must abort the stragglers"
    assert await asyncio.wait_for(a_task, 60) == uncut, "a's stream is paused at the deadline and resumed, not cut"
    assert "paused an answer of a to 127.0.0.1 (drain_deadline)" in router.log()


async def test_a_burst_for_two_models_does_not_thrash(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), sim_model("b"), swap={"min_active_s": 0.5, "max_hold_s": 1}))
    c = client(router)
    results = await asyncio.gather(*(ask(c, "a" if i % 2 else "b") for i in range(40)))
    assert all(results)
    swaps = sum(s == "sleep" for s in await sim_log(router, "a")) + sum(s == "sleep" for s in await sim_log(router, "b"))
    assert swaps <= 2 + 3, f"{swaps} sleeps for one burst: thrashing"  # 2 boot sleeps, then a handful of swaps at most


async def test_a_client_that_disconnects_mid_stream_frees_the_lease_and_the_upstream(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True, args=("--sim-token-rate", "20")), sim_model("b")))
    port = (await router.engine("a"))["port"]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 200, "stream": True})
        await resp.content.readline()
        assert await _in_flight_is(router, "a", 1)
        resp.close()

    async def upstream_running() -> float:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
        return next(float(l.split()[-1]) for l in text.splitlines() if l.startswith("vllm:num_requests_running"))

    await eventually(lambda: _in_flight_is(router, "a", 0), what="lease freed")
    await eventually(lambda: _is_zero(upstream_running()), what="upstream request aborted")
    assert await ask(client(router), "b")  # the group is free to swap: nothing holds a


async def _in_flight_is(router, name, n) -> bool:
    return (await router.engine(name))["in_flight"] == n


async def _is_zero(value) -> bool:
    return (await value) == 0


async def test_error_shapes(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), listen={"max_body_mb": 1}))
    expectations = [
        (dict(data=b"{not json", headers={"Content-Type": "application/json"}), 400, "invalid_json"),
        (dict(data=b'{"model": "a"}', headers={"Content-Type": "text/plain"}), 400, "invalid_content_type"),
        (dict(json={"model": 7, "prompt": "x"}), 400, "missing_model"),
        (dict(json=["a"]), 400, "invalid_request"),
        (dict(json={"model": "nope", "prompt": "x"}), 404, "model_not_found"),
        (dict(data=b"x" * (2 * 1024 * 1024 + 10), headers={"Content-Type": "application/json"}), 413, "body_too_large"),
    ]
    for kwargs, status, code in expectations:
        got, _, body = await http(router, "POST", "/v1/completions", **kwargs)
        assert (got, body["error"]["code"]) == (status, code), body
        assert set(body["error"]) == {"message", "type", "param", "code"}
    # the SDK surfaces our message
    with pytest.raises(openai.NotFoundError, match="The model 'nope' does not exist. Available: a"):
        await ask(client(router), "nope")
    # an engine's own error passes through unchanged
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        await ask(client(router), "a", max_tokens=0)


async def test_the_engines_dev_endpoints_are_unreachable_through_the_router(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True)))
    for path in ["/sleep?level=2", "//sleep", "/v1/../sleep", "/v1/../collective_rpc", "/%73leep", "/wake_up",
                 "/collective_rpc", "/reset_prefix_cache", "/is_sleeping", "/v1/sleep", "/sim/faults", "/v1/chat/completions/../../sleep"]:
        for method in ("GET", "POST"):
            status, _, body = await http(router, method, path, json={"method": "reload_weights"})
            assert status in (404, 405) and "error" in body, (method, path, status)
    async with aiohttp.ClientSession() as s:
        # an absolute-form request target naming the engine's port
        port = (await router.engine("a"))["port"]
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(f"POST http://127.0.0.1:{port}/sleep?level=2 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert b" 404 " in head or b" 400 " in head, head
        async with s.get(f"http://127.0.0.1:{port}/is_sleeping") as r:
            assert (await r.json())["is_sleeping"] is False


async def test_api_keys_are_required_when_configured_and_never_forwarded(start_router):
    roster = roster_dict(sim_model("a", default=True, args=("--api-key", "engine-own-key")), auth={"api_keys": ["${TEST_CLIENT_KEY}"]})
    router = await start_router(roster, env={"TEST_CLIENT_KEY": "sk-test-123"})
    with pytest.raises(openai.AuthenticationError, match="Missing or invalid API key"):
        await ask(client(router, key="wrong"), "a")
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "a", "prompt": "x"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await http(router, "GET", "/health"))[0] == 200
    # The engine demands its own key (from its --api-key in args). Had the router forwarded the
    # client's key, the engine would answer 401; it answers, so the client's key stayed here.
    assert await ask(client(router, key="sk-test-123"), "a")


async def test_a_full_queue_answers_429_and_a_long_wait_503_both_with_retry_after(start_router):
    slow_wake = sim_model("b", args=("--sim-step-delay", "wake_weights=3"))
    router = await start_router(roster_dict(sim_model("a", default=True), slow_wake, queue={"max_waiting": 2, "max_wait_s": 1}))
    c = client(router)
    waiting = [asyncio.create_task(ask(c, "b")) for _ in range(2)]
    await eventually(lambda: _queued(router, "b", 2), what="two waiting")
    status, headers, body = await http(router, "POST", "/v1/completions", json={"model": "b", "prompt": "x"})
    assert status == 429 and body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, openai.InternalServerError) and r.status_code == 503 for r in results), results
    assert "did not become ready within queue.max_wait_s=1 s" in str(results[0])
    assert int(results[0].response.headers["Retry-After"]) >= 1


async def _queued(router, name, n) -> bool:
    return (await router.engine(name))["queued"] == n


async def test_an_attached_engine_that_went_away_answers_502(start_router, tmp_path):
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "engines.sim", "serve", "sim/ext", "--port", str(port), "--sim-boot-s", "0"],
                              env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        router = await start_router(roster_dict({"name": "ext", "url": f"http://127.0.0.1:{port}", "default": True}))
        assert await ask(client(router), "ext")
    finally:
        engine.kill()
        engine.wait()
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "ext", "prompt": "x"})
    assert status == 502 and body["error"]["code"] == "engine_unreachable", body
    assert "engine 'ext' is unreachable" in body["error"]["message"]
    assert str(port) not in body["error"]["message"] and "127.0.0.1" not in body["error"]["message"], \
        "the client is told what failed, not where the engine listens"


async def _state(router, name, state) -> bool:
    return (await router.engine(name))["state"] == state


async def test_an_engine_that_crashes_on_every_stream_is_an_error_not_a_hang_and_the_model_recovers(start_router):
    # Its stream is resumed on the restarted engine, which crashes again: after three deaths the
    # request may be what kills it, so the stream ends with an error that says so.
    crashy = sim_model("a", default=True, args=("--sim-crash-mid-stream", "3", "--sim-token-rate", "100"))
    router = await start_router(roster_dict(crashy, sim_model("b")))
    c = client(router)
    stream = await c.completions.create(model="a", prompt="x", max_tokens=50, stream=True)
    with pytest.raises(openai.APIError, match="its engine failed 3 times while answering it, so it is not tried again"):
        async for _ in stream:
            pass
    await eventually(lambda: _state(router, "a", "failed"), what="a failed")
    assert await ask(c, "b")
    # a comes back: restarted on demand (its crash knob fires only on streams)
    assert await ask(c, "a")
    assert (await router.engine("a"))["restarts"] == 3


async def test_swaps_on_two_gpus_run_in_parallel(start_router):
    slow = ("--sim-step-delay", "wake_weights=1")
    roster = roster_dict(
        sim_model("a1", devices=[0], default=True), sim_model("b1", devices=[0], args=slow),
        sim_model("a2", devices=[1], default=True), sim_model("b2", devices=[1], args=slow),
    )
    router = await start_router(roster)
    c = client(router)
    started = time.monotonic()
    await asyncio.gather(ask(c, "b1"), ask(c, "b2"))
    elapsed = time.monotonic() - started
    swaps = {s["to"]: s for s in (await router.status())["swaps"]}
    s1, s2 = swaps["b1"], swaps["b2"]
    assert (s1["to"], s2["to"]) == ("b1", "b2")
    assert s1["phases"]["wake_weights"] >= 1 and s2["phases"]["wake_weights"] >= 1
    # overlapping swaps: each started before the other finished
    assert abs(s1["at"] - s2["at"]) < 0.9, (s1["at"], s2["at"])
    assert elapsed < 1.9, elapsed


async def test_models_lists_every_name_and_alias_with_its_state(start_router):
    router = await start_router(TWO)
    models = await client(router).models.list()
    by_id = {m.id: m for m in models.data}
    assert set(by_id) == {"a", "b", "bee"}
    assert by_id["a"].state == "awake" and by_id["b"].state == "sleeping" and by_id["bee"].alias_of == "b" and by_id["bee"].parent is None
    status, _, body = await http(router, "GET", "/ready")
    assert status == 200 and body["promoted"] == ["a"]


async def test_an_engine_idle_for_idle_sleep_s_is_parked_and_woken_by_the_next_request(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), swap={"idle_sleep_s": 0.5}))
    await eventually(lambda: _state(router, "a", "sleeping"), timeout=10, what="a parked")
    assert (await router.engine("a"))["sleep_level"] == 2
    assert await ask(client(router), "a")
    assert (await router.engine("a"))["state"] == "awake"
    assert "parking a at level 2 (idle for" in router.log()


async def test_sigterm_lets_an_in_flight_stream_finish_then_stops_every_engine(start_router, tmp_path):
    import signal
    from tests.support import pid_alive

    router = await start_router(roster_dict(sim_model("a", default=True, args=("--sim-token-rate", "40")), sim_model("b")))
    pids = [(await router.engine(n))["pid"] for n in ("a", "b")]
    stream = await client(router).completions.create(model="a", prompt="x", max_tokens=30, stream=True)
    await stream.__anext__()
    router.proc.send_signal(signal.SIGTERM)
    rest = [chunk async for chunk in stream]
    assert len(rest) >= 29, "the in-flight stream was cut by the shutdown"
    assert await asyncio.to_thread(router.proc.wait, 20) == 0
    assert not any(pid_alive(p) for p in pids)
    assert "in-flight and queued ones finish" in router.log() and "hotswap: stopped" in router.log()
