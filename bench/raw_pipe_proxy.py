"""A prototype, not a product: how cheap can a Python proxy pass a stream through?

`python bench/raw_pipe_proxy.py --upstream http://127.0.0.1:8001 --port 8002`

bench/bare_proxy.py (and hotswap) move every SSE chunk through aiohttp's client StreamReader
(feed_data -> future -> task wake-up -> iter_any) and its server StreamWriter (chunked
re-encoding, writelines). This prototype keeps aiohttp's server for the request side but
talks to the upstream over a raw asyncio Protocol with a keep-alive pool, and for a chunked
upstream body forwards the received bytes *as they are* (the upstream's chunk framing is
valid framing for the client too) from `data_received` straight into the client's
transport: no task wake-up, no future, no re-encoding per chunk. Only the upstream's
terminating `0\\r\\n\\r\\n` is held back, so that aiohttp writes its own at write_eof and keeps
the client connection's keep-alive state consistent.

Used by bench/peers.py as the target `raw` (opt-in) to measure what such a pipe would save
in hotswap's router/proxy.py. Limits of the prototype: HTTP/1.1 upstream with
Content-Length or chunked bodies only, no trailers, no write back-pressure towards the
upstream beyond pausing reads while the client transport is above its high-water mark.
"""

from __future__ import annotations

import asyncio
from typing import Optional
from urllib.parse import urlsplit

from aiohttp import web

from bare_proxy import cli, serve  # the same server scaffold and CLI as the bare proxy


class UpstreamError(Exception):
    pass


class Upstream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the upstream."""

    def __init__(self, pool: "Pool") -> None:
        self.pool = pool
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head = bytearray()
        self.in_head = True
        self.headers_fut: Optional[asyncio.Future] = None
        self.done_fut: Optional[asyncio.Future] = None
        self.status = 0
        self.ctype = b"application/json"
        self.chunked = False
        self.length = 0
        self.body = bytearray()
        self.sink: Optional[asyncio.Transport] = None
        self.pending = bytearray()  # body bytes received before the client side was ready
        self.left = 0  # bytes left in the current chunk, CRLF included
        self.partial = b""  # an incomplete chunk-size line
        self.tail = -1  # >= 0: after the last chunk, bytes of the final CRLF still to come

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        for fut in (self.headers_fut, self.done_fut):
            if fut is not None and not fut.done():
                fut.set_exception(UpstreamError(f"upstream closed: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        if self.in_head:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            rest = bytes(self.head[end + 4:])
            self._parse_head(bytes(self.head[:end]))
            self.in_head = False
            if self.headers_fut is not None and not self.headers_fut.done():
                self.headers_fut.set_result(None)
            if not rest:
                if not self.chunked and self.length == 0:
                    self._finish()
                return
            data = rest
        if self.chunked:
            if self.sink is None:
                self.pending += data
            else:
                self._chunked(data)
        else:
            self.body += data
            if len(self.body) >= self.length:
                self._finish()

    # -- parsing -----------------------------------------------------------------------------

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-type":
                self.ctype = value
            elif name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()

    def _chunked(self, data: bytes) -> None:
        if self.tail >= 0:  # the rest of the terminating CRLF after a split last chunk
            self.tail -= len(data)
            if self.tail <= 0:
                self._finish()
            return
        if self.partial:
            data, self.partial = self.partial + data, b""
        pos, start, n = 0, 0, len(data)
        sink = self.sink
        while pos < n:
            if self.left:
                take = n - pos if n - pos < self.left else self.left
                pos += take
                self.left -= take
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                self.partial = data[pos:]
                break
            size = int(data[pos:eol].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk: forward what came before it, keep its framing back
                if pos > start:
                    sink.write(data[start:pos])  # type: ignore[union-attr]
                need = eol + 4 - n  # "0\r\n" + "\r\n"
                if need > 0:
                    self.tail = need
                else:
                    self._finish()
                return
            self.left = size + 2
            pos = eol + 2
        end = n - len(self.partial)
        if end > start:
            sink.write(data if start == 0 and end == n else data[start:end])  # type: ignore[union-attr]
        if sink.get_write_buffer_size() > 256 * 1024:  # type: ignore[union-attr]
            self.transport.pause_reading()  # type: ignore[union-attr]
            asyncio.get_running_loop().create_task(self._resume_when_drained())

    async def _resume_when_drained(self) -> None:
        while self.sink is not None and self.sink.get_write_buffer_size() > 64 * 1024 and not self.sink.is_closing():
            await asyncio.sleep(0.001)
        if not self.closed:
            self.transport.resume_reading()  # type: ignore[union-attr]

    def _finish(self) -> None:
        fut = self.done_fut
        if fut is not None and not fut.done():
            fut.set_result(bytes(self.body))

    # -- what the handler calls --------------------------------------------------------------

    def send(self, request_head: bytes, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        self._reset()
        self.headers_fut = loop.create_future()
        self.done_fut = loop.create_future()
        self.transport.write(request_head + body)  # type: ignore[union-attr]

    def attach(self, sink: asyncio.Transport) -> None:
        self.sink = sink
        if self.pending:
            data, self.pending = bytes(self.pending), bytearray()
            self._chunked(data)


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Upstream] = []

    async def get(self) -> Upstream:
        while self.idle:
            up = self.idle.pop()
            if not up.closed:
                return up
        _, up = await asyncio.get_running_loop().create_connection(lambda: Upstream(self), self.host, self.port)
        return up

    def put(self, up: Upstream) -> None:
        if not up.closed:
            self.idle.append(up)

    def close(self) -> None:
        for up in self.idle:
            up.transport.close()  # type: ignore[union-attr]


async def proxy(request: web.Request) -> web.StreamResponse:
    app = request.app
    pool: Pool = app["pool"]
    body = await request.read()
    up = await pool.get()
    reusable = False
    try:
        up.send(b"POST " + request.path.encode() + app["head_tail"] + str(len(body)).encode() + b"\r\n\r\n", body)
        await up.headers_fut  # type: ignore[misc]
        if not up.chunked:
            payload = await up.done_fut  # type: ignore[misc]
            reusable = True
            return web.Response(status=up.status, body=payload, headers={"Content-Type": up.ctype.decode()})
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.ctype.decode(), "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        request.writer.send_headers()  # aiohttp would send them with the first write(); ours bypass it
        up.attach(request.transport)  # type: ignore[arg-type]
        await up.done_fut  # type: ignore[misc]
        reusable = True
        await resp.write_eof()
        return resp
    finally:
        if reusable:
            pool.put(up)
        else:  # cancelled (client gone) or failed: the upstream must not be reused mid-response
            up.transport.close()  # type: ignore[union-attr]


async def main(upstream: str, host: str, port: int) -> None:
    u = urlsplit(upstream)
    app = web.Application()
    app["pool"] = Pool(u.hostname or "127.0.0.1", u.port or 80)
    app["head_tail"] = (f" HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\nContent-Length: ").encode()
    async def close_pool(app: web.Application) -> None:
        app["pool"].close()

    app.on_cleanup.append(close_pool)
    await serve(app, proxy, host, port)


if __name__ == "__main__":
    cli(main, __doc__.splitlines()[0])
