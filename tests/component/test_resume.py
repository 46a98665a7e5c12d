"""Answers outlive their engine's turn: scenarios against the real router process and simulated
engines, where a stream cut by a drain deadline, a restart, an engine's death or a preemption is
paused and resumed as one answer (router.proxy.resume). Each resumed answer is checked word for
word against the same request answered uncut (the simulator's greedy answers are continuable)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any, Optional

import aiohttp
import pytest

from tests.support import RouterProcess, SSEReader, eventually, free_port, http, metric_lines, pid_alive, roster_dict, sim_fault, sim_model

SLOW = ("--sim-token-rate", "40")


async def raw_stream(router: RouterProcess, path: str, body: dict[str, Any], started: asyncio.Event | None = None,
                     after: int = 3, headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], list[bytes], int]:
    """The stream's data events, its comment lines and its [DONE] count, read as a client's SSE parser would."""
    sse = SSEReader()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(router.url + path, json={**body, "stream": True}, headers=headers) as r:
            assert r.status == 200, await r.text()
            async for _ in sse.lines(r):
                if started is not None and len(sse.events) >= after:
                    started.set()
    return sse.events, sse.comments, sse.done


def text_of(events: list[dict[str, Any]], chat: bool) -> str:
    if chat:
        return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    return "".join(c.get("text") or "" for e in events for c in e.get("choices", []))


def one_answer(events: list[dict[str, Any]], done: int, chat: bool) -> None:
    """What a client must see of any answer, resumed or not: one identity, one role, one finish, one usage, one [DONE]."""
    assert not [e for e in events if "error" in e], events
    assert done == 1
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1, "one id, created and model throughout"
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert len(finishes) == 1, finishes
    if chat:
        assert sum(1 for e in events for c in e.get("choices", []) if c["delta"].get("role")) == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_stream_still_running_at_the_drain_deadline_is_paused_and_resumed_as_one_answer(start_router, chat):
    router = await start_router(roster_dict(sim_model("a", args=SLOW), swap={"drain_timeout_s": 0.5}))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "a", "max_tokens": 120, "temperature": 0, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "tell me a long story"}]} if chat else {"prompt": "a long story"})
    uncut, _, _ = await raw_stream(router, path, body)
    started = asyncio.Event()
    reading = asyncio.create_task(raw_stream(router, path, body, started, after=20))
    await asyncio.wait_for(started.wait(), 30)
    status, _, slept = await http(router, "POST", "/admin/sleep?model=a")
    assert status == 200 and slept["result"] == "sleeping"
    events, comments, done = await asyncio.wait_for(reading, 60)
    one_answer(events, done, chat)
    assert any(b"paused (drain_deadline)" in c for c in comments), comments
    assert text_of(events, chat) == text_of(uncut, chat), "word for word the answer the uncut stream gave"
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage == [e["usage"] for e in uncut if e.get("usage")], "one usage chunk counting the whole answer"
    assert 'reason="drain_deadline"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")


def story(chat: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": "a", "max_tokens": 120, "temperature": 0, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "tell me a long story"}]} if chat else {"prompt": "a long story"})
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def cut_midway(router: RouterProcess, chat: bool, cut, uncut: Optional[list[dict[str, Any]]] = None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[bytes]]:
    """The same greedy request answered uncut (unless given), then answered while `cut()` runs a third of the way through."""
    path, body = story(chat)
    if uncut is None:
        uncut, _, _ = await raw_stream(router, path, body)
    started = asyncio.Event()
    reading = asyncio.create_task(raw_stream(router, path, body, started, after=40))
    await asyncio.wait_for(started.wait(), 30)
    await cut()
    events, comments, done = await asyncio.wait_for(reading, 90)
    one_answer(events, done, chat)
    assert text_of(events, chat) == text_of(uncut, chat), "word for word the answer the uncut stream gave"
    return uncut, events, comments


async def sim_pid(router: RouterProcess, name: str) -> int:
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/state") as r:
        return (await r.json())["pid"]


async def test_an_engine_killed_mid_stream_is_restarted_and_the_stream_completed_by_it(start_router):
    router = await start_router(roster_dict(sim_model("a", args=SLOW)))
    pid = await sim_pid(router, "a")
    _, _, comments = await cut_midway(router, True, lambda: asyncio.to_thread(os.kill, pid, signal.SIGKILL))
    assert any(b"paused (engine_failed)" in c for c in comments), comments
    assert await sim_pid(router, "a") != pid
    assert 'reason="engine_failed"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")


async def test_a_reaper_killed_mid_stream_takes_its_engine_down_with_it_and_the_restart_finishes_the_stream(start_router):
    """The pid /admin/status shows is the reaper's, which leads the engine's processes: killed on its own, it
    leaves the engine running (and holding the GPU and the stream); the router takes that down itself."""
    router = await start_router(roster_dict(sim_model("a", args=SLOW)))
    reaper, engine = (await router.engine("a"))["pid"], await sim_pid(router, "a")
    assert reaper != engine
    await cut_midway(router, False, lambda: asyncio.to_thread(os.kill, reaper, signal.SIGKILL))
    assert not pid_alive(engine), "the engine the dead reaper led is gone"
    assert await sim_pid(router, "a") != engine
    assert 'reason="engine_failed"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")


async def test_an_operators_restart_mid_stream_pauses_it_and_the_restarted_engine_finishes_it(start_router):
    router = await start_router(roster_dict(sim_model("a", args=SLOW), swap={"drain_timeout_s": 0.3}))
    pid = (await router.engine("a"))["pid"]

    async def restart() -> None:
        status, _, body = await http(router, "POST", "/admin/restart?model=a")
        assert status == 200, body

    await cut_midway(router, False, restart)
    assert (await router.engine("a"))["pid"] != pid
    assert 'reason="restart"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")


async def test_a_buffered_request_cut_at_the_drain_deadline_is_answered_as_one_response(start_router):
    router = await start_router(roster_dict(sim_model("a", args=SLOW), swap={"drain_timeout_s": 0.3}))
    body = {"model": "a", "prompt": "a long story", "max_tokens": 80, "temperature": 0}
    status, _, uncut = await http(router, "POST", "/v1/completions", json=body)
    assert status == 200
    asking = asyncio.create_task(http(router, "POST", "/v1/completions", json=body))

    async def running() -> bool:
        return (await router.engine("a"))["in_flight"] == 1

    await eventually(running, what="the request running")
    status, _, _ = await http(router, "POST", "/admin/sleep?model=a")
    assert status == 200
    status, _, answer = await asyncio.wait_for(asking, 60)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == uncut["choices"][0]["text"]
    assert answer["usage"] == uncut["usage"]


async def test_a_stream_that_cannot_be_resumed_exactly_is_cut_as_before_and_counted(start_router):
    router = await start_router(roster_dict(sim_model("a", args=SLOW), swap={"drain_timeout_s": 0.3}))
    path, body = story(True)
    body["response_format"] = {"type": "json_object"}  # a structured output: its grammar's state is not in the ids
    started = asyncio.Event()
    reading = asyncio.create_task(raw_stream(router, path, body, started, after=5))
    await asyncio.wait_for(started.wait(), 30)
    status, _, _ = await http(router, "POST", "/admin/sleep?model=a")
    assert status == 200
    events, _, done = await asyncio.wait_for(reading, 30)
    assert done == 0 and "so it was cut; retry it" in events[-1]["error"]["message"]
    assert 'reason="structured_output"} 1.0' in await metric_lines(router, "hotswap_streams_cut_total")


async def two_nodes(start_router) -> tuple[RouterProcess, RouterProcess]:
    """node-1 and node-2 both serve `a`, each the other's peer; node-1's drain deadline is short."""
    one_port, two_port = free_port(), free_port()
    one = await start_router(roster_dict(sim_model("a", args=SLOW), swap={"drain_timeout_s": 0.3},
                                         node={"name": "node-1", "peers": [f"http://127.0.0.1:{two_port}"]}), port=one_port)
    two = await start_router(roster_dict(sim_model("a", args=SLOW),
                                         node={"name": "node-2", "peers": [f"http://127.0.0.1:{one_port}"]}), port=two_port)
    return one, two


async def sleep_a(router: RouterProcess) -> None:
    status, _, slept = await http(router, "POST", "/admin/sleep?model=a")
    assert status == 200 and slept["result"] == "sleeping"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_stream_paused_here_is_finished_on_a_peer_where_its_model_is_awake(start_router, chat):
    """node-1's `a` is put to sleep mid-stream: the rest comes from node-2's, at once, into the same
    stream, word for word (the peer's pause is one prefill, not a wake here)."""
    one, two = await two_nodes(start_router)
    path, body = story(chat)
    uncut, _, _ = await raw_stream(two, path, body)  # also: node-2's `a` is awake
    _, _, comments = await cut_midway(one, chat, lambda: sleep_a(one), uncut=uncut)
    assert any(b"resumes on a peer node" in c for c in comments), comments
    assert 'reason="migrated"} 1.0' in await metric_lines(one, "hotswap_streams_resumed_total")
    assert "on peer node node-2" in one.log()
    assert (await one.engine("a"))["state"] != "awake", "node-1 did not wake `a` again for it"


async def test_a_peer_that_fails_the_continuation_before_any_of_it_went_out_leaves_the_stream_to_finish_here(start_router):
    one, two = await two_nodes(start_router)
    path, body = story(False)
    uncut, _, _ = await raw_stream(two, path, body)
    await sim_fault(two, "a", "generate", "http500")  # node-2's engine refuses the continuation

    _, _, comments = await cut_midway(one, False, lambda: sleep_a(one), uncut=uncut)
    assert any(b"resumes on a peer node" in c for c in comments), comments
    assert "could not be finished on a peer" in one.log() and "on peer node node-2" not in one.log()
    assert 'reason="drain_deadline"} 1.0' in await metric_lines(one, "hotswap_streams_resumed_total")
    assert (await one.engine("a"))["state"] == "awake", "node-1 woke `a` again and finished it"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "buffered"])
