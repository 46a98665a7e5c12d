"""The floor for a Python proxy on hotswap's own upstream path: what bench/peers.py's `floor` measures.

`python bench/floor_proxy.py --upstream http://127.0.0.1:8001 --port 8002`

hotswap's engine side as it is (router.proxy.upstream's pool, router.proxy.exchange's httptools parsing,
router.proxy.relay's pass-through) behind a client side with no web framework: an asyncio protocol
on uvloop, requests parsed by httptools, answers' heads written as bytes. No auth, routing,
scheduler, metrics or logging, no pipelining, no request bodies beyond one buffer. It is not a
server anyone should run: it answers one question, how close to nginx a Python proxy on this
engine path can get at all, and so how much of hotswap's distance to nginx is aiohttp's server
side and hotswap's own per-request work.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Optional

import httptools
from bare_proxy import cli  # bench/bare_proxy.py: the same command line

from router.proxy import Pool, Relay, UpstreamError, request_bytes

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


class Client(asyncio.Protocol):
    """One client connection: a request at a time, parsed by httptools, answered from the pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.writable: Optional[asyncio.Future[None]] = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.resume_writing()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    async def drain(self) -> None:
        if self.writable is not None:
            await self.writable

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, body = self.url.decode(), b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method().decode()
        self.transport.pause_reading()  # type: ignore[union-attr]
        asyncio.ensure_future(self.answer(method, path, body))

    async def answer(self, method: str, path: str, body: bytes) -> None:
        transport = self.transport
        assert transport is not None
        if method == "GET" and path == "/health":
            transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            transport.resume_reading()
            return
        try:
            exchange = await self.pool.request(request_bytes(method, path, self.pool, {}, "application/json", body))
        except UpstreamError:
            transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            transport.resume_reading()
            return
        try:
            if exchange.stream:
                transport.write(SSE_HEAD)
                relay = Relay(transport, chunked_out=True, chunked_in=exchange.chunked)
                await exchange.relay(relay, self.drain)
                relay.end()
            else:
                payload = await exchange.body()
                transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                                % (exchange.status, exchange.content_type.encode(), len(payload)) + payload)
        except UpstreamError:
            transport.abort()
            return
        finally:
            exchange.end()
        transport.resume_reading()


async def main(upstream: str, host: str, port: int) -> None:
    pool = Pool(upstream)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(pool), host, port, backlog=2048)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    pool.close()


if __name__ == "__main__":
    cli(main, __doc__.splitlines()[0])
