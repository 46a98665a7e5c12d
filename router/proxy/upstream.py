"""The engines' connections: one pool of keep-alive connections per engine URL (the exchanges on
them are `router.proxy.exchange`'s).

Pools are keyed by the engine's base URL and made on first use, so engines that appear at run
time get one, and `Upstreams.close(url)` drops the pool of one that went away.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import Optional
from urllib.parse import urlsplit

from router.proxy.exchange import READ_TIMEOUT_S, Connection, Exchange, Unreachable, UpstreamError

CONNECT_TIMEOUT_S = 10.0
# vLLM (uvicorn) closes a connection idle for 5 s (`--timeout-keep-alive`, VLLM_HTTP_TIMEOUT_KEEP_ALIVE);
# a pooled one idle this long is retired instead of reused, so the engine's idle close and our
# reuse rarely race. When they do, the request fails (a 502) rather than being sent twice: from
# a connection closed after the write, nothing tells an idle close from an engine that read
# the request, began it and died.
IDLE_S = 4.0
MAX_IDLE = 256  # connections kept per engine beyond this are closed as they come back
# Connections being opened to one engine at a time; the rest wait in line for one (Pool._get).
# An engine's listen backlog (aiohttp's default 128, uvicorn's 2048) bounds its half-open and
# not-yet-accepted connections; past it, Linux answers a SYN with a cookie, the connect succeeds,
# the request is written, and the engine's kernel drops it: it sits in TCP retransmission for
# seconds to minutes, then is answered late, cut by a reset, or timed out. Below any sane
# backlog, a handshake the engine's full accept queue refuses holds its turn (the kernel
# retries the SYN) instead of turning into a request nobody reads.
CONNECTS_AT_ONCE = 16


class Pool:
    """Keep-alive connections to one engine. Requests that find none idle wait in line, and each
    connection that comes free (opened, or given back by a finished answer) goes to the first in
    line: a newcomer never takes a connection ahead of a request that was already waiting."""

    def __init__(self, base_url: str, read_timeout: float = READ_TIMEOUT_S, tls: Optional[ssl.SSLContext] = None) -> None:
        url = urlsplit(base_url)
        # https: TLS on every connection, verified as the engine's control client verifies it (the
        # same context: engines.vllm.client.tls_context); the system store when none is given.
        self.tls = (tls or ssl.create_default_context()) if url.scheme == "https" else None
        self.host, self.port = url.hostname or "127.0.0.1", url.port or (443 if self.tls else 80)
        self.netloc = url.netloc  # the Host header
        self.prefix = url.path.rstrip("/")  # `https://host/team-a`: every path goes under /team-a
        self.read_timeout = read_timeout
        self.idle: list[Connection] = []
        self._line: collections.deque[asyncio.Future[Connection]] = collections.deque()
        self._connecting = asyncio.Semaphore(CONNECTS_AT_ONCE)
        self._openers: set[asyncio.Task[None]] = set()

    async def request(self, data: bytes) -> Exchange:
        """Send a request and wait for its answer's head. Once more, on a new connection, only
        when the request provably never reached the engine: its connection was seen closed
        before the write. Never once it was written, whatever happened next: the engine may
        have read it and begun a generation, which must not run twice. (A connect that fails
        raises `Unreachable`; nothing was sent, and nothing is tried again.)"""
        for fresh in (False, True):
            conn = await (self._open_in_turn() if fresh else self._get())
            exchange = Exchange(conn, self.read_timeout)
            exchange.send(data)
            try:
                await exchange.head()
                return exchange
            except UpstreamError:
                exchange.end()
                if not exchange.unsent or fresh:
                    raise
            except BaseException:  # cancelled (the client went away): cut the connection, so vLLM aborts
                exchange.end()
                raise
        raise AssertionError("unreachable")

    async def _get(self) -> Connection:
        """An idle connection, or a place in line and a connection opened for the line.
        Under a burst, connections come back faster than new ones open (CONNECTS_AT_ONCE), and
        without the line the requests arriving later would take them all, leaving the early ones
        to wait for a connect turn: seconds of p99 at 1,000 concurrent streams."""
        self._prune()
        if not self._line:
            conn = self._take()
            if conn is not None:
                return conn
        turn: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        opener = asyncio.create_task(self._open_for_line())
        self._openers.add(opener)
        opener.add_done_callback(self._openers.discard)
        try:
            # The wait in line counts: behind an engine that black-holes connects, a request
            # gets a clean 502 in CONNECT_TIMEOUT_S, not after every connect ahead of it timed out.
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                return await turn
        except TimeoutError:
            raise Unreachable(f"no connection within {CONNECT_TIMEOUT_S:g} s") from None
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.put(turn.result())  # handed over just as this request was cancelled: the next one takes it
            raise

    async def _open_for_line(self) -> None:
        """Open one connection, in turn, for whoever is first in line when it is ready; none if
        the line was served meanwhile by connections given back."""
        async with self._connecting:
            self._prune()
            if not self._line:
                return
            try:
                conn = await self._open()
            except UpstreamError as exc:
                self._prune()
                if self._line:
                    self._line.popleft().set_exception(exc)
                return
        if not self._hand(conn):
            self.put(conn)

    async def _open_in_turn(self) -> Connection:
        """A new connection for this request alone (its retry), opened in turn."""
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                async with self._connecting:
                    return await self._open()
        except TimeoutError:
            raise Unreachable(f"no connection within {CONNECT_TIMEOUT_S:g} s") from None

    async def _open(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self.tls,
                    server_hostname=self.host if self.tls else None, ssl_handshake_timeout=CONNECT_TIMEOUT_S if self.tls else None)
        except TimeoutError:
            raise Unreachable(f"no connection within {CONNECT_TIMEOUT_S:g} s") from None
        except ssl.SSLError as exc:  # before OSError, its base: say it is the TLS handshake
            why = ": ".join(filter(None, [exc.reason, getattr(exc, "verify_message", None)])) or str(exc)
            raise Unreachable(f"TLS with {self.netloc} failed: {why}") from None
        except OSError as exc:
            raise Unreachable(exc.strerror or str(exc)) from None
        return conn

    def _take(self) -> Optional[Connection]:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to be closed by now
            if conn.closed:
                continue
            if now - conn.idle_since < IDLE_S:
                return conn
            # Too close to the engine's idle close to trust, and so is every one below it (older): retired.
            for old in (conn, *self.idle):
                old.abort()
            self.idle.clear()
        return None

    def _prune(self) -> None:
        """Forget the places in line whose requests stopped waiting (timed out, cancelled)."""
        while self._line and self._line[0].done():
            self._line.popleft()

    def _hand(self, conn: Connection) -> bool:
        """Give `conn` to the first request in line, if any."""
        self._prune()
        if not self._line:
            return False
        self._line.popleft().set_result(conn)
        return True

    def put(self, conn: Connection) -> None:
        """A connection free again: to the first in line, else idle."""
        if self._hand(conn):
            return
        if len(self.idle) >= MAX_IDLE:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def discard(self, conn: Connection) -> None:
        """An idle connection the engine closed: forget it now, not at the next request (there may be none)."""
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for opener in list(self._openers):
            opener.cancel()
        for turn in self._line:
            if not turn.done():
                turn.set_exception(Unreachable("the engine was stopped"))
        self._line.clear()
        for conn in list(self.idle):
            conn.abort()
        self.idle.clear()


class Upstreams:
    """The pools, one per engine URL, made on first use."""

    def __init__(self, read_timeout: float = READ_TIMEOUT_S) -> None:
        self.read_timeout = read_timeout
        self._pools: dict[str, Pool] = {}

    def pool(self, base_url: str, tls: Optional[ssl.SSLContext] = None) -> Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = Pool(base_url, self.read_timeout, tls)
        return pool

    def close(self, base_url: str) -> None:
        pool = self._pools.pop(base_url, None)
        if pool is not None:
            pool.close()

    def close_all(self) -> None:
        for url in list(self._pools):
            self.close(url)


def request_bytes(method: str, path: str, pool: Pool, headers: dict[str, str], content_type: Optional[str],
                  body: bytes) -> bytes:
    lines = [f"{method} {pool.prefix}{path} HTTP/1.1", f"Host: {pool.netloc}"]
    # The client's Authorization is never forwarded; the engine gets its own key, if it has one.
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
