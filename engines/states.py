"""An engine's states, the one table of transitions between them, and what an engine reports.

See DESIGN.md, "Engine states"; `engines.engine.Engine._enter` refuses any transition the
table does not list.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines import gate
    from engines.engine import Engine


class State(str, enum.Enum):
    COLD = "cold"
    BOOTING = "booting"
    AWAKE = "awake"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    WAKING = "waking"
    VERIFYING = "verifying"
    FAILED = "failed"


# Every transition an engine may make. COLD and FAILED are reachable from everywhere: stop() ends
# any state, and anything can fail.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.COLD: frozenset({State.BOOTING, State.FAILED}),
    State.BOOTING: frozenset({State.AWAKE, State.FAILED, State.COLD}),
    State.AWAKE: frozenset({State.DRAINING, State.FAILED, State.COLD}),
    State.DRAINING: frozenset({State.SLEEPING, State.FAILED, State.COLD}),  # to COLD: a restart after its drain
    State.SLEEPING: frozenset({State.WAKING, State.FAILED, State.COLD}),
    State.WAKING: frozenset({State.VERIFYING, State.DRAINING, State.FAILED, State.COLD}),  # to DRAINING: a demotion
    State.VERIFYING: frozenset({State.AWAKE, State.FAILED, State.COLD}),  # to COLD: a refused gate's restart
    State.FAILED: frozenset({State.COLD}),  # and only so: a restart goes through stop()
}


class EngineFailed(Exception):
    """A lifecycle step failed; the engine is FAILED. The message names engine, step and cause."""


class Observer:
    """Receives what an engine does (the router's metrics and logs implement this)."""

    def state_changed(self, engine: "Engine", old: State, new: State) -> None: ...

    def step_done(self, engine: "Engine", phase: str, seconds: float, ok: bool) -> None: ...

    def verdict(self, engine: "Engine", verdict: gate.Verdict) -> None: ...

    def restarted(self, engine: "Engine", reason: str) -> None: ...

    def midlife_collapse(self, engine: "Engine", observed_mal: float, reason: str) -> None: ...