async def test_a_request_whose_engine_dies_before_its_answer_began_is_answered_by_the_restarted_engine(start_router, stream):
    """Found by the trace bench's chaos arm (bench/wake_trace.py --arms chaos): an engine killed while it computed a
    buffered answer (whose head comes only with the whole answer), or before a stream's head, answered 502."""
    router = await start_router(roster_dict(sim_model("a", args=SLOW)))
    path, body = story(False)
    body["max_tokens"] = 40
    if stream:
        uncut, _, _ = await raw_stream(router, path, body)
    else:
        status, _, uncut = await http(router, "POST", path, json=body)
        assert status == 200
    pid = await sim_pid(router, "a")
    await sim_fault(router, "a", "generate", "crash")  # the process exits as the generation begins: nobody is answered
    if stream:
        events, _, done = await asyncio.wait_for(raw_stream(router, path, body), 60)
        one_answer(events, done, False)
        assert text_of(events, False) == text_of(uncut, False)
        assert not [e for e in events for c in e["choices"] if "prompt_token_ids" in c], "ids the client did not ask for"
    else:
        status, _, answer = await asyncio.wait_for(http(router, "POST", path, json=body), 60)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == uncut["choices"][0]["text"]
    assert await sim_pid(router, "a") != pid
    assert 'reason="engine_failed"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")


