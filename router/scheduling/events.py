"""What the scheduler reports: each swap as a record, and the events an observer receives
(the router's metrics implement them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

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
    id: int = 0  # unique within the router process: the activity records of the requests that waited for it carry it


class Events:
    """What the scheduler reports (the router's metrics implement this)."""

    def swap_done(self, record: SwapRecord) -> None: ...

    def evicted(self, engine: Engine, reason: str) -> None: ...

    def retired(self, engine: Engine) -> None:
        """An engine that left the roster has stopped and is no longer scheduled."""
