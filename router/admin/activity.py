"""The activity log: one record per proxied request, for an operator asking "what happened to
my request?" (GET /admin/activity, `hotswap activity`, /ui's recent requests).

A record says who asked (the key's name, never the key), for what, where it went (an engine, or the
peer node it was passed to: `peer`, with the peer's status, timings and tokens), how it came
by its lease (found its model awake, or waited for swap N: /admin/status's swaps carry the
same id), how it ended (a stream paused and resumed across its engine's turn, or cut for good:
`resumed`, `paused_s`, `cut`), how long it took, and the answer's token counts and acceptance as the
engine reported them in `usage` and `metrics.speculative_decoding`. Never any prompt or
completion text: the proxy reads the answer's numbers from its last bytes by key, once, for the
acceptance watch and for this log (`router.proxy.forward.read_numbers`), and hands over only numbers.

The newest `activity.ring` records are kept in memory; with `activity.path` they also go to an
SQLite file (`router.admin.activity_file`, written off the event loop), which refills the
ring at start.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, NamedTuple, Optional

from config.schema import Activity as Settings
from router.admin.activity_file import ActivityFile
from router.scheduling import Lease

log = logging.getLogger("hotswap")

MAX_MODEL_CHARS = 200  # a client's `model` that names nothing is kept, cut to this


class Record(NamedTuple):
    """A tuple, not a dataclass: one is made per proxied request, on the event loop, and a frozen
    dataclass's field-by-field __init__ cost several times a tuple's (measured with py-spy under
    bench/peers.py). The SQLite file takes it as its row as it is."""

    at: float  # epoch seconds when the request ended (its record was made)
    key_name: Optional[str]  # None: client auth is off
    model: Optional[str]  # as the client asked (an alias, an adapter); None: it named none
    engine: Optional[str]  # None: no engine was chosen (an unknown model, a bad body, a request passed to a peer)
    endpoint: str  # the route family, as in the metrics' `endpoint` label
    status: int
    found_awake: Optional[bool]  # None: no lease was taken
    queue_wait_s: Optional[float]
    swap_id: Optional[int]
    ttfb_s: Optional[float]  # streams only
    duration_s: float
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    mean_acceptance_length: Optional[float]
    peer: Optional[str] = None  # the node a request was passed to (node.peers); last, so a file of before gains a column
    # interactive or batch (auth.keys[].class, X-Hotswap-Class); None: no lease was asked for. `class` in
    # as_dict (a Python keyword cannot name the field); its SQLite column is request_class.
    request_class: Optional[str] = None
    # A stream its engine's turn, restart or failure interrupted (router.proxy.resume), whose status still
    # reads the 200 it was sent with: why it was paused, in order, comma-joined (drain_deadline, engine_failed,
    # restart, preempted, migrated), and the seconds it waited paused; None: never paused.
    resumed: Optional[str] = None
    paused_s: Optional[float] = None
    cut: Optional[str] = None  # why its answer was cut for good rather than resumed (tools, wait, ...); None: it was not
    # A wait's parts (router.scheduling.history.WaitParts), for a lease that waited: the seconds its swap took (its
    # wake or boot and the parks for it), what held it as `reason=seconds` pairs in order (min_active, max_hold,
    # interactive, other_wake, boot, parking, queue; None: nothing did) and their sum. None: it found its model awake.
    swap_s: Optional[float] = None
    held: Optional[str] = None
    held_s: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        # Rounded here, when read, rather than per request when made.
        out = self._asdict()
        for name in ("queue_wait_s", "ttfb_s", "duration_s", "paused_s", "swap_s", "held_s"):
            out[name] = _round(out[name])
        out["class"] = out.pop("request_class")
        out["held"] = held_parts(self.held)
        return out


FIELDS = Record._fields


class ActivityLog:
    """The ring of the newest records, and the file behind it (if any). `router.live.RequestLog`."""

    def __init__(self, settings: Settings) -> None:
        self.ring: collections.deque[Record] = collections.deque(maxlen=settings.ring or 1)
        self.enabled = settings.ring > 0
        self.file: Optional[ActivityFile] = None
        # Swap ids this router must not reuse: its records link to swaps by id (router.app starts past it).
        self.last_swap_id = 0
        if settings.path:  # ActivityFileError (the start fails) for a file that cannot be used
            self.file = ActivityFile(settings.path, settings.max_rows, FIELDS)
            self.ring.extend(map(_from_row, self.file.last(settings.ring)))
            self.last_swap_id = self.file.max_swap_id

    @property
    def wants_answers(self) -> bool:
        """Whether the proxy should read answers' numbers for it (a stream then keeps its last bytes)."""
        return self.enabled

    def request_done(self, *, key_name: str, model: Any, engine: Optional[str], peer: Optional[str], endpoint: str, status: int,
                     found_awake: Optional[bool], swap_id: Optional[int], queue_wait_s: Optional[float],
                     ttfb_s: Optional[float], duration_s: float, prompt_tokens: Optional[int],
                     completion_tokens: Optional[int], mean_acceptance_length: Optional[float],
                     request_class: Optional[str] = None, resumed: Optional[str] = None, paused_s: Optional[float] = None,
                     cut: Optional[str] = None, wait: Optional[Lease] = None) -> None:
        if not self.enabled:
            return
        asked = model[:MAX_MODEL_CHARS] if isinstance(model, str) else None
        if asked is not None and not asked.isascii():
            # A JSON body may carry a lone surrogate ("\ud800"), which is no UTF-8 text: as a '?', it cannot
            # fail the file's batch (every row of it is dropped) on its way to SQLite.
            asked = asked.encode("utf-8", "replace").decode("utf-8")
        record = Record(time.time(), key_name or None, asked, engine, endpoint, status, found_awake, queue_wait_s, swap_id,
                        ttfb_s, duration_s, prompt_tokens, completion_tokens, mean_acceptance_length, peer, request_class,
                        resumed, paused_s, cut, *((wait.swap_s, wait.held, wait.held_s) if wait is not None else ()))
        self.ring.append(record)
        if self.file is not None:
            self.file.put(record)

    def query(self, model: Optional[str] = None, since: Optional[float] = None, limit: int = 100) -> list[Record]:
        """The newest `limit` records (newest first) that ended after `since`, for `model` (asked by that
        name, or served by that engine)."""
        out: list[Record] = []
        for record in reversed(self.ring):
            if since is not None and record.at <= since:
                break  # the ring is in the order records were made
            if model is None or model in (record.model, record.engine):
                out.append(record)
                if len(out) >= limit:
                    break
        return out

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _from_row(row: tuple[Any, ...]) -> Record:
    record = Record(*row)
    return record if record.found_awake is None else record._replace(found_awake=bool(record.found_awake))  # SQLite: 0/1


def held_parts(held: Optional[str]) -> Optional[dict[str, float]]:
    """A record's `held` (`min_active=1.780,queue=0.020`) as {reason: seconds}, in order; None: nothing held it."""
    if not held:
        return None
    return {reason: float(seconds) for reason, _, seconds in (part.partition("=") for part in held.split(","))}


def _round(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds, 6)
