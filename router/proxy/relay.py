"""A streamed answer on its way to the client: the engine's bytes written to the client's socket
from the upstream connection's callback (router.proxy.exchange), framed once.

When the engine chunks its answer and the client speaks HTTP/1.1 (always, in practice), the
engine's chunked bytes are already valid framing for the client: they go out as received,
terminating chunk and trailers included, never re-encoded. Otherwise (an engine that delimits
a stream by length or by closing, or an HTTP/1.0 client) the body bytes of each received block
are framed here. Either way aiohttp's writer frames nothing of the body: the relay owns it.

An engine that fails mid-stream gets the stream's error event (router.errors.sse_error) when
the client's stream stands between two chunks; mid-chunk, no event can be framed any more,
so the client's connection is cut, which its HTTP library reports as an incomplete body.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from router.proxy.responses import StreamSniffer

TERMINATOR = b"0\r\n\r\n"


class Relay:
    def __init__(self, transport: asyncio.Transport, chunked_out: bool, chunked_in: bool,
                 sniffer: Optional[StreamSniffer] = None) -> None:
        self.transport = transport
        self.chunked = chunked_out
        self.raw = chunked_out and chunked_in
        self.sniffer = sniffer
        self.at_boundary = True
        self.high = transport.get_write_buffer_limits()[1]

    def forward(self, raw: bytes, pieces: list[bytes], at_boundary: bool) -> bool:
        transport = self.transport
        if transport.is_closing():
            return False
        if self.sniffer is not None:  # Responses only: the id is in the first event
            for piece in pieces:
                self.sniffer.feed(piece)
            if self.sniffer.done:
                self.sniffer = None
        if self.raw:
            if raw:
                transport.write(raw)
            self.at_boundary = at_boundary
        elif pieces:
            if self.chunked:
                transport.writelines([b"%x\r\n" % sum(map(len, pieces)), *pieces, b"\r\n"])
            else:
                transport.writelines(pieces)
        return True

    def congested(self) -> bool:
        # Above the transport's high-water mark it has paused aiohttp's protocol, so the
        # writer's drain() waits until the client has read it down to the low mark.
        return self.transport.get_write_buffer_size() > self.high

    def end(self) -> None:
        """The engine's answer is complete: close the body (the raw path forwarded the engine's own end)."""
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
