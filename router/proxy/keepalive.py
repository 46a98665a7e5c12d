"""`queue.stream_keepalive_s`: while a streaming request waits for a swap, send SSE comment
lines (`: waking chat-8b (reload_weights)`) so that proxies and UIs do not time out and a
person can see why they wait. SSE clients ignore comment lines.

Once the headers are out, the status is 200 whatever happens next: a failure after that
(the swap failed, the queue deadline passed, the engine refused the request) travels as
the stream's error event, in the route's shape.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from aiohttp import web

from config.sections import INTERACTIVE
from engines.engine import Engine, State
from router.errors import APIError, sse_error
from router.proxy.forward import SSE_HEADERS
from router.proxy.resume import Paused
from router.scheduling import Lease

# A paused answer whose engine fails while the answer waits for it is refused with its waiters (code ENGINE_FAILED:
# a park or a restart found the engine dead, or it is in its backoff); it waits for the engine's restart instead, at
# most this many times. Its pauses count against resume.MAX_FAILURES only when its engine died under it.
FAILED_WAITS = 3
ENGINE_FAILED_CODE = "engine_failed"


class AnsweredInStream(Exception):
    """The request failed after its stream's headers were sent; the error is in the stream."""

    def __init__(self, response: web.StreamResponse, status: int, wait: Optional[Lease] = None):
        super().__init__(status)
        self.response = response
        self.status = status
        self.wait = wait  # a refused wait's parts (APIError.wait)


def doing(engine: Engine) -> str:
    """What the engine is doing, in a few words, for the comment line (never the client's input)."""
    state = engine.state
    if state is State.WAKING:
        steps = engine.wake_phases(1 if engine.sleep_level is None else engine.sleep_level)
        step = next((p for p in steps if p not in engine.last_phases), "gate")
        return f"waking {engine.name} ({step})"
    if state is State.VERIFYING:
        return f"waking {engine.name} (gate)"
    if state is State.BOOTING:
        return f"starting {engine.name} (boot)"
    if state is State.SLEEPING:
        return f"waiting for {engine.name} (asleep, swap queued)"
    return f"waiting for {engine.name} ({state.value})"


async def acquire(request: web.Request, scheduler, engine: Engine, interval: float, anthropic: bool,
                  max_wait_s: Optional[float] = None, klass: str = INTERACTIVE,
                  response: Optional[web.StreamResponse] = None, keep_open: bool = False
                  ) -> tuple[Optional[web.StreamResponse], Lease]:
    """Take a lease like `scheduler.acquire`, sending comment lines every `interval` seconds
    while it waits. Returns the already-prepared stream response, or None when the lease came
    before the first comment was due (nothing sent: the request proceeds as usual), and the lease.
    `response`: the stream already begun (a paused answer's), where the comments go. `keep_open`: a
    refusal is raised as the APIError and the stream left open (its caller waits again)."""
    lease = scheduler.lease_at_once(engine, klass)  # in this turn of the loop: the waiting task would take it in the next
    if lease is not None:
        return response, lease
    task = asyncio.ensure_future(scheduler.acquire(engine, max_wait_s=max_wait_s, klass=klass))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                break
            if response is None:
                response = web.StreamResponse(status=200, headers=SSE_HEADERS)
                await response.prepare(request)
            await response.write(f": {doing(engine)}\n\n".encode())
    except BaseException:  # the client went away (or a write failed): give up the wait, or the lease it won
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            scheduler.release(engine, klass)
        raise
    if response is None:
        return None, task.result()  # raises the APIError as usual: the route's normal error answer
    try:
        lease = task.result()
    except APIError as exc:
        if keep_open:
            raise
        await response.write(sse_error(exc.message, exc.code, status=exc.status, anthropic=anthropic))
        await response.write_eof()
        raise AnsweredInStream(response, exc.status, exc.wait) from None
    return response, lease


def seam_comment(paused: Paused, engine: Engine) -> bytes:
    """The comment line a paused stream gets at once (SSE clients ignore comments; a person reading the raw stream sees why)."""
    return f": paused ({paused.reason}); resumes once {engine.name} serves again\n\n".encode()


def migrating_comment(paused: Paused) -> bytes:
    return f": paused ({paused.reason}); resumes on a peer node where the model is awake\n\n".encode()


async def wait_again(request: web.Request, scheduler, engine: Engine, paused: Paused, interval: float, anthropic: bool,
                     klass: str, max_wait_s: Optional[float]):
    """The lease again, for the rest of the answer. A stream waits with comment lines on its open response.
    Refused because its engine failed while it waited (`FAILED_WAITS`), it waits for the restart: the scheduler
    restarts a failed engine for its next waiter, after the backoff the refusal's retry_after gives."""
    response = paused.response
    for left in range(FAILED_WAITS, 0, -1):
        try:
            if response is None:
                return None, await scheduler.acquire(engine, max_wait_s=max_wait_s, klass=klass)
            await response.write(seam_comment(paused, engine))
            return await acquire(request, scheduler, engine, interval, anthropic, max_wait_s=max_wait_s, klass=klass,
                                 response=response, keep_open=True)
        except APIError as exc:
            if exc.code != ENGINE_FAILED_CODE or left == 1:
                if response is not None:  # the last refusal: the stream ends with it, here only
                    await response.write(sse_error(exc.message, exc.code, status=exc.status, anthropic=anthropic))
                    await response.write_eof()
                    raise AnsweredInStream(response, exc.status) from None
                raise
            await asyncio.sleep(min(exc.retry_after or 0.0, interval))  # the backoff, not a readiness wait
    raise AssertionError("unreachable")
