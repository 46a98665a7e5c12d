"""One request and its answer on a keep-alive HTTP/1.1 connection to an engine: raw request
bytes out, the answer parsed by httptools (llhttp) in the connection's `data_received`.

aiohttp's client put a StreamReader, a future and a task wake-up between every chunk the engine
sent and the client (and re-encoded the chunked framing on the way out); here a response's bytes
are handed to a `Relay` from the protocol callback itself (`router.proxy.relay`), and a waiting handler
is woken once per answer, not once per chunk. httptools was chosen by measurement (docs/benchmarks.md,
"Why httptools"): on the bytes of a 64-chunk stream it costs 0.4x aiohttp's C HttpResponseParser and 0.04x h11.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional, Protocol

import httptools

READ_TIMEOUT_S = 600.0  # the longest silence while an answer is awaited (a long prefill counts)
PENDING_MAX = 64 * 1024  # a stream's bytes held before the client's head is out: then stop reading
END_OF_HEAD = b"\r\n\r\n"  # ends a head, and a chunked body (its last chunk and trailers)


class UpstreamError(Exception):
    """The engine failed to answer: refused, closed, timed out, or broke the protocol."""


class Unreachable(UpstreamError):
    """No connection could be made."""


class ClientGone(UpstreamError):
    """The client went away while its answer was relayed (not the engine's fault)."""


class _AfterAnswer(Exception):
    """Raised from the parser's callback when a second message begins: stop parsing there."""


class Relay(Protocol):
    """Where a streamed answer goes as it arrives (router.proxy.relay.Relay)."""

    def forward(self, raw: bytes, pieces: list[bytes], at_boundary: bool) -> bool:
        """Write a received block (`raw`: as the engine framed it; `pieces`: its body bytes);
        False when the client is gone."""

    def congested(self) -> bool:
        """The client is behind: stop reading the engine until it catches up."""


class Pool(Protocol):
    """Where a connection goes back to, or leaves (router.proxy.upstream.Pool)."""

    def put(self, conn: Connection) -> None:
        """Keep `conn` for the next request (its answer completed)."""

    def discard(self, conn: Connection) -> None:
        """Forget `conn`: it closed while idle."""


class Connection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self.idle_since = 0.0
        self._exchange: Optional[Exchange] = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self._exchange is not None:
            self._exchange.lost(exc)
        else:
            self.pool.discard(self)

    def data_received(self, data: bytes) -> None:
        if self._exchange is None:  # nothing was asked: a broken engine; never reuse this one
            self.abort()
            return
        self._exchange.received(data)

    def pause_writing(self) -> None:  # request bodies are small and written at once
        pass

    def resume_writing(self) -> None:
        pass

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Exchange:
    """One request on a connection and its answer, parsed as it arrives.

    The handler awaits `head()`, then either `body()` (the answer buffered: non-stream) or
    `relay(to)` (each received block handed on as it comes, with back-pressure). `complete`
    says whether the connection may go back to the pool.
    """

    def __init__(self, conn: Connection, read_timeout: float) -> None:
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.chunked = False
        self.stream = False
        self.keep_alive = False
        self.complete = False
        self.got_bytes = False  # any byte of the answer: after one, the request is never sent again
        self.trailing = 0  # bytes the engine sent after its complete answer: dropped, and the connection with them
        self.unsent = False  # the connection was seen closed before the request was written: safe to send again
        self.error: Optional[UpstreamError] = None
        self.first_body_at: Optional[float] = None
        self._head_done = False
        self._head_buf = b""
        self._tail = b""  # the last block parsed (its last 3 bytes count): a CRLFCRLF may end in the next one
        self._body_left: Optional[int] = None  # of a body delimited by Content-Length
        self._pieces: list[bytes] = []
        self._raw: list[bytes] = []  # the body's bytes as received, until a relay takes them
        self._boundary = True
        self._relay: Optional[Relay] = None
        self._paused = False
        self._waiter: Optional[asyncio.Future[None]] = None
        self._rx = self.loop.time()
        self._timer = self.loop.call_at(self._rx + read_timeout, self._check_timeout)
        conn._exchange = self

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer in the same block: never parsed into this one
            raise _AfterAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_done:  # trailers come here too; they are relayed raw, never read
            self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self._head_done = True
        self.status = self.parser.get_status_code()
        self.chunked = b"chunked" in self.headers.get(b"transfer-encoding", b"").lower()
        self.stream = self.headers.get(b"content-type", b"").startswith(b"text/event-stream")
        self.keep_alive = self.parser.should_keep_alive()
        if not self.chunked:
            try:
                self._body_left = int(self.headers[b"content-length"])
            except (KeyError, ValueError):
                pass
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        if self._body_left is not None:
            self._body_left -= len(body)

    def on_chunk_header(self) -> None:
        self._boundary = False

    def on_chunk_complete(self) -> None:
        self._boundary = True

    def on_message_complete(self) -> None:
        self.complete = True
        self._boundary = True

    # -- from the connection ---------------------------------------------------------------------

    def received(self, data: bytes) -> None:
        self.got_bytes = True
        self._rx = self.loop.time()
        if self.complete:  # bytes after a complete answer: the engine broke the protocol
            self._after_answer(len(data))
            return
        head_was_done = self._head_done
        used = len(data)
        try:
            # (the cheapest checks that the answer cannot end in this block; most of a stream's blocks)
            if self._body_left is None and data[0] > 13 and data.find(END_OF_HEAD) == -1:
                self.parser.feed_data(data)  # at once, whole
            else:
                used = self._parse_up_to_end(data)
        except httptools.HttpParserError as exc:
            if self.complete:  # a second answer began in a piece thought to end this one: no count can be trusted
                self.complete = False
                self._fail(UpstreamError("the engine sent bytes after its answer"))
                return
            self._fail(UpstreamError(f"malformed HTTP answer: {exc}"))
            return
        if used < len(data):  # the answer ended inside this block: what follows is not part of it
            self.trailing += len(data) - used
            data = data[:used]
        self._tail = data if used >= 3 else self._tail[-3:] + data  # where a CRLFCRLF may have begun
        if not self._head_done:
            self._head_buf += data  # only to find where the body starts in the block that ends the head
            return
        if not head_was_done:
            block = self._head_buf + data
            data = block[block.index(b"\r\n\r\n") + 4:]
            self._head_buf = b""
        if data and self.first_body_at is None:
            self.first_body_at = time.monotonic()
        relay = self._relay
        if relay is None:
            if self.stream:  # held until the handler has sent the client its head (one loop turn)
                self._raw.append(data)
                if sum(map(len, self._raw)) > PENDING_MAX and self.conn.transport is not None:
                    self.conn.transport.pause_reading()
                    self._paused = True
        else:
            at_boundary = self._boundary and (self.complete or data.endswith(b"\r\n"))
            if not relay.forward(data, self._pieces, at_boundary):
                self._fail(ClientGone("the client went away"))
                return
            self._pieces.clear()
            transport = self.conn.transport
            if relay.congested() and transport is not None:
                transport.pause_reading()
                self._paused = True
                self._wake()
        if self.complete:
            if self.trailing:
                self.conn.abort()  # nothing more is read from it, and it never goes back to the pool
            self._finish()

    def _parse_up_to_end(self, data: bytes) -> int:
        """Feed `data` to the parser in pieces cut wherever the answer may end, up to the piece
        that completes it: how many bytes of `data` belong to the answer.

        httptools reports where a message ends only by callback, and goes on parsing whatever
        follows as the next message. The answer may end after a CRLFCRLF (a head; a chunked
        body's last chunk and trailers) or where a Content-Length body runs out; `received`
        feeds a block without such a place (a stream's ordinary chunk) whole, at once."""
        start, size = 0, len(data)
        while start < size:
            end = self._end_candidate(data, start)
            self.parser.feed_data(data if (start, end) == (0, size) else data[start:end])
            if self.complete:
                return end
            start = end
        return size

    def _end_candidate(self, data: bytes, start: int) -> int:
        """The first place after `start` where the answer may end (or the end of the block)."""
        end = len(data)
        if self._body_left is not None and self._body_left >= 0:
            end = min(end, start + max(self._body_left, 1))
        if start == 0 and data[0] <= 13:  # CR or LF: a CRLFCRLF that began in the previous block?
            tail = self._tail[-3:]
            at = (tail + data[:3]).find(END_OF_HEAD)
            if at != -1:
                return min(end, at + 4 - len(tail))
        at = data.find(END_OF_HEAD, max(start - 3, 0))
        while at != -1 and at + 4 <= start:
            at = data.find(END_OF_HEAD, at + 1)
        return end if at == -1 else min(end, at + 4)

    def _after_answer(self, count: int) -> None:
        """Bytes after the complete answer, in a later block: dropped, and the connection cut."""
        self.trailing += count
        self.conn.abort()

    def lost(self, exc: Optional[Exception]) -> None:
        if self.complete:
            return
        if self._head_done and not self.chunked and b"content-length" not in self.headers:
            self.complete = True  # an answer delimited by the connection's close
            self._finish()
            return
        cause = f" ({exc})" if exc else ""
        if not self.got_bytes:  # it may have read the request and begun it: never sent again (Pool.request)
            self._fail(UpstreamError(f"the engine closed the connection without answering{cause}; the request "
                                     "was not sent again, as the engine may have begun it"))
        else:
            self._fail(UpstreamError(f"the engine closed the connection{cause}"))

    def _check_timeout(self) -> None:
        if self.complete or self.error is not None:
            return
        due = self._rx + self.read_timeout
        if self._paused or self.loop.time() < due:  # a slow client is not a silent engine
            self._timer = self.loop.call_at(max(due, self.loop.time() + 1.0), self._check_timeout)
            return
        self._fail(UpstreamError(f"no answer within {self.read_timeout:g} s"))
        self.conn.abort()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.conn.abort()
        self._finish()

    def _finish(self) -> None:
        self._timer.cancel()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        await self._waiter
        self._waiter = None

    # -- what the handler calls ----------------------------------------------------------------

    def send(self, data: bytes) -> None:
        transport = self.conn.transport
        if self.conn.closed or transport is None or transport.is_closing():  # the engine never got a byte of it
            self.unsent = True
            self._fail(UpstreamError("the engine closed the connection before the request was sent"))
            return
        transport.write(data)

    @property
    def content_type(self) -> str:
        return self.headers.get(b"content-type", b"application/json").decode("latin-1")

    async def head(self) -> None:
        while not self._head_done and self.error is None:
            await self._wait()
        if not self._head_done:
            raise self.error  # type: ignore[misc]

    async def body(self) -> bytes:
        while not self.complete and self.error is None:
            await self._wait()
        if not self.complete:
            raise self.error  # type: ignore[misc]
        return b"".join(self._pieces)

    async def relay(self, relay: Relay, drain) -> None:
        """Hand the body to `relay` as it arrives; `drain()` waits until the client has taken
        what was written. Raises UpstreamError if the answer does not complete."""
        raw, self._raw = b"".join(self._raw), []
        self._relay = relay
        if self._paused and self.error is None and self.conn.transport is not None:
            self._paused = False
            self.conn.transport.resume_reading()
        if raw or self.complete:
            at_boundary = self._boundary and (self.complete or raw.endswith(b"\r\n") or not raw)
            if not relay.forward(raw, self._pieces, at_boundary):
                self._fail(ClientGone("the client went away"))
            self._pieces.clear()
        while not self.complete and self.error is None:
            await self._wait()
            if self._paused and self.error is None:
                await drain()
                self._paused = False
                if self.conn.transport is not None and not self.conn.closed:
                    self.conn.transport.resume_reading()
                self._rx = self.loop.time()
        if not self.complete:
            raise self.error  # type: ignore[misc]

    def end(self) -> None:
        """Detach from the connection: back to the pool when the answer completed (and nothing
        followed it), else cut."""
        self._timer.cancel()
        self.conn._exchange = None
        # The parser holds this exchange's bound callbacks, a reference cycle: broken here, the exchange
        # is freed when its last reference goes, not by the cyclic GC, whose collections of one cycle
        # per request cost a busy router more CPU than its activity log and metrics together.
        self.parser = None  # type: ignore[assignment]
        if self.complete and self.error is None and self.keep_alive and not self.trailing and not self.conn.closed:
            self.conn.pool.put(self.conn)
        else:
            self.conn.abort()  # never reuse a connection mid-answer; cutting it makes vLLM abort
