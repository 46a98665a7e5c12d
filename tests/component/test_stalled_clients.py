"""Clients that stop reading, on a real router: a stream whose client takes nothing holds its
engine's lease, and a leased engine is never parked, restarted or removed. The client here is a
raw socket with a 4 kB receive buffer that sends its request and never reads a byte."""

from __future__ import annotations

import json
import socket

import openai
import pytest

from tests.support import ask, client, eventually, http, roster_dict, sim_model

# A long, fast stream (some 20 MB of SSE): far more than the kernel (4 MB at most on Linux) and
# the router buffer, so a client that never reads blocks it within a fraction of a second.
LONG = ("--max-model-len", "100000", "--sim-token-rate", "100000")


def stalled_client(router, model: str, max_tokens: int = 90000) -> socket.socket:
    """Send a streaming completion and never read the answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window offered
    s.connect(("127.0.0.1", router.port))
    body = json.dumps({"model": model, "prompt": "go on", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def its_stream_ended(s: socket.socket) -> bool:
    """Read what the router sent: True if the connection was cut (closed or reset), or the stream
    was closed with the error event that says it was cut."""
    s.settimeout(10)
    tail = b""
    try:
        while chunk := s.recv(65536):
            tail = (tail + chunk)[-2000:]
            if tail.endswith(b"0\r\n\r\n"):
                return b"so it was cut; retry it" in tail
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


async def in_flight(router, name: str) -> int:
    return (await router.engine(name))["in_flight"]


async def test_a_stream_whose_client_reads_nothing_is_cut_after_stall_timeout_s_and_frees_its_lease(start_router):
    router = await start_router(roster_dict(sim_model("a", args=LONG), queue={"stall_timeout_s": 1}))
    s = stalled_client(router, "a")
    try:
        await eventually(lambda: in_flight(router, "a"), what="the stalled stream holds a lease")
        await eventually(lambda: _is(in_flight(router, "a"), 0), timeout=10, what="the stalled stream cut and its lease freed")
        assert "cut a stream of a to 127.0.0.1: the client took nothing of its stream for queue.stall_timeout_s=1 s" \
            in router.log()
        assert its_stream_ended(s)
    finally:
        s.close()

    async def recorded() -> list:
        _, _, body = await http(router, "GET", "/admin/activity")
        return body["records"]

    [record] = await eventually(recorded, what="the cut stream's activity record")
    assert record["status"] == 499, "a client cut for not reading is the client's doing, not a server error (nor a 200)"
    assert await ask(client(router), "a")  # the engine itself is untouched
    assert (await router.engine("a"))["in_flight"] == 0


async def test_a_sleep_ends_a_stalled_clients_lease_at_the_drain_deadline(start_router):
    router = await start_router(roster_dict(sim_model("a", args=LONG), queue={"stall_timeout_s": 600},
                                            swap={"drain_timeout_s": 3}))  # long enough for the stream to stall
    pid = (await router.engine("a"))["pid"]
    s = stalled_client(router, "a")
    try:
        await eventually(lambda: in_flight(router, "a"), what="the stalled stream holds a lease")
        status, _, body = await http(router, "POST", "/admin/sleep?model=a")
        assert status == 200 and body["result"] == "sleeping", body
        assert body["engine"]["in_flight"] == 0, "no engine sleeps with a lease out"
        assert "engine a: 1 request(s) still running when the drain ran out (swap.drain_timeout_s=3 s): cutting them" \
            in router.log()
        assert its_stream_ended(s)
    finally:
        s.close()
    assert await ask(client(router), "a")  # woken for this one
    engine = await router.engine("a")
    assert engine["state"] == "awake" and engine["in_flight"] == 0 and engine["pid"] == pid


async def test_a_stream_that_cannot_be_resumed_still_running_at_the_drain_deadline_ends_with_an_error_that_says_why(start_router):
    # A penalty counts the answer's own tokens, which a continuation would count as prompt: it cannot be resumed exactly.
    router = await start_router(roster_dict(sim_model("a", args=("--sim-token-rate", "20")), swap={"drain_timeout_s": 1}))
    stream = await client(router).completions.create(model="a", prompt="slow", max_tokens=200, stream=True,
                                                     frequency_penalty=0.5)
    await anext(aiter(stream))
    status, _, body = await http(router, "POST", "/admin/sleep?model=a")
    assert status == 200 and body["result"] == "sleeping" and body["engine"]["in_flight"] == 0
    with pytest.raises(openai.APIError) as cut:
        async for _ in stream:
            pass
    assert "model 'a' is being put to sleep or restarted and this request was still running when " \
           "swap.drain_timeout_s=1 s ran out, so it was cut; retry it" in cut.value.message


async def _is(value, expected) -> bool:
    return await value == expected
