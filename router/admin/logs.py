"""GET /admin/logs/{model}: an engine's log file, its last lines (`?lines=N`, JSON) or followed live
(`?follow=1`, server-sent events: one `data:` event per line, the last N first, then each new one).

A log can be gigabytes: the tail is read backwards from the end in blocks, and a follower reads
only what was appended since its last look, at most FOLLOW_READ_BYTES at a time, in a thread so a
slow disk never stalls the event loop. The follower polls the file's size (no inotify), so it
also sees the file truncated or replaced (logrotate; an engine's own runs append to one file,
`engines.process`) and starts again from the new file's beginning.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aiohttp import web

from router.errors import APIError
from router.live import ROUTED_MODEL, ROUTER_KEY

DEFAULT_LINES = 100
MAX_LINES = 10_000
MAX_LINE_CHARS = 8 * 1024  # a longer line is delivered in pieces of this many characters, one per line
TAIL_MAX_BYTES = 8 * 1024 * 1024  # the tail never reads more than this far back, whatever N
BLOCK = 64 * 1024
FOLLOW_READ_BYTES = 1024 * 1024  # the most a follower reads per look; the rest comes at the next
POLL_S = 0.25
HEARTBEAT_S = 15  # an SSE comment when nothing was written for this long, so proxies keep the connection

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


async def engine_log(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    engine = router.lookup(request.match_info["model"])
    request[ROUTED_MODEL] = engine.name
    lines = _lines_wanted(request.query.get("lines"))
    follow = request.query.get("follow", "0")
    if follow not in ("0", "1", "true", "false"):
        raise APIError(400, f"follow must be 1 or 0 (found {follow[:20]!r})", "invalid_follow", param="follow")
    path = engine.log_path
    if path is None:
        raise APIError(404, f"{engine.name} is attached (url: {engine.spec.shown_url}): the router starts no process for it and "
                            "has no log of it; read it where the process that runs it writes it.", "no_engine_log")
    if follow in ("1", "true"):
        return await _follow(request, path, lines, request.app[FOLLOWERS_KEY].closing)
    tail = await asyncio.to_thread(read_tail, path, lines)
    shown = (tail.lines + tail.partial)[-lines:] if lines else []  # the line still being written counts as one
    return web.json_response({"model": engine.name, "log_file": str(path), "lines": shown})


def _lines_wanted(text: Optional[str]) -> int:
    if text is None:
        return DEFAULT_LINES
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_LINES:
        raise APIError(400, f"lines must be a whole number from 0 to {MAX_LINES} (found {text[:20]!r})", "invalid_lines",
                       param="lines")
    return n


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


async def _follow(request: web.Request, path: Path, n: int, closing: asyncio.Event) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})  # nginx: pass each event on at once
    tail = await asyncio.to_thread(read_tail, path, n)  # before the answer starts: a line written once it has is new
    await response.prepare(request)
    position, identity, pending = tail.end, tail.identity, tail.rest
    written = time.monotonic()
    with contextlib.suppress(ConnectionError):
        await response.write(_events(tail.lines))
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
                await response.write(chunk)
                written = time.monotonic()
    return response


def _events(lines: list[str]) -> bytes:
    # `lines` hold no \r or \n (split above), so each is one SSE data line.
    return "".join(f"data: {line}\n\n" for line in lines).encode()
