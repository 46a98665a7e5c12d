"""The scheduler's state, its vocabulary (waiters, decisions, plans), and the leases requests
wait for: what every part of `Scheduler` reads and writes.

`Scheduler` is this plus its parts, each a class of its own module that builds on this one:
`Costs` (what moving an engine costs), `RosterChanges` (engines joining, leaving, restarting
from a reload), `Actions` (what is started: boot, wake, park, ...), and the policy and loop in
`scheduler.py`. A part calls only what it or a part below it defines.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from config.schema import ModelSpec, Queue, Swap
from config.sections import BATCH, INTERACTIVE
from engines.engine import Engine, State
from router.errors import APIError, for_clients
from router.scheduling.estimates import Demand, WakeCosts
from router.scheduling.history import Events, SwapRecord, WaitParts
from router.scheduling.placement import Capacity, Ledger

# More likely than not: a chance of one arrival or more above 1/2 is an expected count above ln 2.
LIKELY = math.log(2)
# States an engine is only in while an action drives it.
MID_TRANSITION = frozenset({State.BOOTING, State.DRAINING, State.WAKING, State.VERIFYING})
# Actions that need the engine's full share while they run (a restart passes through COLD:
# its memory must not be handed to another engine in that moment).
RESERVING = frozenset({"boot", "wake", "demote", "restart"})
# Actions whose engine is (or becomes) BOOTING when it starts COLD or FAILED; a restart always is.
BOOTING_ACTIONS = frozenset({"boot", "wake", "restart"})


@dataclass
class Waiter:
    engine: Engine
    since: float
    # None: an operator's (admin) wait, served like an interactive request but no one's demand.
    klass: Optional[str] = INTERACTIVE
    # Its result: the id of the swap whose end granted its lease (None: no swap did).
    future: asyncio.Future[Optional[int]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(frozen=True)
class Lease:
    """How a request came by its lease: at once (its engine was awake), or after waiting, for
    swap `swap_id` (SwapRecord.id) when a wake granted it; or, `refused`, how it waited for none
    (a timeout, its engine's failure: APIError.wait)."""

    found_awake: bool
    swap_id: Optional[int] = None
    swap_s: Optional[float] = None  # a wait's parts (history.WaitParts): its swap, what held it (`reason=s,...`), their sum
    held: Optional[str] = None
    held_s: Optional[float] = None
    refused: bool = False


AT_ONCE = Lease(found_awake=True)


@dataclass(frozen=True)
class Decision:
    """One action to start now: boot, wake, park, deepen (a KV-parked engine down a rung), stop, demote,
    restart, retire, respec, failed."""

    action: str
    engine: Engine
    why: str = ""
    level: Optional[int] = None  # park, deepen: the sleep level chosen (0: KV-parked)
    after: tuple[str, ...] = ()  # park: the engines whose demotion or stop, decided with it, frees its host RAM
    preempt: bool = False  # park, stop: its streams (batch work only) are cut at once for a user's waiter, not drained


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...] = ()
    wait_s: Optional[float] = None  # nothing to start: look again after this long (None: when poked)


