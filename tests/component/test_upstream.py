"""The router's upstream connections (router.proxy.upstream, router.proxy.relay) against scripted HTTP
servers on loopback: the behaviours an engine cannot be made to show on demand (a silent
answer, an idle close racing a reuse, a client that stops reading)."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import pytest

from config.schema import ModelSpec
from engines.states import State
from router.app import build_router
from router.proxy.relay import Relay
from router.proxy.exchange import UpstreamError
from router.proxy import upstream
from router.proxy.upstream import CONNECTS_AT_ONCE, Pool
from tests.support import eventually, sim_roster

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class Script:
    """A loopback server: `answer(n, reader, writer)` runs for the n-th request (from 0), on any connection."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests = 0
        self.connections = 0
        self.closed_by_peer = asyncio.Event()

    async def start(self) -> Pool:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Pool(f"http://127.0.0.1:{port}", read_timeout=0.5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    await reader.readexactly(len(REQUEST))
                except asyncio.IncompleteReadError:
                    self.closed_by_peer.set()
                    return
                n, self.requests = self.requests, self.requests + 1
                if not await self.answer(n, reader, writer):
                    return
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()


async def scripted(answer):
    script = Script(answer)
    return script, await script.start()


async def test_a_silent_engine_is_a_timeout_and_its_connection_is_cut():
    async def silent(n, reader, writer):
        await reader.read()  # until the router cuts the connection
        script.closed_by_peer.set()
        return False

    script, pool = await scripted(silent)
    started = time.monotonic()
    with pytest.raises(UpstreamError, match="no answer within 0.5 s"):
        await pool.request(REQUEST)
    assert time.monotonic() - started < 5
    await asyncio.wait_for(script.closed_by_peer.wait(), 5)  # cut, so a real engine would abort the request
    script.close()


async def test_a_stream_that_goes_silent_mid_way_times_out_without_a_hang():
    async def one_chunk_then_silence(n, reader, writer):
        writer.write(SSE_HEAD + b"6\r\ndata: \r\n")
        await reader.read()
        return False

    script, pool = await scripted(one_chunk_then_silence)
    exchange = await pool.request(REQUEST)
    sink = await _sink()
    relay = Relay(sink.transport, True, exchange.chunked)
    with pytest.raises(UpstreamError, match="no answer within 0.5 s"):
        await asyncio.wait_for(exchange.relay(relay, sink.drain), 5)
    assert relay.at_boundary  # so the proxy can still end the stream with its error event
    exchange.end()
    script.close()


async def test_a_request_the_engine_read_on_a_pooled_connection_and_closed_on_is_never_sent_again():
    async def close_the_first_reuse(n, reader, writer):
        if n == 1:  # the second request, on the pooled connection: read, then closed unanswered
            return False
        writer.write(ANSWER)
        return True

    script, pool = await scripted(close_the_first_reuse)
    first = await pool.request(REQUEST)
    assert await first.body() == b'{"a":1}'
    first.end()
    assert len(pool.idle) == 1
    with pytest.raises(UpstreamError, match="closed the connection without answering; the request was not sent again"):
        await pool.request(REQUEST)
    assert (script.requests, script.connections) == (2, 1)  # the engine got it once: it may be generating it
    script.close()


async def test_a_connection_seen_closed_before_the_write_is_retried_on_a_new_one():
    """The one retry that is safe: nothing of the request left the router. Here the engine
    closes a new connection as it accepts it (as at a connection limit), and the router has
    seen the close by the time the connection comes to the request."""
    accepted, requests = [0], [0]

    async def serve(reader, writer):
        accepted[0] += 1
        if accepted[0] == 1:
            writer.close()
            return
        while True:
            try:
                await reader.readexactly(len(REQUEST))
            except asyncio.IncompleteReadError:
                break
            requests[0] += 1
            writer.write(ANSWER)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_timeout=5)
    open_now = pool._open

    async def open_and_see_the_close():
        conn = await open_now()
        if accepted[0] <= 1:
            await eventually(lambda: conn.closed, timeout=5, what="the engine's close seen by the router")
        return conn

    pool._open = open_and_see_the_close  # type: ignore[method-assign]
    exchange = await pool.request(REQUEST)
    assert await exchange.body() == b'{"a":1}'
    exchange.end()
    assert (accepted[0], requests[0]) == (2, 1)  # sent once, on the second connection
    pool.close()
    server.close()


