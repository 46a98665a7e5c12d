"""queue.stream_keepalive_s: a streaming request that waits for a swap gets SSE comment lines
saying why, which SDK clients ignore; a failure after the headers travels as the stream's
error event in the route's shape.
"""

from __future__ import annotations

import json
import time

import aiohttp
import anthropic
import openai
import pytest

from tests.support import ask, client, eventually, http, roster_dict, sim_model

pytestmark = pytest.mark.timeout(60)

SLOW_WAKE = ("--sim-step-delay", "reload_weights=1.2")


def roster(keepalive: float | None = 0.2, **extra) -> dict:
    queue = {"stream_keepalive_s": keepalive} if keepalive else {}
    return roster_dict(sim_model("a", default=True, group="g"), sim_model("b", group="g", sleep_level=2, args=SLOW_WAKE, **extra),
                       queue=queue)


async def park_b(router) -> None:
    await ask(client(router), "a")  # one awake engine per group: b is parked now
    assert (await router.engine("b"))["state"] == "sleeping"


async def raw_stream(router, path: str, body: dict) -> tuple[int, list[tuple[float, str]]]:
    """Status and the stream's lines, each with the seconds since the request was sent."""
    started = time.monotonic()
    lines = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(router.url + path, json=body) as r:
            async for raw in r.content:
                lines.append((time.monotonic() - started, raw.decode().rstrip("\n")))
            return r.status, lines


async def test_a_waiting_stream_gets_comment_lines_naming_the_wake_step_then_the_tokens(start_router):
    router = await start_router(roster())
    await park_b(router)
    status, lines = await raw_stream(router, "/v1/chat/completions",
                                     {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert status == 200
    comments = [(t, line) for t, line in lines if line.startswith(":")]
    data = [(t, line) for t, line in lines if line.startswith("data:")]
    assert len(comments) >= 3, lines  # 1.2 s of reload_weights at one comment per 0.2 s
    assert any(line == ": waking b (reload_weights)" for _, line in comments), comments
    assert comments[0][0] < 0.6  # the first comment comes after one interval, not after the swap
    assert max(t for t, _ in comments) < min(t for t, _ in data)  # comments only while waiting
    assert data[-1][1] == "data: [DONE]"


async def test_sdks_ignore_the_comments(start_router):
    router = await start_router(roster())
    await park_b(router)
    stream = await client(router).chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=4, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    await park_b(router)
    async with anthropic.AsyncAnthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=30) as a:
        async with a.messages.stream(model="b", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
            assert "".join([t async for t in s.text_stream])


async def test_no_comment_when_the_model_is_awake_and_none_without_the_option(start_router):
    router = await start_router(roster(keepalive=None))
    await park_b(router)
    _, lines = await raw_stream(router, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 2, "stream": True})
    assert not [line for _, line in lines if line.startswith(":")]


async def failing_wake(start_router):
    router = await start_router(roster(gate={"on_fail": "refuse"}))
    await park_b(router)
    port = (await router.engine("b"))["port"]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/sim/faults", json={"step": "reload_weights", "kind": "http500", "times": 1}) as r:
            assert r.status == 200
    return router


async def test_a_failed_wake_after_the_headers_is_the_streams_error_event(start_router):
    router = await failing_wake(start_router)
    status, lines = await raw_stream(router, "/v1/chat/completions",
                                     {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert status == 200 and any(line.startswith(":") for _, line in lines)
    errors = [json.loads(line[6:]) for _, line in lines if line.startswith("data: {")]
    assert len(errors) == 1 and errors[0]["error"]["code"] and "b" in errors[0]["error"]["message"], lines
    assert await ask(client(router), "a")  # the router is unharmed
    assert (await http(router, "GET", "/health"))[0] == 200


async def test_the_sdks_raise_that_error_event(start_router):
    router = await failing_wake(start_router)
    with pytest.raises(openai.APIError, match="b"):
        stream = await client(router).chat.completions.create(model="b", messages=[{"role": "user", "content": "x"}],
                                                              max_tokens=2, stream=True)
        [c async for c in stream]


async def test_on_the_messages_route_the_error_event_is_anthropics(start_router):
    router = await failing_wake(start_router)
    async with anthropic.AsyncAnthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=30) as a:
        with pytest.raises(anthropic.APIStatusError) as raised:
            async with a.messages.stream(model="b", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
                [t async for t in s.text_stream]
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "overloaded_error", raised.value.body


async def test_a_client_that_leaves_during_the_comments_leaves_no_waiter_or_lease_behind(start_router):
    router = await start_router(roster())
    await park_b(router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(router.url + "/v1/chat/completions",
                          json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
            assert (await r.content.readline()).startswith(b": ")  # waiting, headers sent
            assert (await router.engine("b"))["queued"] == 1
    # gone mid-wait: the wait is withdrawn, and the swap it started leaves nothing held

    async def settled() -> bool:
        engine = await router.engine("b")
        return engine["queued"] == 0 and engine["in_flight"] == 0 and engine["state"] in ("awake", "sleeping")

    await eventually(settled, 15, what="no waiter, no lease on b")
    assert await ask(client(router), "b")
