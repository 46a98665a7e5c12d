"""What the scheduler reports, and the last hour of it kept in memory.

Reported: each swap as a `SwapRecord`, and the `Events` an observer receives (the router's
metrics and this history implement them). Kept: each engine's state intervals (sleeping split by level), the swaps, each engine's state intervals (sleeping split by level), the swaps,
the gate's refusals, the restarts and the wakes ahead of demand, and samples of the host RAM held for Level 1 and of each GPU's
shares. The Router records it (it observes the engines
and the scheduler); `/admin/timeline` serves it as JSON and `/ui` draws it. Bounded by time (KEEP_S) and by count,
so a router that runs for months holds the same few hundred kilobytes."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from engines.engine import Engine

@dataclass
class SwapRecord:
    """One wake (or boot) that a request or an operator asked for, with what was moved for it."""

    to_model: str
    from_models: list[str]  # parked (or stopped) to make room
    result: str  # "ok" | "failed"
    seconds: float  # from the first move for it to promotion
    phases: dict[str, float]
    predicted_s: float
    group: str = ""
    at: float = field(default_factory=time.time)
    error: Optional[str] = None
    # What the gate said during it, in order, with the restart between: ["refused", "restarted", "passed"]
    # is a wake the gate refused and a cold restart repaired (its `result` is still "ok").
    gates: list[str] = field(default_factory=list)
    id: int = 0  # unique across restarts (router.app): the activity records of the requests that waited for it carry it

    def as_dict(self) -> dict[str, Any]:
        """As /admin/status, /admin/timeline and /ui show it."""
        return {"id": self.id, "to": self.to_model, "from": self.from_models, "result": self.result,
                "seconds": round(self.seconds, 4), "predicted_s": round(self.predicted_s, 3),
                "phases": {k: round(v, 4) for k, v in self.phases.items()}, "error": self.error, "at": self.at,
                "gates": self.gates}


# What holds a waiter (router.scheduling.costs `_why_waiting`): min_active (the engine it needs gone is inside
# swap.min_active_s), max_hold (it serves requests until the oldest waiter has waited swap.max_hold_s),
# interactive (batch work yields to users' demand), other_wake (another engine's wake or park moves memory on
# its GPUs), boot (another engine boots there), parking (its own engine was on its way to sleep as it was asked
# for), queue (nothing yet: its turn after an older waiter's target, the loop's next look). SWAP is not a hold:
# its own wake, boot, and the parks for it.
SWAP = "swap"
LEAVING = ("park", "deepen", "stop", "demote")  # an engine's own actions after which it must come back
PART_MIN_S = 0.005  # a part shorter than this is the loop's latency, not a reason


class WaitParts:
    """Why each model's waiters wait: per model, the stretches of one reason, pass by pass, from which a
    granted waiter's parts are cut. A stretch begins when the reason changes, so a wait's log line is
    said once, not at every look of the loop."""

    def __init__(self) -> None:
        # model -> [(reason, since)], each until the next; from the moment its queue last became non-empty
        self.stretches: dict[str, list[tuple[str, float]]] = {}
        self.why: dict[str, str] = {}  # model -> its current reason in words, as the last look saw it

    def arrived(self, name: str, now: float, first: bool, doing: str = "") -> None:
        """A waiter joined `name`'s queue; `first`: an empty one, so what older waits left no longer applies.
        `doing`: the engine's own action as it arrived, which the loop does not look at again until it ends: a
        wake or boot (woken ahead, or for an operator) is its swap; a park, its engine leaving as it was asked for."""
        if first:
            reason = SWAP if doing in ("boot", "wake", "restart") else "parking" if doing in LEAVING else "queue"
            self.stretches[name] = [(reason, now)]
            self.why[name] = "its engine was being put to sleep or stopped as it was asked for" if reason == "parking" else ""

    def note(self, name: str, reason: str, now: float, why: str = "") -> bool:
        """Whether `reason` begins a stretch (it was not the reason at the last look); `why`, in words, is kept
        for /admin/status (`now`)."""
        self.why[name] = why
        stretches = self.stretches.setdefault(name, [])
        if stretches and stretches[-1][0] == reason:
            return False
        stretches.append((reason, now))
        return True

    def now(self, name: str) -> Optional[dict[str, str]]:
        """The reason `name`'s waiters wait at the last look, and why in words (for /admin/status)."""
        stretches = self.stretches.get(name)
        return {"reason": stretches[-1][0], "why": self.why.get(name, "")} if stretches else None

    def parts(self, name: str, since: float, now: float) -> tuple[float, Optional[str], float]:
        """For a waiter of `name` granted at `now` after waiting since `since`: the seconds its swap took,
        what held it as `reason=seconds` pairs in order (None: nothing did), and their sum."""
        stretches = self.stretches.get(name) or [("queue", since)]
        seconds: dict[str, float] = {}
        for i, (reason, start) in enumerate(stretches):
            end = stretches[i + 1][1] if i + 1 < len(stretches) else now
            overlap = min(end, now) - max(start, since)
            if overlap > 0:
                seconds[reason] = seconds.get(reason, 0.0) + overlap
        swap = seconds.pop(SWAP, 0.0)
        held = {k: v for k, v in seconds.items() if v >= PART_MIN_S}
        text = ",".join(f"{k}={v:.3f}" for k, v in held.items()) or None
        return swap, text, sum(held.values(), 0.0)


class Events:
    """What the scheduler reports (the router's metrics implement this)."""

    def swap_done(self, record: SwapRecord) -> None: ...

    def evicted(self, engine: Engine, reason: str) -> None: ...

    def woke_ahead(self, engine: Engine, outcome: str) -> None:
        """A pre-wake (router.scheduling.ahead): `woken` when decided, then used, unused or failed."""

    def retired(self, engine: Engine) -> None:
        """An engine that left the roster has stopped and is no longer scheduled."""