class SchedulerState:
    def __init__(self, engines: list[Engine], swap: Swap, limits: Queue, capacity: Capacity,
                 weights: Optional[dict[str, Optional[float]]] = None, observer: Optional[Events] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engines = engines
        self.swap = swap
        self.limits = limits
        self.capacity = capacity
        self.weights = weights or {}
        self.events = observer or Events()
        self.clock = clock
        self.waiting: dict[str, collections.deque[Waiter]] = {e.name: collections.deque() for e in engines}
        self.backoff = Backoff([e.name for e in engines], clock)
        self.costs = WakeCosts(self.weights)
        self.demand = Demand(swap.demand_tau_s)
        self.user_demand = Demand(swap.demand_tau_s)  # interactive arrivals alone: what a batch wake must not take room from
        self.busy: dict[str, asyncio.Future[None]] = {}  # engine -> done when its action ends
        self.doing: dict[str, tuple[str, float, float]] = {}  # engine -> (action, started, predicted seconds)
        self.parking_level: dict[str, int] = {}  # engine being parked -> the level it goes to
        self.making_room: dict[str, tuple[list[str], float]] = {}  # target -> (victims being moved, since)
        self.handled: set[str] = set()  # FAILED engines whose failure has been counted and stopped
        self.staged_for: dict[str, float] = {}  # target -> the making_room it was staged for (staging.py: once each)
        self.stage_began: dict[str, float] = {}  # engine -> when its running stage began (self.clock)
        self.pending_restart: dict[str, str] = {}  # engine -> reason, for its next wake
        self.residuals: dict[str, dict[int, float]] = {}  # measured per engine and device, GB
        self.put_to_sleep: set[str] = set()  # slept by an operator (admin sleep), until a request asks for it
        self.ahead: dict[str, Any] = {}  # engine -> its pre-wake (router.scheduling.ahead.WokenAhead), until its outcome
        self.ahead_done: list[Any] = []  # the last pre-wakes with their outcomes, newest last
        self.quiet_since: dict[str, float] = {}  # engine -> last woken ahead or idle-parked (ahead.py: once per quiet period)
        self.defect: Optional[dict[str, Any]] = None  # the loop's last internal error (scheduler.py _run), for /admin/status
        self.host_why: dict[str, Optional[str]] = {}  # engine -> why its last park was not at Level 1 (numbers)
        self.to_boot: set[str] = set()  # new in a reload (or restarted from a changed entry): boot in the background
        self.startup: set[str] = set()  # not booted yet since the router started (first boots are not swaps)
        self.startup_total = 0
        self.boots_begun = 0
        self.boots: set[str] = set()  # engines whose running action boots them: their devices are theirs alone
        self.pending_spec: dict[str, ModelSpec] = {}  # engine -> its changed roster entry, applied at its next idle moment
        self.booted = False
        self.boot_done = asyncio.Event()
        self.interactive_leases: collections.Counter[str] = collections.Counter()  # engine -> interactive in flight
        self.interactive_seen: dict[str, float] = {}  # engine -> when an interactive request last arrived or ended
        self.batch_leases: collections.Counter[str] = collections.Counter()  # engine -> batch in flight (preemptible)
        self.held_by: dict[str, str] = {}  # batch-only target -> whose interactive demand keeps its room (for its 503)
        self.wait_parts = WaitParts()  # why waiters wait, recorded only (costs.py `note_wait`); never read by a decision
        self.history: collections.deque[SwapRecord] = collections.deque(maxlen=20)
        self.swap_ids = itertools.count(1)
        self._poke = asyncio.Event()
        self._closing = False  # shutting down: no new requests; the queued ones are still served
        self._stopping = False
        self._task: Optional[asyncio.Task[None]] = None
        self._actions: set[asyncio.Task[Any]] = set()  # the actions started, the admin ones included

    # -- what handlers call ----------------------------------------------------------------

    async def acquire(self, engine: Engine, *, max_wait_s: Optional[float] = None, admin: bool = False,
                      klass: str = INTERACTIVE) -> Lease:
        """Return with a lease on `engine` (AWAKE, promoted), and how it came, or raise an APIError.

        `max_wait_s`: the client's own limit (X-Hotswap-Max-Wait); a predicted wait beyond it is
        refused at once. `admin`: an operator's swap, which neither backs off nor counts as demand.
        `klass`: the request's class; a batch one waits up to queue.batch_max_wait_s, after the
        interactive ones, and never takes room from an engine with interactive demand (`_make_room`).
        Give the lease back with `release(engine, klass)` (admin: `release(engine)`)."""
        counted: Optional[str] = None if admin else klass
        if self._closing:
            raise APIError(503, "the router is shutting down; retry on another instance", "shutting_down", retry_after=5)
        now = self.clock()
        if not admin:
            if (lease := self.lease_at_once(engine, klass)) is not None:
                return lease
            self._arrived(engine, klass, now)
        elif engine.name not in self.busy and engine.try_lease():
            return AT_ONCE
        if not admin and self.backoff.waiting(engine, now):
            raise self.backoff.unavailable(engine)
        predicted = self.predicted_wait(engine, now)
        if max_wait_s is not None and predicted > max_wait_s:
            raise APIError(503, f"model '{engine.name}' is {engine.state.value}; its predicted wait of {predicted:.1f} s "
                           f"exceeds X-Hotswap-Max-Wait: {max_wait_s:g}", "model_not_ready", retry_after=predicted)
        queue = self.waiting[engine.name]
        # Each class has its own max_waiting: a batch flood that fills the queue must not turn users away.
        mine = self.queued_by_class(engine)[BATCH if klass == BATCH else INTERACTIVE]
        if not admin and mine >= self.limits.max_waiting:
            raise APIError(429, f"model '{engine.name}' has {mine} {klass} requests waiting (queue.max_waiting, per class); "
                           "retry later", "queue_full", retry_after=predicted)
        waiter = Waiter(engine, now, counted)
        self.wait_parts.arrived(engine.name, now, first=not queue, doing=self.doing.get(engine.name, ("",))[0])
        queue.append(waiter)
        self.poke()
        limit, limit_name = ((self.limits.batch_max_wait_s, "queue.batch_max_wait_s") if klass == BATCH and not admin
                             else (self.limits.max_wait_s, "queue.max_wait_s"))
        try:
            await asyncio.wait({waiter.future}, timeout=limit)
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(engine, counted)
            self._forget(waiter)
            raise
        # Its parts are cut before the waiter is forgotten: the next arrival at an empty queue starts them afresh.
        parts = self.wait_parts.parts(engine.name, waiter.since, self.clock())
        refused = Lease(False, None, *parts, refused=True)
        if not waiter.future.done():
            self._forget(waiter)
            held, last = self.held_by.get(engine.name) if klass == BATCH else None, self.wait_parts.now(engine.name)
            error = APIError(503, f"model '{engine.name}' did not become ready within {limit_name}={limit:g} s "
                             f"(engine state: {engine.state.value})" + (f"; a batch request takes no room from interactive "
                             f"users, and {held}" if held else f"; held ({last['reason']}): {last['why']}" if last and last["why"]
                             else ""), "model_not_ready", retry_after=self.predicted_wait(engine, self.clock()))
            error.wait = refused
            raise error
        try:
            return Lease(False, waiter.future.result(), *parts)
        except APIError as exc:  # the error a failed engine left for its waiters
            raise exc.after_waiting(refused) from None

    def lease_at_once(self, engine: Engine, klass: str = INTERACTIVE) -> Optional[Lease]:
        """A client request's lease when its engine is awake and free now (None: `acquire` it), taken
        without yielding to the loop: a caller that waits in a task of its own (`router.proxy.keepalive`)
        takes it here first, so a request counts in `in_flight` as soon as it was routed, before the
        next request is (a virtual model's pick reads `in_flight`)."""
        if self._closing or engine.name in self.busy or engine.state is not State.AWAKE:
            return None
        self._arrived(engine, klass, self.clock())
        engine.try_lease()  # cannot fail on an AWAKE engine
        self._leased(engine, klass)
        return AT_ONCE

    def _arrived(self, engine: Engine, klass: str, now: float) -> None:
        self.demand.arrived(engine.name, now)
        self.put_to_sleep.discard(engine.name)
        if klass == INTERACTIVE:
            self.interactive_seen[engine.name] = now
            self.user_demand.arrived(engine.name, now)

    def release(self, engine: Engine, klass: Optional[str] = None) -> None:
        """Give back a lease `acquire` returned; `klass` as it was acquired with (None: an operator's)."""
        engine.release()
        ended_demand = False
        if klass == INTERACTIVE:
            self.interactive_leases[engine.name] -= 1
            self.interactive_seen[engine.name] = self.clock()
            if self.interactive_leases[engine.name] <= 0:
                del self.interactive_leases[engine.name]
                ended_demand = True  # a batch target may now be able to take its room (after interactive_hold_s)
        elif klass == BATCH:
            self.batch_leases[engine.name] -= 1
            if self.batch_leases[engine.name] <= 0:
                del self.batch_leases[engine.name]
        if engine.in_flight == 0 or ended_demand:
            self.poke()

    def _leased(self, engine: Engine, klass: Optional[str]) -> None:
        if klass == INTERACTIVE:
            self.interactive_leases[engine.name] += 1
        elif klass == BATCH:
            self.batch_leases[engine.name] += 1

    def preemptible(self, engine: Engine) -> bool:
        """Whether everything `engine` serves is batch work (an operator's lease or an interactive request is
        neither): an interactive waiter need not wait out its hold or its drain, its streams yield at once
        (`engines.leases.PREEMPTED`, paused and resumed by the proxy). An interactive stream is never preempted,
        nor an answer the proxy could not resume exactly (the cut would lose it): those drain as before."""
        return engine.in_flight > 0 and self.batch_leases.get(engine.name, 0) >= engine.in_flight \
            and not engine.leases.unresumable

    def interactive_demand(self, engine: Engine, now: float, within_s: float = 0.0) -> tuple[Optional[str], float]:
        """Why `engine` has interactive demand (None: it has none), and in how many seconds that ends
        by time alone (0: it ends when requests do, which pokes). Batch work never parks, stops or
        preempts such an engine: `_make_room`. `within_s`: the wake the batch work would start; a user
        more likely than not to ask for `engine` before it ends is demand too (its model would wait
        out that wake, then its own, only to preempt the batch work at once)."""
        name, hold = engine.name, self.swap.interactive_hold_s
        if self.interactive_leases.get(name):
            return f"'{name}' has {self.interactive_leases[name]} interactive request(s) in flight", 0.0
        queued = sum(1 for w in self.waiting[name] if w.klass == INTERACTIVE)
        if queued:
            return f"'{name}' has {queued} interactive request(s) queued", 0.0
        seen = self.interactive_seen.get(name)
        if seen is not None and now - seen < hold:
            return (f"'{name}' served an interactive request {now - seen:.1f} s ago (swap.interactive_hold_s="
                    f"{hold:g})", seen + hold - now)
        expected = self.user_demand.rate(name, now) * within_s  # users' requests for it within the wake
        if expected > LIKELY:
            return (f"'{name}' is {1 - math.exp(-expected):.0%} likely to be asked for by a user within the "
                    f"{within_s:.1f} s wake this room is wanted for (its users' rate, swap.demand_tau_s="
                    f"{self.user_demand.tau_s:g})", max(self.user_demand.tau_s * math.log(expected / LIKELY), 0.01))
        return None, 0.0

    def batch_only(self, engine: Engine) -> bool:
        """Whether everyone waiting for `engine` is a batch request (nobody waiting: False)."""
        queue = self.waiting[engine.name]
        return bool(queue) and all(w.klass == BATCH for w in queue)

    def yields_to_users(self, engine: Engine) -> bool:
        """Whether the work of waking `engine` takes no room from interactive demand: only batch requests
        wait for it, or nobody does (a boot in the background). Such work never parks, demotes or stops an
        engine with interactive demand (`interactive_demand`); a pre-wake or an idle park never does either."""
        return self.batch_only(engine) or not self.waiting[engine.name]

    def queued_by_class(self, engine: Engine) -> dict[str, int]:
        """Waiting requests per class (an operator's wait counts as interactive)."""
        counts = {INTERACTIVE: 0, BATCH: 0}
        for waiter in self.waiting[engine.name]:
            counts[BATCH if waiter.klass == BATCH else INTERACTIVE] += 1
        return counts

    def poke(self) -> None:
        self._poke.set()

    def queued(self, engine: Engine) -> int:
        return len(self.waiting[engine.name])

    @property
    def last_swap(self) -> Optional[SwapRecord]:
        return self.history[-1] if self.history else None

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Refuse new requests (they may still arrive over kept-alive connections); serve those queued."""
        self._closing = True

    def predicted_wait(self, engine: Engine, now: float) -> float:
        """Seconds until `engine` is likely to take a request: its wake (or boot) still to come,
        plus a park when it does not fit yet."""
        if engine.state is State.AWAKE and engine.name not in self.busy:
            return 0.0
        if engine.name in self.doing:
            action, started, predicted = self.doing[engine.name]
            if action in ("boot", "wake"):
                return max(0.0, started + predicted - now)
        wake_s = self.costs.wake_s(engine.name, engine.sleep_level if engine.state is State.SLEEPING else None)
        if self.ledger().fits(engine):
            return wake_s
        parks = [self.costs.sleep_s(e.name) for e in self.engines if e.state is State.AWAKE
                 and set(e.spec.devices) & set(engine.spec.devices)]
        return wake_s + max(parks, default=0.0)

    def boot_devices(self) -> set[int]:
        """The devices a boot has to itself right now. vLLM sizes its KV cache at boot from the
        device's free memory and from what its own process added while it profiled
        (vllm/v1/worker/utils.py:716 `request_memory`, vllm/utils/mem_utils.py:230
        `memory_profiling`, read in vLLM 0.32): anything else that allocates or frees on that
        device meanwhile is counted as the booting engine's, so it starts with a wrong KV cache,
        or not at all. So a boot starts only when nothing moves on its devices, and nothing else
        starts there until it ends."""
        return {d for e in self.engines if e.name in self.boots or e.state is State.BOOTING for d in e.spec.devices}

    def ledger(self) -> Ledger:
        reserved = [e for e in self.engines if self.doing.get(e.name, ("",))[0] in RESERVING]
        return Ledger(self.engines, self.capacity, reserved, self.residuals, self.weights)

    def _grant(self, engine: Engine, swap_id: Optional[int] = None) -> None:
        """Leases to `engine`'s waiters: interactive (and operators') ones first, each class oldest first."""
        queue = self.waiting[engine.name]
        if any(w.klass == BATCH for w in queue):
            ordered = sorted(queue, key=lambda w: w.klass == BATCH)  # stable: each class stays oldest first
            queue.clear()
            queue.extend(ordered)
        while queue and engine.try_lease():
            waiter = queue.popleft()
            if waiter.future.done():  # its client left; give the lease back
                engine.release()
            else:
                self._leased(engine, waiter.klass)
                waiter.future.set_result(swap_id)

    # -- failures (the actions themselves are in router.actions) ---------------------------------

    def _fail_waiters(self, engine: Engine, error: APIError) -> None:
        queue = self.waiting[engine.name]
        while queue:
            self._fail(queue.popleft(), error)

    @staticmethod
    def _fail(waiter: Waiter, error: APIError) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def _forget(self, waiter: Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
        try:
            self.waiting[waiter.engine.name].remove(waiter)
        except ValueError:
            return
        self.poke()  # the room being made for it may be nobody's now (`_forget_abandoned_rooms`)


# -- backoff: consecutive failures per engine, and when a failed engine may be tried again ------------
# The first retry is immediate (the next request for the model triggers it); repeats wait 1, 2, 4, ...
# seconds, up to MAX_BACKOFF_S. A success resets the count. (Here rather than a module of its own so
# the wing keeps to its twelve modules: router/scheduling/staging.py took the place.)

MAX_BACKOFF_S = 60.0


class Backoff:
    def __init__(self, names: list[str], clock: Callable[[], float]):
        self.clock = clock
        self.failures: dict[str, int] = {name: 0 for name in names}
        self.retry_at: dict[str, float] = {}

    def failed(self, name: str) -> float:
        """Count one failure; seconds until the engine may be retried."""
        self.failures[name] += 1
        n = self.failures[name]
        delay = 0.0 if n == 1 else min(MAX_BACKOFF_S, 2.0 ** (n - 2))
        self.retry_at[name] = self.clock() + delay
        return delay

    def succeeded(self, name: str) -> None:
        self.failures[name] = 0

    def waiting(self, engine: Engine, now: float) -> bool:
        """A failed engine still inside its backoff: its requests are refused, not queued."""
        return engine.state is State.FAILED and now < self.retry_at.get(engine.name, 0)

    def unavailable(self, engine: Engine) -> APIError:
        wait = self.retry_at[engine.name] - self.clock()
        return APIError(503, f"model '{engine.name}' is unavailable, restarting in {wait:.0f} s after "
                        f"{self.failures[engine.name]} failures; last: {for_clients(engine.failure or '')}", "engine_failed", retry_after=wait)
