"""Fuzzing the stream relay (router.exchange + router.relay) with httptools as the oracle.

An engine's chunked answer (random chunk sizes, chunk extensions, trailers), cut into random
receive blocks, maybe truncated anywhere: the client's bytes parse (by httptools, the parser
the router itself uses) to the engine's body, or to what arrived of it plus the error event,
or the client's connection is cut. Whatever the engine writes after its complete answer (a
second response, any bytes) reaches no client and retires the connection. Never a hang: every
run ends within a deadline.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import httptools
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.proxy.relay import Relay
from router.proxy.resume import Transcript
from router.proxy.exchange import Connection, Exchange, UpstreamError
from router.proxy.upstream import Pool

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
CLIENT_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b'event: error\ndata: {"error": "engine failed mid-stream"}\n\n'


class UpstreamTransport:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.closing = False

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.conn.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closing


class ClientTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, chunks) -> None:
        for c in chunks:
            self.data += c

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16 * 1024, 64 * 1024)


class Oracle:
    def __init__(self, wire: bytes) -> None:
        self.body = bytearray()
        self.complete = False
        self.trailers: list[tuple[bytes, bytes]] = []
        self.error: Optional[Exception] = None
        try:
            httptools.HttpResponseParser(self).feed_data(wire)
        except httptools.HttpParserError as exc:
            self.error = exc

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


chunk = st.tuples(st.binary(min_size=1, max_size=40),
                  st.sampled_from([b"", b";a=b", b';name="q v"', b";x"]))
trailer = st.tuples(st.sampled_from([b"X-Trailer", b"Checksum"]), st.text("abc123", min_size=1, max_size=8).map(str.encode))


def chunked(chunks: list[tuple[bytes, bytes]], last_ext: bytes, trailers: list[tuple[bytes, bytes]]) -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(data), ext, data) for data, ext in chunks)
    return out + b"0" + last_ext + b"\r\n" + b"".join(b"%s: %s\r\n" % t for t in trailers) + b"\r\n"


async def relay_blocks(blocks: list[bytes], lost: bool, chunked_in: bool = True, relay_of=None):
    """Feed `blocks` to a connection as its receive blocks (the engine closes after them when
    `lost`), relay the stream to a client; returns the client's transport, the error, if any,
    and the connection."""
    conn = Connection(Pool("http://127.0.0.1:9"))
    conn.connection_made(UpstreamTransport(conn))  # type: ignore[arg-type]
    exchange = Exchange(conn, read_timeout=30)
    client = ClientTransport()
    error: list[UpstreamError] = []

    async def handler() -> None:
        try:
            await exchange.head()
            relay = (relay_of or Relay)(client, True, exchange.chunked)  # type: ignore[arg-type]
            try:
                await exchange.relay(relay, asyncio.sleep)
            except UpstreamError as exc:
                relay.end_with_error(EVENT)
                raise
            relay.end()
        except UpstreamError as exc:
            error.append(exc)
        finally:
            exchange.end()

    task = asyncio.create_task(handler())
    for block in blocks:
        if conn.closed:
            break
        conn.data_received(block)
        await asyncio.sleep(0)  # the handler runs between some blocks: before, while and after it attaches
    if lost and not conn.closed:
        conn.connection_lost(None)
    await asyncio.wait_for(task, 2)  # never a hang
    return client, (error[0] if error else None), conn


def split(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    return [wire[a:b] for a, b in zip(points, points[1:]) if b > a]


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(chunks=st.lists(chunk, max_size=12), last_ext=st.sampled_from([b"", b";end"]),
       trailers=st.lists(trailer, max_size=2), cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8))
def test_a_whole_chunked_answer_reaches_the_client_byte_for_byte(chunks, last_ext, trailers, cuts):
    body = chunked(chunks, last_ext, trailers)
    client, error, _ = asyncio.run(relay_blocks(split(HEAD + body, cuts), lost=False))
    assert error is None
    assert bytes(client.data) == body  # the engine's framing, extensions and trailers included
    oracle = Oracle(CLIENT_HEAD + bytes(client.data))
    assert oracle.complete and bytes(oracle.body) == b"".join(data for data, _ in chunks)


@SETTINGS
@given(chunks=st.lists(chunk, min_size=1, max_size=12), trailers=st.lists(trailer, max_size=2),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8), keep=st.floats(0, 1, exclude_max=True))
def test_a_truncated_answer_ends_in_the_error_event_or_a_cut_connection(chunks, trailers, cuts, keep):
    body = chunked(chunks, b"", trailers)
    wire = (HEAD + body)[: len(HEAD) + int(keep * len(body))]
    client, error, _ = asyncio.run(relay_blocks(split(wire, cuts), lost=True))
    assert error is not None and "closed the connection" in str(error)
    if client.aborted:
        return  # mid-chunk: no event can be framed; the client sees an incomplete body
    oracle = Oracle(CLIENT_HEAD + bytes(client.data))
    assert oracle.error is None and oracle.complete
    assert bytes(oracle.body) == bytes(Oracle(wire).body) + EVENT  # what arrived, then the error


@SETTINGS
@given(events=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=6))
def test_a_stream_delimited_by_length_is_framed_for_the_client(events, cuts):
    payload = b"".join(events)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(payload)
    client, error, _ = asyncio.run(relay_blocks(split(head + payload, cuts), lost=False))
    assert error is None
    oracle = Oracle(CLIENT_HEAD + bytes(client.data))
    assert oracle.complete and bytes(oracle.body) == payload


# What an engine might write after its answer: a second response (the reproduced case), or any bytes.
after = st.one_of(st.sampled_from([b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{\"id\":\"EVIL\"}",
                                   b"\r\n", b"0\r\n\r\n", HEAD + b"0\r\n\r\n"]),
                  st.binary(min_size=1, max_size=40))


@SETTINGS
@given(chunks=st.lists(chunk, max_size=12), last_ext=st.sampled_from([b"", b";end"]),
       trailers=st.lists(trailer, max_size=2), extra=after, cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8))
def test_bytes_after_a_complete_chunked_answer_never_reach_the_client_and_the_connection_is_dropped(
        chunks, last_ext, trailers, extra, cuts):
    body = chunked(chunks, last_ext, trailers)
    client, error, conn = asyncio.run(relay_blocks(split(HEAD + body + extra, cuts), lost=False))
    assert error is None
    assert bytes(client.data) == body  # the answer as the engine framed it; not one byte of what followed
    assert conn.closed and not conn.pool.idle


@SETTINGS
@given(events=st.lists(st.binary(min_size=1, max_size=40), max_size=8), extra=after,
       cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=6))
def test_bytes_after_a_stream_delimited_by_length_never_reach_the_client(events, extra, cuts):
    payload = b"".join(events)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(payload)
    client, error, conn = asyncio.run(relay_blocks(split(head + payload + extra, cuts), lost=False))
    assert error is None
    oracle = Oracle(CLIENT_HEAD + bytes(client.data))
    assert oracle.complete and bytes(oracle.body) == payload
    assert conn.closed and not conn.pool.idle


async def buffered(blocks: list[bytes]) -> tuple[int, bytes, Connection]:
    """Feed `blocks` to a connection as its receive blocks; the answer read whole, as for a JSON body."""
    conn = Connection(Pool("http://127.0.0.1:9"))
    conn.connection_made(UpstreamTransport(conn))  # type: ignore[arg-type]
    exchange = Exchange(conn, read_timeout=30)
    for block in blocks:
        if conn.closed:
            break
        conn.data_received(block)
    try:
        return exchange.status, await asyncio.wait_for(exchange.body(), 2), conn
    finally:
        exchange.end()


@SETTINGS
@given(payload=st.binary(max_size=200), extra=after, chunked_in=st.booleans(),
       cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=6))
def test_a_buffered_answer_is_exactly_its_own_body_whatever_follows_it(payload, extra, chunked_in, cuts):
    if chunked_in:
        wire = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked([(payload, b"")] if payload else [], b"", [])
    else:
        wire = b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    status, body, conn = asyncio.run(buffered(split(wire + extra, cuts)))
    assert (status, body) == (201, payload)  # the status is the answer's own, never the next one's
    assert conn.closed and not conn.pool.idle


@SETTINGS
@given(texts=st.lists(st.text("ab ", min_size=1, max_size=6), min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=8))
def test_a_resumable_stream_reaches_the_client_whole_without_the_prompts_ids(texts, cuts):
    """The relay removes the prompt's ids from the first event, then passes the engine's framing on: the
    client's body is every event (the first without its prompt ids) and ends, however the blocks fall
    (the whole answer may arrive before the relay attaches)."""
    def event(text: str, i: int, first: bool = False) -> bytes:
        prompt = ',"prompt_token_ids":[1,2,3]' if first else ""
        return b'data: {"id":"c","choices":[{"index":0,"text":"%s"%s,"token_ids":[%d]}]}\n\n' % (
            text.encode(), prompt.encode(), i)
    events = [event("", 0, first=True)] + [event(t, i) for i, t in enumerate(texts, start=1)] + [b"data: [DONE]\n\n"]
    body = chunked([(e, b"") for e in events], b"", [])

    def resumable(client, chunked_out, chunked_in):
        return Relay(client, chunked_out, chunked_in, transcript=Transcript(chat=False), strip=True)

    client, error, _ = asyncio.run(relay_blocks(split(HEAD + body, cuts), lost=False, relay_of=resumable))
    assert error is None
    oracle = Oracle(CLIENT_HEAD + bytes(client.data))
    assert oracle.complete, "the client's stream ends"
    assert bytes(oracle.body) == b"".join(events).replace(b',"prompt_token_ids":[1,2,3]', b"")
