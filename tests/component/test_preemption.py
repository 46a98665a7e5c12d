"""Batch requests yield at once (issue 55, item 2), on a real router with simulated engines: a batch stream
is preempted by an interactive request for another model on its GPU, which is answered without waiting
for it, and the stream resumes word for word as the uncut answer; an interactive stream is never
preempted by another interactive request (it is paused only at swap.drain_timeout_s, as before)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.component.test_resume import SLOW, one_answer, raw_stream, story, text_of
from tests.support import RouterProcess, http, metric_lines, roster_dict, sim_model

SHARE = ("--gpu-memory-utilization", "0.6")  # two of them never fit on the one GPU together
HOLD_S = 60.0  # max_hold_s and drain_timeout_s: what a user would wait behind the stream without preemption
BATCH = {"X-Hotswap-Class": "batch"}


async def two_models_on_one_gpu(start_router) -> RouterProcess:
    return await start_router(roster_dict(
        sim_model("a", args=(*SLOW, *SHARE)), sim_model("b", args=SHARE),
        swap={"max_hold_s": HOLD_S, "drain_timeout_s": HOLD_S, "interactive_hold_s": 0},
        queue={"batch_max_wait_s": 120}))


async def ask_b(router: RouterProcess) -> tuple[int, float]:
    """An interactive request for b: its status, and how long it took."""
    started = time.monotonic()
    status, _, body = await http(router, "POST", "/v1/chat/completions",
                                 json={"model": "b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    return status, time.monotonic() - started


async def test_a_batch_stream_yields_at_once_to_a_user_of_another_model_and_resumes_word_for_word(start_router):
    router = await two_models_on_one_gpu(start_router)
    path, body = story(chat=True)
    uncut, _, _ = await raw_stream(router, path, body, headers=BATCH)
    started = asyncio.Event()
    reading = asyncio.create_task(raw_stream(router, path, body, started, after=20, headers=BATCH))
    await asyncio.wait_for(started.wait(), 30)
    _, waited = await ask_b(router)
    assert waited < HOLD_S / 4, f"the user waited {waited:.1f} s: behind the batch stream's hold or drain"
    events, comments, done = await asyncio.wait_for(reading, 90)
    one_answer(events, done, chat=True)
    assert any(b"paused (preempted)" in c for c in comments), comments
    assert text_of(events, True) == text_of(uncut, True), "word for word the answer the uncut stream gave"
    assert 'model="a",reason="preempted"} 1.0' in await metric_lines(router, "hotswap_streams_resumed_total")
    assert 'model="a",reason="preempt"} 1.0' in await metric_lines(router, "hotswap_evictions_total")
    status, _, timeline = await http(router, "GET", "/admin/timeline?minutes=5")
    assert status == 200 and [(m["engine"], m["kind"]) for m in timeline["marks"]] == [("a", "preempt")]
    records = await activity(router)
    [resumed] = [r for r in records if r.get("resumed")]
    assert (resumed["model"], resumed["class"], resumed["resumed"]) == ("a", "batch", "preempted")


async def test_an_interactive_stream_is_never_preempted_by_another_interactive_request(start_router):
    router = await two_models_on_one_gpu(start_router)
    path, body = story(chat=True)
    started = asyncio.Event()
    reading = asyncio.create_task(raw_stream(router, path, body, started, after=10))
    await asyncio.wait_for(started.wait(), 30)
    asking = asyncio.create_task(ask_b(router))
    events, comments, done = await asyncio.wait_for(reading, 60)  # runs to its end while b's user waits
    one_answer(events, done, chat=True)
    assert not any(b"paused" in c for c in comments), comments
    assert not asking.done(), "b's user was answered before a's stream ended: the stream was preempted"
    await asyncio.wait_for(asking, 30)  # and then b is served: a stands idle, so it parks
    assert 'model="a",reason="preempt"} 0.0' in await metric_lines(router, "hotswap_evictions_total")
    assert 'model="a",reason="room"} 1.0' in await metric_lines(router, "hotswap_evictions_total"), "parked once idle"
    assert 'model="a",reason="preempted"} 0.0' in await metric_lines(router, "hotswap_streams_resumed_total")


async def activity(router: RouterProcess) -> list[dict[str, Any]]:
    status, _, body = await http(router, "GET", "/admin/activity?limit=100")
    assert status == 200, body
    return body["records"]
