"""Consecutive failures per engine, and when a failed engine may be tried again.

The first retry is immediate (the next request for the model triggers it); repeats wait 1,
2, 4, ... seconds, up to MAX_BACKOFF_S. A success resets the count.
"""

from __future__ import annotations

from typing import Callable

from engines.engine import Engine, State
from router.errors import APIError, for_clients

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