async def test_a_pooled_connection_idle_for_longer_than_idle_s_is_retired_not_reused():
    async def answer(n, reader, writer):
        writer.write(ANSWER)
        return True

    script, pool = await scripted(answer)
    first = await pool.request(REQUEST)
    await first.body()
    first.end()
    (kept,) = pool.idle
    kept.idle_since -= upstream.IDLE_S  # as if it had sat idle that long: the engine may be closing it now
    second = await pool.request(REQUEST)
    assert await second.body() == b'{"a":1}'
    second.end()
    assert kept.closed and pool.idle != [kept]
    assert (script.requests, script.connections) == (2, 2)
    script.close()


async def test_a_connection_the_engine_closes_while_idle_leaves_the_pool_at_once():
    async def answer_then_close(n, reader, writer):
        writer.write(ANSWER)  # keep-alive by its headers, then closed: an engine's idle timeout
        await writer.drain()
        return False

    script, pool = await scripted(answer_then_close)
    first = await pool.request(REQUEST)
    await first.body()
    first.end()
    await eventually(lambda: _empty(pool), timeout=5, what="the closed connection dropped from the pool")
    second = await pool.request(REQUEST)
    assert await second.body() == b'{"a":1}'
    second.end()
    assert (script.requests, script.connections) == (2, 2)  # no request was sent into the closed one
    script.close()


async def _empty(pool: Pool) -> bool:
    return not pool.idle


async def test_no_retry_once_the_engine_began_to_answer_or_on_a_new_connection():
    async def half_an_answer(n, reader, writer):
        if n == 0:
            writer.write(ANSWER)
            return True
        writer.write(b"HTTP/1.1 200 OK\r\n")  # began, then died: the engine may have acted on it
        return False

    script, pool = await scripted(half_an_answer)
    first = await pool.request(REQUEST)
    await first.body()
    first.end()
    with pytest.raises(UpstreamError, match="closed the connection"):
        await pool.request(REQUEST)
    assert script.requests == 2
    with pytest.raises(UpstreamError, match="closed the connection"):
        await pool.request(REQUEST)  # a new connection, closed after the answer began: never resent
    assert script.requests == 3
    script.close()


EVIL = b"HTTP/1.1 418 I'm a teapot\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"id\":\"EVIL\"}"


async def test_a_second_response_written_with_the_first_is_dropped_with_its_connection():
    first = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n{\"id\":\"a\"}"

    async def two_answers_at_once(n, reader, writer):
        writer.write(first + EVIL if n == 0 else ANSWER)
        return True

    script, pool = await scripted(two_answers_at_once)
    exchange = await pool.request(REQUEST)
    assert await exchange.body() == b'{"id":"a"}'
    assert (exchange.status, exchange.headers[b"content-length"]) == (200, b"10")  # its own, not the second's
    assert exchange.trailing == len(EVIL)
    exchange.end()
    assert not pool.idle  # never offered to another request, which would read the rest as its answer
    again = await pool.request(REQUEST)
    assert await again.body() == b'{"a":1}'
    again.end()
    assert (script.requests, script.connections) == (2, 2)  # the next request opened a new connection
    script.close()


async def test_a_second_response_written_with_the_end_of_a_stream_never_reaches_the_client():
    events = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b'data: {"a":1}\n\n', b"data: [DONE]\n\n")) + b"0\r\n\r\n"

    async def stream_then_another_answer(n, reader, writer):
        writer.write(SSE_HEAD + events + EVIL)
        return True

    script, pool = await scripted(stream_then_another_answer)
    exchange = await pool.request(REQUEST)
    reader_side, sink = await _sink_pair()
    relay = Relay(sink.transport, True, exchange.chunked)
    await asyncio.wait_for(exchange.relay(relay, sink.drain), 5)
    relay.end()
    exchange.end()
    sink.close()
    received = await asyncio.wait_for(reader_side.read_all(), 5)
    assert received == events  # the engine's stream as it framed it, and nothing after its last chunk
    assert exchange.trailing == len(EVIL) and not pool.idle
    script.close()