async def test_a_continuation_whose_engine_dies_before_it_began_is_paused_again_not_left_open(start_router):
    """Found by the chaos arm too: the rest of a paused stream asked of an engine that died before answering raised
    past the open stream, which was never ended (the client waited for its timeout). Now it is one more pause."""
    router = await start_router(roster_dict(sim_model("a", args=SLOW, gate={"enabled": False}), swap={"drain_timeout_s": 0.3}))

    async def sleep_with_a_crash_armed() -> None:
        await sim_fault(router, "a", "generate", "crash")  # the next generation, the continuation's, kills the engine
        await sleep_a(router)

    _, _, comments = await cut_midway(router, False, sleep_with_a_crash_armed)
    assert any(b"paused (drain_deadline)" in c for c in comments), comments
    assert any(b"paused (engine_failed)" in c for c in comments), comments
    resumed = await metric_lines(router, "hotswap_streams_resumed_total")
    assert 'reason="drain_deadline"} 1.0' in resumed and 'reason="engine_failed"} 1.0' in resumed


async def test_a_paused_answer_whose_engine_dies_while_it_waits_is_resumed_by_the_restart_not_cut(start_router):
    """Found by the chaos arm: a stream paused by its engine's death waited for the model while the scheduler parked
    the dead engine; the park failed, and the scheduler's refusal of the engine's waiters cut the stream (`wait`).
    Here the engine dies waking back for the paused stream; the stream waits for the restart instead."""
    router = await start_router(roster_dict(sim_model("a", args=(*SLOW, "--sim-fault", "wake_weights=crash"),
                                                      gate={"enabled": False}), swap={"drain_timeout_s": 0.3}))
    pid = await sim_pid(router, "a")
    _, _, comments = await cut_midway(router, False, lambda: sleep_a(router))
    assert any(b"paused (drain_deadline)" in c for c in comments), comments
    assert await sim_pid(router, "a") != pid, "the engine died waking and was restarted"
    assert 'reason="drain_deadline"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")
    cut = (await metric_lines(router, "hotswap_streams_cut_total")).splitlines()
    assert cut and all(line.endswith(" 0.0") for line in cut), cut
