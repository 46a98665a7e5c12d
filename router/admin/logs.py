"""GET /admin/logs/{model}: an engine's log file, its last lines (`?lines=N`, JSON) or followed live
(`?follow=1`, server-sent events: one `data:` event per line, the last N first, then each new one).

A log can be gigabytes: the tail is read backwards from the end in blocks, and a follower reads
only what was appended since its last look, at most FOLLOW_READ_BYTES at a time, in a thread so a
slow disk never stalls the event loop. The follower polls the file's size (no inotify), so it
also sees the file truncated or replaced (logrotate; an engine's own runs append to one file,
`engines.process`) and starts again from the new file's beginning.

A follower is a stream like any other: one whose client takes nothing of it for
`queue.stall_timeout_s` is cut (as `router.proxy.relay` cuts a stalled stream), and the router's
shutdown ends every follower at once, even one waiting for its client to read (before, a client
that stopped reading held a SIGTERM for two minutes: docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from router.admin.handlers import WholeNumber, parse_query
from router.errors import APIError, json_answer
from router.live import ROUTED_MODEL, ROUTER_KEY

log = logging.getLogger("hotswap")

DEFAULT_LINES = 100
MAX_LINES = 10_000
MAX_LINE_CHARS = 8 * 1024  # a longer line is delivered in pieces of this many characters, one per line
TAIL_MAX_BYTES = 8 * 1024 * 1024  # the tail never reads more than this far back, whatever N
BLOCK = 64 * 1024
FOLLOW_READ_BYTES = 1024 * 1024  # the most a follower reads per look; the rest comes at the next
POLL_S = 0.25
HEARTBEAT_S = 15  # an SSE comment when nothing was written for this long, so proxies keep the connection
STALL_POLL_S = 1.0  # how often a follower waiting for its client looks for progress; not a limit

# A line ends at \n, \r\n or a lone \r (progress bars redraw with \r; SSE also ends a data line at \r).
# A \r at the very end of what was read may be the first half of a \r\n: it waits for the next read.
_EOL = re.compile(rb"\r\n|\r(?!\Z)|\n")


class LogFollowers:
    """Followers end when the router shuts down (aiohttp's on_shutdown), not at its 60 s shutdown timeout."""

    def __init__(self) -> None:
        self.closing = asyncio.Event()

    async def close(self, app: web.Application) -> None:
        self.closing.set()


FOLLOWERS_KEY = web.AppKey("log_followers", LogFollowers)


class LogQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lines: WholeNumber = Field(DEFAULT_LINES, ge=0, le=MAX_LINES, description=f"the last N lines first, a whole number "
                               f"from 0 to {MAX_LINES} (default {DEFAULT_LINES})")
    follow: Literal["0", "1", "true", "false"] = Field("0", description="1 (or true): then each new line as it is written")


async def engine_log(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    engine = router.lookup(request.match_info["model"])
    request[ROUTED_MODEL] = engine.name
    query = parse_query(LogQuery, request.query)
    lines = query.lines
    path = engine.log_path
    if path is None:
        raise APIError(404, f"{engine.name} is attached (url: {engine.spec.shown_url}): the router starts no process for it and "
                            "has no log of it; read it where the process that runs it writes it.", "no_engine_log")
    if query.follow in ("1", "true"):
        return await _follow(request, engine.name, path, lines, request.app[FOLLOWERS_KEY].closing,
                             router.roster.queue.stall_timeout_s)
    tail = await asyncio.to_thread(read_tail, path, lines)
    shown = (tail.lines + tail.partial)[-lines:] if lines else []  # the line still being written counts as one
    return json_answer({"model": engine.name, "log_file": str(path), "lines": shown})


@dataclass(frozen=True)
class Tail:
    lines: list[str]  # the last N complete lines
    partial: list[str]  # the line being written (no end of line yet), if any
    end: int  # the offset read up to
    identity: Optional[tuple[int, int]]  # (device, inode) of the file read; None while it does not exist
    rest: bytes  # the bytes of `partial`, which a follower completes with what comes next


def read_tail(path: Path, n: int) -> Tail:
    """The last `n` lines of `path`, read backwards from its end (at most TAIL_MAX_BYTES)."""
    try:
        with path.open("rb") as f:
            info = os.fstat(f.fileno())
            end = start = info.st_size
            blocks: list[bytes] = []
            ends = 0  # line ends read so far (each block counted once: the scan stays linear)
            while start > 0 and ends <= n and end - start < TAIL_MAX_BYTES:
                step = min(BLOCK, start)
                start -= step
                f.seek(start)
                blocks.append(f.read(step))
                ends += len(_EOL.findall(blocks[-1]))
            data = b"".join(reversed(blocks))
    except FileNotFoundError:
        return Tail([], [], 0, None, b"")
    pieces = _EOL.split(data)
    rest = pieces.pop()
    if start > 0 and pieces:
        pieces = pieces[1:]  # read from the middle of a line
    lines = [line for piece in pieces for line in _decoded(piece)]
    partial = _decoded(rest.rstrip(b"\r")) if rest else []
    return Tail(lines[-n:] if n else [], partial, end, (info.st_dev, info.st_ino), rest)


def _decoded(piece: bytes) -> list[str]:
    """One line as text (bytes that are not UTF-8 replaced), cut into pieces of MAX_LINE_CHARS."""
    text = piece.decode("utf-8", "replace")
    return [text[i:i + MAX_LINE_CHARS] for i in range(0, len(text), MAX_LINE_CHARS)] or [""]


def _read_from(path: Path, position: int, identity: Optional[tuple[int, int]]) -> tuple[bytes, int, Optional[tuple[int, int]], bool]:
    """What was appended to `path` since `position`: (bytes, new position, identity, started over)."""
    try:
        with path.open("rb") as f:
            info = os.fstat(f.fileno())
            now = (info.st_dev, info.st_ino)
            restarted = now != identity or info.st_size < position
            if restarted:
                position = 0
            f.seek(position)
            data = f.read(min(FOLLOW_READ_BYTES, info.st_size - position))
    except FileNotFoundError:
        return b"", 0, None, identity is not None
    return data, position + len(data), now, restarted


class FollowerEnded(ConnectionError):
    """The follower's client took nothing for queue.stall_timeout_s, or the router is shutting down."""


async def _send(request: web.Request, response: web.StreamResponse, chunk: bytes, closing: asyncio.Event,
                stall_s: float) -> None:
    """`response.write(chunk)`, which waits while the client's socket is full; but a client that takes
    nothing for `stall_s`, or the router's shutdown, cuts the connection instead of waiting on."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the follower's client is gone")
    loop = asyncio.get_running_loop()
    writing = asyncio.ensure_future(response.write(chunk))
    writing.add_done_callback(_observed)
    ending = asyncio.ensure_future(closing.wait())
    try:
        held, since = transport.get_write_buffer_size(), loop.time()
        while True:
            done, _ = await asyncio.wait({writing, ending}, timeout=min(STALL_POLL_S, stall_s / 4),
                                         return_when=asyncio.FIRST_COMPLETED)
            if writing in done:
                return writing.result()
            if ending in done:
                transport.abort()
                raise FollowerEnded("the router is shutting down")
            now, left = loop.time(), transport.get_write_buffer_size()
            if left < held:  # the client took some: its stall clock starts again
                held, since = left, now
            elif now - since >= stall_s:
                transport.abort()
                raise FollowerEnded(f"the client took nothing of the log for queue.stall_timeout_s={stall_s:g} s")
    finally:
        ending.cancel()


def _observed(task: "asyncio.Future[None]") -> None:
    if not task.cancelled():
        task.exception()  # the connection was cut under it: handled where the follower stopped


async def _follow(request: web.Request, name: str, path: Path, n: int, closing: asyncio.Event,
                  stall_s: float) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})  # nginx: pass each event on at once
    tail = await asyncio.to_thread(read_tail, path, n)  # before the answer starts: a line written once it has is new
    await response.prepare(request)
    position, identity, pending = tail.end, tail.identity, tail.rest
    written = time.monotonic()
    try:
        await _send(request, response, _events(tail.lines), closing, stall_s)
        while not closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), POLL_S)
                break
            data, position, identity, restarted = await asyncio.to_thread(_read_from, path, position, identity)
            chunk = b""
            if restarted:
                pending = b""
                chunk += b": the log file was truncated or replaced; following it from its start\n\n"
            pieces = _EOL.split(pending + data)
            pending = pieces.pop()
            if len(pending) > MAX_LINE_CHARS * 4:  # a line with no end in sight: deliver what there is
                pieces.append(pending)
                pending = b""
            chunk += _events([line for piece in pieces for line in _decoded(piece)])
            if not chunk and time.monotonic() - written >= HEARTBEAT_S:
                chunk = b": keep-alive\n\n"
            if chunk:
                await _send(request, response, chunk, closing, stall_s)
                written = time.monotonic()
    except FollowerEnded as exc:
        log.warning("cut a follower of %s's log from %s: %s", name, request.remote, exc)
    except ConnectionError:
        pass  # the client left
    return response


def _events(lines: list[str]) -> bytes:
    # `lines` hold no \r or \n (split above), so each is one SSE data line.
    return "".join(f"data: {line}\n\n" for line in lines).encode()
