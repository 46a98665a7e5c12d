"""The leases client requests hold on an AWAKE engine: how many are out, waiting for none, and
cutting those still running when a drain's deadline comes.

A lease is a count, not an object: the scheduler grants it (`Engine.try_lease`) and the request
gives it back (`Engine.release`). While a request uses it, the request says how to end it early
(`cuttable`); a drain that runs out of time cuts them all, stalled or not, so an engine is never
parked or restarted with a lease out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable, ContextManager, Optional

# Why a running request is cut: the proxy resumes it (router.proxy.resume) and counts it by this.
DRAIN_DEADLINE = "drain_deadline"  # its engine is parked or stopped for room, past swap.drain_timeout_s
RESTART = "restart"  # its engine restarts (an operator, the acceptance watch, a changed roster entry)
PREEMPTED = "preempted"  # batch work, cut at once for an interactive waiter
REMOVED = "removed"  # its model left the roster: nothing can resume it
CUT_GRACE_S = 5.0  # a cut request gives its lease back within a loop turn or two; not a limit it should meet
log = logging.getLogger("hotswap")


class Leases:
    def __init__(self, engine: str, tau_s: Callable[[], float]) -> None:
        self.engine = engine
        self._tau_s = tau_s  # swap.demand_tau_s, read at each change: a reload may change it
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._cuts: dict[object, Callable[[str, str], None]] = {}  # how to end each running request early
        # What each running request would cost to compute again if cut now (prompt + tokens so far), where it says:
        # the price of preempting its engine (router.scheduling.costs).
        self._sizes: dict[object, Callable[[], int]] = {}
        self._cutting: Optional[tuple[str, str]] = None  # why and its reason code, while they are being cut
        # Little's law: the mean time a lease is held is the leases' time held (the count integrated
        # over time) over the leases given back, both decaying as demand does (swap.demand_tau_s), so
        # the mean follows what the engine's requests are like now. No per-request clock.
        self._held_s = 0.0
        self._given_back = 0
        self._counted_at = time.monotonic()

    def take(self) -> None:
        self._count_time()
        self.count += 1
        self._idle.clear()

    def give_back(self) -> float:
        """Returns when (time.monotonic()), for the engine's own idle clock: one clock read a lease."""
        self._count_time()
        self.count -= 1
        self._given_back += 1
        if self.count == 0:
            self._idle.set()
        return self._counted_at

    def _count_time(self) -> None:
        now, tau = time.monotonic(), self._tau_s()
        keep = math.exp((self._counted_at - now) / tau)
        self._held_s = self._held_s * keep + self.count * tau * (1.0 - keep)  # the decayed integral of a constant count
        self._given_back *= keep
        self._counted_at = now

    @property
    def mean_held_s(self) -> Optional[float]:
        """The mean seconds a request has held its lease lately (None until one has been given back)."""
        return self._held_s / self._given_back if self._given_back else None

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no lease is held (True), or `timeout` (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def drain(self, timeout: float, reason: str = DRAIN_DEADLINE) -> bool:
        """Before a sleep or a stop: let the running requests finish for up to `timeout` (swap.drain_timeout_s),
        then cut the rest (a stream to a client that stopped reading would otherwise never end). True if all finished."""
        if await self.wait_idle(timeout):
            return True
        log.warning("engine %s: %d request(s) still running when the drain ran out (swap.drain_timeout_s=%g s): cutting them",
                    self.engine, self.count, timeout)
        await self.cut_all(f"model '{self.engine}' is being put to sleep or restarted and this request was still running "
                           f"when swap.drain_timeout_s={timeout:g} s ran out", reason)
        return False

    def cuttable(self, cut: Callable[[str, str], None], tokens: Optional[Callable[[], int]] = None) -> ContextManager[None]:
        """While a leaseholder's request runs: `cut(why, reason)` ends it early and makes it give its lease
        back. One that starts while the leases are being cut is cut at once. `tokens`: its prompt plus what it
        has generated so far, read only when a preemption is priced."""
        return _Cuttable(self, cut, tokens)

    @property
    def unresumable(self) -> int:
        """Running requests that said nothing of their size: a cut would lose them, so they are never preempted."""
        return len(self._cuts) - len(self._sizes)

    def tokens_in_flight(self) -> int:
        """The tokens a cut of every running request would have to compute again (those that say)."""
        return sum(size() for size in list(self._sizes.values()))

    async def preempt(self, why: str) -> None:
        """Cut every running request now, without the drain's grace: batch work yielding to an interactive
        waiter (the proxy pauses and resumes each one, router.proxy.resume)."""
        if self.count:
            log.info("engine %s: cutting %d request(s) at once, to be resumed (%s)", self.engine, self.count, why)
            await self.cut_all(why, PREEMPTED)

    async def cut_all(self, why: str, reason: str = DRAIN_DEADLINE) -> None:
        """Cut every request still running and wait (briefly) until their leases are back."""
        self._cutting = (why, reason)
        try:
            for cut in list(self._cuts.values()):
                cut(why, reason)
            if not await self.wait_idle(CUT_GRACE_S):
                log.warning("engine %s: %d lease(s) still held %g s after the cut (a holder that cannot be cut, such as "
                            "an admin LoRA load, ends at its own timeout); going on without them", self.engine, self.count,
                            CUT_GRACE_S)
        finally:
            self._cutting = None


class _Cuttable:
    """`Leases.cuttable`, as a class: entered on every proxied request, where a generator-based
    context manager costs several times as much."""

    __slots__ = ("leases", "cut", "tokens")

    def __init__(self, leases: Leases, cut: Callable[[str, str], None], tokens: Optional[Callable[[], int]]) -> None:
        self.leases, self.cut, self.tokens = leases, cut, tokens

    def __enter__(self) -> None:
        self.leases._cuts[self] = self.cut
        if self.tokens is not None:
            self.leases._sizes[self] = self.tokens
        if self.leases._cutting is not None:
            self.cut(*self.leases._cutting)

    def __exit__(self, *exc: object) -> None:
        del self.leases._cuts[self]
        if self.tokens is not None:
            del self.leases._sizes[self]