async def test_a_client_that_stops_reading_stops_the_engine_and_nothing_piles_up_in_between():
    chunk = b"data: " + b"x" * 65_000 + b"\n\n"
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    total = 400  # 26 MB: far more than the sockets and the router may hold
    sent = [0]
    blocked = asyncio.Event()

    async def flood(n, reader, writer):
        writer.write(SSE_HEAD)
        for _ in range(total):
            writer.write(framed)
            sent[0] += 1
            if writer.transport.get_write_buffer_size() > 64 * 1024:  # the router is not reading: drain() waits
                blocked.set()
            await writer.drain()
            blocked.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    script, pool = await scripted(flood)
    exchange = await pool.request(REQUEST)
    reader_side, sink = await _sink_pair()
    relay = Relay(sink.transport, True, exchange.chunked)
    task = asyncio.create_task(exchange.relay(relay, sink.drain))
    await eventually(lambda: _blocked(blocked, exchange), timeout=20, what="the engine blocked by the slow client")
    assert sink.transport.get_write_buffer_size() < relay.high + 1024 * 1024  # one received block past the mark, at most
    assert sent[0] < total // 2
    received = await asyncio.wait_for(reader_side.read_all(), 60)
    await asyncio.wait_for(task, 5)
    exchange.end()
    assert received == framed * total + b"0\r\n\r\n"  # every byte, as the engine framed it
    assert len(pool.idle) == 1
    script.close()


async def _blocked(event: asyncio.Event, exchange) -> bool:
    # paused by the relay (a pause before the relay took over is another, earlier bound)
    return event.is_set() and exchange._relay is not None and exchange._paused


class SlowReader:
    """The client end of the relay's socket: reads nothing until `read_all()`."""

    def __init__(self) -> None:
        self.server: asyncio.AbstractServer
        self.accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.get_running_loop().create_future()

    async def read_all(self) -> bytes:
        reader, _ = await self.accepted
        out = bytearray()
        while not out.endswith(b"0\r\n\r\n"):
            data = await reader.read(1 << 20)
            if not data:
                break
            out += data
        return bytes(out)


async def _sink_pair() -> tuple[SlowReader, asyncio.StreamWriter]:
    slow = SlowReader()

    async def accept(reader, writer):
        slow.accepted.set_result((reader, writer))

    slow.server = await asyncio.start_server(accept, "127.0.0.1", 0, limit=1 << 20)
    _, writer = await asyncio.open_connection("127.0.0.1", slow.server.sockets[0].getsockname()[1])
    return slow, writer


async def _sink() -> asyncio.StreamWriter:
    return (await _sink_pair())[1]





async def test_a_connection_given_back_goes_to_the_request_that_waited_longest_not_to_a_newcomer():
    """Under a burst, connections come back faster than new ones open: a request that arrives
    later must not take one ahead of a request already waiting for its connect."""
    held = asyncio.Event()

    async def first_answer_held(n, reader, writer):
        if n == 0:
            await held.wait()
        writer.write(ANSWER)
        return True

    script, pool = await scripted(first_answer_held)
    first = asyncio.create_task(pool.request(REQUEST))
    await eventually(lambda: script.requests == 1, what="the first request reached the engine")
    connects = asyncio.Event()  # from here on, a new connection takes until this is set: an engine slow to accept
    open_now = pool._open

    async def slow_open():
        await connects.wait()
        return await open_now()

    pool._open = slow_open  # type: ignore[method-assign]
    finished: list[str] = []

    async def one(name: str) -> None:
        exchange = await pool.request(REQUEST)
        await exchange.body()
        exchange.end()
        finished.append(name)

    waiting = asyncio.create_task(one("waiting"))
    await eventually(lambda: len(pool._line) == 1, what="a request waits in line")
    held.set()
    head = await first
    await head.body()
    head.end()  # the first connection is free again
    newcomer = asyncio.create_task(one("newcomer"))
    await asyncio.wait_for(waiting, 5)
    connects.set()
    await asyncio.wait_for(newcomer, 5)
    assert finished == ["waiting", "newcomer"]
    pool.close()
    script.close()


