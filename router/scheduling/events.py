"""What the scheduler reports: each swap as a record, and the events an observer receives
(the router's metrics implement them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

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


class Events:
    """What the scheduler reports (the router's metrics implement this)."""

    def swap_done(self, record: SwapRecord) -> None: ...

    def evicted(self, engine: Engine, reason: str) -> None: ...

    def retired(self, engine: Engine) -> None:
        """An engine that left the roster has stopped and is no longer scheduled."""
