"""What an engine is doing, for an operator's eyes: why its boot began, the step it is in, the boot's
deadline, and what the gate said since its wake (or boot) began, with the restart between (the story
its swap tells: refused, restarted, passed)."""

from __future__ import annotations

import time
from typing import Optional

# Why an engine boots: "first" (since the router started), "stopped" (cold after a stop), "roster"
# (its entry changed in a reload), or a restart's reason (engines.engine.Engine.restart: "gate",
# "failed", "midlife", "admin").
FIRST, STOPPED, ROSTER = "first", "stopped", "roster"
RESTARTED = "restarted"  # in `gates`: the cold restart a refused gate led to


class Progress:
    def __init__(self) -> None:
        self.boot_reason: Optional[str] = None  # of the current or last boot
        self.next_boot = FIRST  # the reason of a boot that is given none
        self.step: Optional[str] = None  # "start", "load", or the phase of the step running now (engines.waking.climb)
        self.boot_deadline: Optional[float] = None  # monotonic; while booting
        self.gates: list[str] = []  # verdict results (and RESTARTED) since the wake or boot began

    def booting(self, reason: Optional[str], timeout_s: float) -> float:
        """A boot begins; returns its deadline. A gate's restart goes on with its wake's story."""
        self.boot_reason, self.next_boot = reason or self.next_boot, STOPPED
        self.gates = [*self.gates, RESTARTED] if reason == "gate" else []
        self.step = "start"
        self.boot_deadline = time.monotonic() + timeout_s
        return self.boot_deadline

    def boot_over(self) -> None:
        self.boot_deadline = self.step = None

    def waking(self) -> None:
        self.gates = []