async def test_many_new_connections_to_an_engine_slow_to_accept_are_all_answered():
    """An engine whose loop is busy (it accepts late) and whose listen backlog is short, while the
    router opens connections for hundreds of concurrent requests: every request gets its answer,
    none sits unread in the engine's kernel (router.proxy.upstream.CONNECTS_AT_ONCE says how one would)."""
    backlog, clients = 32, 1000
    assert backlog > CONNECTS_AT_ONCE
    engine = await asyncio.create_subprocess_exec(sys.executable, "-c", BUSY_ENGINE, str(backlog), stdout=asyncio.subprocess.PIPE)
    try:
        port = int(await asyncio.wait_for(engine.stdout.readline(), 10))  # type: ignore[union-attr]
        pool = Pool(f"http://127.0.0.1:{port}", read_timeout=15)

        async def one() -> bytes:
            exchange = await pool.request(REQUEST)
            try:
                return await exchange.body()
            finally:
                exchange.end()

        results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(clients)), return_exceptions=True), 60)
        pool.close()
    finally:
        engine.kill()
        await asyncio.wait_for(engine.wait(), 10)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {clients} failed, e.g. {failed[0]!r}"


# A loopback HTTP server in its own process, its loop blocked 5 ms of every 6 (its CPU taken by
# generation), so accept() lags the router's connects; it prints its port once listening.
BUSY_ENGINE = f"""
import asyncio, sys, time
import uvloop

async def serve(reader, writer):
    try:
        while True:
            await reader.readexactly({len(REQUEST)})
            writer.write({ANSWER!r})
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=int(sys.argv[1]))
    print(server.sockets[0].getsockname()[1], flush=True)
    while True:
        time.sleep(0.005)  # the simulated load itself
        await asyncio.sleep(0.001)

uvloop.run(main())
"""


@pytest.mark.parametrize("change", ["removed", "changed"])
async def test_an_engine_that_leaves_the_roster_or_restarts_from_a_changed_entry_has_its_pooled_connections_closed(change, tmp_path):
    """An engine's pool is closed when the engine stops. An attached engine (`url:`) outlives its
    roster entry: otherwise the router would hold keep-alive connections to it until the
    engine's own idle timeout, however long that is."""
    async def answer(n, reader, writer):
        writer.write(ANSWER)
        return True

    script, probe = await scripted(answer)
    url = f"http://{probe.netloc}"
    roster = sim_roster({"name": "ext", "url": url})
    async with aiohttp.ClientSession() as session:
        router = build_router(roster, tmp_path, session)
        exchange = await router.upstreams.pool(url).request(REQUEST)
        await exchange.body()
        exchange.end()
        assert len(router.upstreams.pool(url).idle) == 1
        engine = router.engines["ext"]
        engine._enter(State.BOOTING)  # as if booted: the connection above is one a request left behind
        engine._enter(State.AWAKE)
        if change == "removed":
            router.placement.retire(engine)
            await router.placement._retire(engine)
        else:
            router.placement.respec(engine, ModelSpec(name="ext", url=url, gate={"prompt": "another canary"}))
            await router.placement._respec(engine)
        await asyncio.wait_for(script.closed_by_peer.wait(), 5)
    script.close()


async def test_an_answered_request_leaves_no_reference_cycle_for_the_garbage_collector():
    # One cycle per request (the parser holds the exchange's callbacks) cost a busy router more CPU in
    # collections than its activity log and metrics together (bench/peers.py): freed by refcount instead.
    import gc

    from router.proxy.exchange import Exchange

    async def answer(n, reader, writer):
        writer.write(ANSWER)
        await writer.drain()
        return True

    script, pool = await scripted(answer)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(20):
            exchange = await pool.request(REQUEST)
            assert await exchange.body() == b'{"a":1}'
            exchange.end()
        del exchange
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, Exchange)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        pool.close()
        script.close()
    assert left == []
