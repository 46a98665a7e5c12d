"""An engine's states, the one table of transitions between them, and who hears of them.

See DESIGN.md, "Engine states"; `engines.engine.Engine._enter` refuses any transition the
table does not list.
"""

from __future__ import annotations

import enum
from typing import Any


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
    """Receives what an engine does (the router's metrics and logs implement this). `engine` is the
    `engines.engine.Engine` reporting (typed Any: this module sits below it). A parked engine that
    goes a rung further down without waking (`Engine.park_further`) reports SLEEPING -> SLEEPING."""

    def state_changed(self, engine: Any, old: State, new: State) -> None: ...

    def step_done(self, engine: Any, phase: str, seconds: float, ok: bool) -> None: ...

    def verdict(self, engine: Any, verdict: Any) -> None: ...

    def restarted(self, engine: Any, reason: str) -> None: ...

    def midlife_collapse(self, engine: Any, observed_mal: float, reason: str) -> None: ...
