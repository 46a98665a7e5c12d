"""The Observer interface: what an engine reports as it goes (state changes, step durations, verdicts,
restarts). The router's metrics and logs implement it; engines.engine re-exports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.states import State

if TYPE_CHECKING:
    from engines.gate import Verdict

# `Engine` is engines.engine's, named but not imported: that module imports this one.


class Observer:
    """Receives what an engine does (the router's metrics and logs implement this)."""

    def state_changed(self, engine: "Engine", old: State, new: State) -> None: ...  # noqa: F821

    def step_done(self, engine: "Engine", phase: str, seconds: float, ok: bool) -> None: ...  # noqa: F821

    def verdict(self, engine: "Engine", verdict: Verdict) -> None: ...  # noqa: F821

    def restarted(self, engine: "Engine", reason: str) -> None: ...  # noqa: F821

    def midlife_collapse(self, engine: "Engine", observed_mal: float, reason: str) -> None: ...  # noqa: F821
