"""A streamed answer on its way to the client: the engine's bytes written to the client's socket
from the upstream connection's callback (router.proxy.exchange), framed once.

When the engine chunks its answer and the client speaks HTTP/1.1 (always, in practice), the
engine's chunked bytes are already valid framing for the client: they go out as received,
terminating chunk and trailers included, never re-encoded. Otherwise (an engine that delimits
a stream by length or by closing, or an HTTP/1.0 client) the body bytes of each received block
are framed here. Either way aiohttp's writer frames nothing of the body: the relay owns it.

A client that takes nothing of its stream for `queue.stall_timeout_s` while the relay waits for
it (`drained`) is cut: it holds a lease, and a leased engine is never parked, restarted or removed.

An engine that fails mid-stream gets the stream's error event (router.errors.sse_error) when
the client's stream stands between two chunks; mid-chunk, no event can be framed any more,
so the client's connection is cut, which its HTTP library reports as an incomplete body.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable, Optional

from router.proxy.exchange import ClientGone
from router.proxy.responses import StreamSniffer
from router.proxy.continuation import Splice
from router.proxy.resume import Transcript, strip_prompt_ids

TERMINATOR = b"0\r\n\r\n"
# The final usage event and `data: [DONE]` arrive as one or two body pieces each (one HTTP chunk per
# SSE event); an event cut into more pieces than this is just not read for its numbers.
TAIL_PIECES = 16
STALL_POLL_S = 1.0  # how often a relay waiting for its client looks for progress; not a limit


class ClientStalled(ClientGone):
    """The client took nothing of its stream for queue.stall_timeout_s: its connection was cut."""


class Relay:
    def __init__(self, transport: asyncio.Transport, chunked_out: bool, chunked_in: bool,
                 sniffer: Optional[StreamSniffer] = None, keep_tail: bool = False,
                 transcript: Optional[Transcript] = None, strip: bool = False, rewrite: Optional[Splice] = None) -> None:
        self.transport = transport
        self.chunked = chunked_out
        self.can_raw = chunked_out and chunked_in and rewrite is None
        self.raw = self.can_raw and not strip
        self.raw_next = False
        self.transcript = transcript  # what the client got, should the answer be resumed (router.proxy.resume)
        self.strip = strip  # the prompt's ids asked for the transcript, not by the client: in the first event
        self.first: list[bytes] = []  # while stripping, the first event until it is whole
        self.rewrite = rewrite  # a continuation's events, rewritten as the rest of the client's answer (it records them)
        self.sniffer = sniffer
        # The stream's last decoded pieces (references, no copies), where the final usage event
        # carries the answer's own acceptance numbers; None when nobody reads them.
        self.tail: Optional[collections.deque[bytes]] = collections.deque(maxlen=TAIL_PIECES) if keep_tail else None
        self.at_boundary = True
        self.high = transport.get_write_buffer_limits()[1]
        self.written = 0  # bytes handed to the transport, framing included

    def forward(self, raw: bytes, pieces: list[bytes], at_boundary: bool) -> bool:
        transport = self.transport
        if self.raw_next:
            self.raw, self.raw_next = True, False
        if transport.is_closing():
            return False
        if self.rewrite is not None and self.rewrite.ended:
            return False  # a stop across the seam ended the answer: the continuation is cut off (router.proxy.continuation)
        if self.sniffer is not None:  # Responses only: the id is in the first event
            for piece in pieces:
                self.sniffer.feed(piece)
            if self.sniffer.done:
                self.sniffer = None
        if self.rewrite is not None:
            pieces = self.rewrite(pieces)
        elif self.transcript is not None:
            self.transcript.extend(pieces)
            if self.strip:
                pieces = self._without_prompt_ids(pieces)
        if self.tail is not None:
            self.tail.extend(pieces)
        if self.raw:
            if raw:
                transport.write(raw)
                self.written += len(raw)
            self.at_boundary = at_boundary
        elif pieces:
            size = sum(map(len, pieces))
            if self.chunked:
                head = b"%x\r\n" % size
                transport.writelines([head, *pieces, b"\r\n"])
                size += len(head) + 2
            else:
                transport.writelines(pieces)
            self.written += size
        if not (self.raw or self.strip) and at_boundary and self.transcript is not None:
            # The prompt's ids went with the first event: the rest go as the engine framed them, from the next call
            # on (this one's raw bytes may hold the body's end, which went out as pieces).
            self.raw_next = self.can_raw
        return True

    def _without_prompt_ids(self, pieces: list[bytes]) -> list[bytes]:
        """The first event, once whole, without the prompt's ids; nothing while it is not."""
        self.first.extend(pieces)
        data = b"".join(self.first)
        if b"\n\n" not in data:
            self.first = [data]
            return []
        self.first, self.strip = [], False
        return strip_prompt_ids([data])

    def congested(self) -> bool:
        # Above the transport's high-water mark it has paused aiohttp's protocol, so the
        # writer's drain() waits until the client has read it down to the low mark.
        return self.transport.get_write_buffer_size() > self.high

    @property
    def taken(self) -> int:
        """Bytes the client's socket has taken so far: written, less what the transport still holds."""
        return self.written - self.transport.get_write_buffer_size()

    async def drained(self, drain: Callable[[], Awaitable[None]], stall_s: float) -> None:
        """Wait, as `drain()` does, until the client has read the buffer down; but one that takes
        nothing for `stall_s` is cut (ClientStalled) rather than waited for for ever."""
        loop = asyncio.get_running_loop()
        # Never cancelled: aiohttp keeps its drain waiter across calls, and a cancelled one would
        # fail every later drain. It ends when the client reads, or when its connection is lost.
        waiting = asyncio.ensure_future(drain())
        waiting.add_done_callback(_observed)
        taken, since = self.taken, loop.time()
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=min(STALL_POLL_S, stall_s / 4))
            if done:
                return waiting.result()
            now = loop.time()
            if self.taken > taken:
                taken, since = self.taken, now
            elif now - since >= stall_s:
                self.transport.abort()
                raise ClientStalled(f"the client took nothing of its stream for queue.stall_timeout_s={stall_s:g} s")

    def end(self) -> None:
        """The engine's answer is complete: close the body (the raw path forwarded the engine's own end)."""
        if self.rewrite is not None and (rest := self.rewrite.flush()):
            self.rewrite, self.transcript = None, None  # rewritten and recorded already
            self.forward(b"", rest, True)
        if self.first:  # an answer that ended inside its first event: what came of it, as it came
            rest, self.first, self.strip, self.transcript = self.first, [], False, None
            self.forward(b"", rest, True)
        if self.chunked and not self.raw and not self.transport.is_closing():
            self.transport.write(TERMINATOR)

    def end_with_error(self, event: bytes) -> None:
        """The engine failed mid-answer: the error event ends the stream, or, mid-chunk, the connection is cut."""
        transport = self.transport
        if transport.is_closing():
            return
        if not self.at_boundary:
            transport.abort()
        elif self.chunked:
            transport.writelines([b"%x\r\n" % len(event), event, b"\r\n", TERMINATOR])
        else:
            transport.write(event)


def _observed(task: "asyncio.Future[None]") -> None:
    if not task.cancelled():
        task.exception()  # a lost connection, already handled where the relay stopped
