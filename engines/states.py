"""An engine's states and the one table of transitions between them.

See DESIGN.md, "Engine states"; `engines.engine.Engine._enter` refuses any transition the
table does not list.
"""

from __future__ import annotations

import enum


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