KEEP_S = 3600.0  # /admin/timeline?minutes= goes up to 60; /ui draws the last 30
MAX_INTERVALS = 2000  # per engine: a swap every second for half an hour
MAX_SWAPS = 500
MAX_MARKS = 1000
MAX_SAMPLES = 3600  # taken on change, at most one a second
REMOVED = "removed"  # a lane's last state once its engine left the roster (not an engine state: it has no engine)


@dataclass
class Interval:
    state: str  # an engine state's value
    start: float  # epoch seconds
    end: Optional[float] = None  # None: it is still in it
    level: Optional[int] = None  # sleeping: the vLLM sleep level it went to sleep at

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "from": round(self.start, 3),
                               "to": None if self.end is None else round(self.end, 3)}
        if self.level is not None:
            out["level"] = self.level
        return out


@dataclass
class Mark:
    """Something that happened to an engine at one moment: a gate's `refused` or `allowed`, or a `restart`."""

    at: float
    engine: str
    kind: str  # "refused" | "allowed" | "restart"
    detail: str = ""  # the refusal's reason, the restart's reason

    def as_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "engine": self.engine, "kind": self.kind, "detail": self.detail}


@dataclass
class Sample:
    """Host RAM held for sleep and each GPU's shares (engine -> state and share), as placement counts them."""

    at: float
    host_gb: float
    budget_gb: float
    gpus: dict[int, dict[str, tuple[str, float]]] = field(default_factory=dict)

    def same(self, other: Sample) -> bool:
        return (self.host_gb, self.budget_gb, self.gpus) == (other.host_gb, other.budget_gb, other.gpus)

    def as_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "host_gb": self.host_gb, "budget_gb": self.budget_gb,
                "gpus": {str(d): {name: {"state": state, "share": share} for name, (state, share) in held.items()}
                         for d, held in self.gpus.items()}}


class History:
    def __init__(self, clock: Callable[[], float] = time.time, keep_s: float = KEEP_S):
        self.clock = clock
        self.keep_s = keep_s
        self.started = clock()  # the router's start: nothing is known before it
        self.lanes: dict[str, collections.deque[Interval]] = {}
        self.swaps: collections.deque[SwapRecord] = collections.deque(maxlen=MAX_SWAPS)
        self.marks: collections.deque[Mark] = collections.deque(maxlen=MAX_MARKS)
        self.samples: collections.deque[Sample] = collections.deque(maxlen=MAX_SAMPLES)

    def state(self, engine: str, state: str, level: Optional[int] = None) -> None:
        """`engine` entered `state` now: its open interval ends, a new one begins."""
        now = self.clock()
        lane = self.lanes.setdefault(engine, collections.deque(maxlen=MAX_INTERVALS))
        if lane and lane[-1].end is None:
            lane[-1].end = now
        lane.append(Interval(state, now, level=level))
        self._forget(now)

    def retired(self, engine: str) -> None:
        """`engine` left the roster (a reload removed it): its lane ends now, with a last `removed` interval
        that ends where it begins. Without it the lane would stay in its last state, `cold`, ongoing for
        ever; a model added back under the same name opens the lane again."""
        lane = self.lanes.get(engine)
        if not lane or lane[-1].state == REMOVED:
            return
        now = self.clock()
        if lane[-1].end is None:
            lane[-1].end = now
        lane.append(Interval(REMOVED, now, end=now))
        self._forget(now)

    def swap(self, record: SwapRecord) -> None:
        self.swaps.append(record)
        self._forget(self.clock())

    def mark(self, engine: str, kind: str, detail: str = "") -> None:
        self.marks.append(Mark(self.clock(), engine, kind, detail))
        self._forget(self.clock())

    def sample(self, host_gb: float, budget_gb: float, gpus: dict[int, dict[str, tuple[str, float]]]) -> None:
        """Kept only when something differs from the last sample: a step chart needs nothing more."""
        sample = Sample(self.clock(), round(host_gb, 4), round(budget_gb, 4), gpus)
        if not self.samples or not sample.same(self.samples[-1]):
            self.samples.append(sample)

    def window(self, minutes: float) -> dict[str, Any]:
        """The last `minutes` as plain data, times in epoch seconds. An interval that began before the
        window keeps its real `from`; the open one has `to: null`. The sample in force when the window
        began is included, so a chart can start at its left edge."""
        now = self.clock()
        since = now - minutes * 60
        engines = {name: [i.as_dict() for i in lane if i.end is None or i.end >= since] for name, lane in self.lanes.items()}
        samples = [s for s in self.samples if s.at >= since]
        earlier = [s for s in self.samples if s.at < since]
        return {"now": round(now, 3), "since": round(since, 3), "started": round(self.started, 3), "engines": engines,
                "swaps": [r for r in self.swaps if r.at >= since],
                "marks": [m.as_dict() for m in self.marks if m.at >= since],
                "samples": [s.as_dict() for s in earlier[-1:] + samples]}

    def _forget(self, now: float) -> None:
        cutoff = now - self.keep_s
        for name, lane in list(self.lanes.items()):
            while len(lane) > 1 and lane[0].end is not None and lane[0].end < cutoff:
                lane.popleft()
            if lane[-1].state == REMOVED and lane[-1].start < cutoff:  # removed before the hour kept: nothing to draw
                del self.lanes[name]
        for items in (self.swaps, self.marks):
            while items and items[0].at < cutoff:
                items.popleft()
        while len(self.samples) > 1 and self.samples[1].at < cutoff:  # the first still in force at the cutoff stays
            self.samples.popleft()
