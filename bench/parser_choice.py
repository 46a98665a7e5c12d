"""Which HTTP/1.1 response parser for router/proxy/exchange.py: CPU per 64-chunk SSE stream and per
non-stream answer, each parser fed the bytes the way they arrive from an engine (one recv per
event), with the work the relay needs done in its callbacks (body bytes collected).

`python bench/parser_choice.py` prints µs per stream / per answer for httptools, aiohttp's C
HttpResponseParser and h11 (each best of 5 runs).
"""

from __future__ import annotations

import asyncio
import time

import h11
import httptools
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import HttpResponseParser

HEAD = (b"HTTP/1.1 200 OK\r\ndate: Sun, 30 Nov 2026 10:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
         b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
STREAM = [HEAD] + [b"%x\r\n%s\r\n" % (len(EVENT), EVENT)] * 64 + [b"e\r\ndata: [DONE]\n\n\r\n", b"0\r\n\r\n"]
BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"' + b"x" * 300 + b'"}]}'
PLAIN = [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)]


class Sink:
    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.done = False
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True


def run_httptools(feeds: list[bytes]) -> None:
    sink = Sink()
    parser = httptools.HttpResponseParser(sink)
    for data in feeds:
        parser.feed_data(data)
    assert sink.done


def run_h11(feeds: list[bytes]) -> None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/v1/completions", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    body = []
    for data in feeds:
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                break
            if isinstance(event, h11.Data):
                body.append(event.data)
            if isinstance(event, h11.EndOfMessage):
                return
    raise AssertionError("incomplete")


def make_aiohttp(loop: asyncio.AbstractEventLoop):
    protocol = BaseProtocol(loop)

    def run(feeds: list[bytes]) -> None:
        parser = HttpResponseParser(protocol, loop, 2 ** 16, read_until_eof=False)
        body = []
        payload = None
        for data in feeds:
            messages, _, _ = parser.feed_data(data)
            for _, p in messages:
                payload = p
            if payload is not None:
                while payload._buffer:
                    body.append(payload._buffer.popleft())
        assert payload is not None and payload.is_eof()

    return run


def best_us(fn, feeds: list[bytes], n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(feeds)
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


async def main() -> None:
    parsers = {"httptools": run_httptools, "aiohttp C": make_aiohttp(asyncio.get_running_loop()), "h11": run_h11}
    print(f"{'parser':<10} {'64-chunk stream µs':>20} {'non-stream µs':>15}")
    for name, fn in parsers.items():
        print(f"{name:<10} {best_us(fn, STREAM, 300):>20.1f} {best_us(fn, PLAIN, 3000):>15.1f}")


if __name__ == "__main__":
    asyncio.run(main())
