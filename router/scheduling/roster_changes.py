"""What a roster reload asks of the scheduler: engines that join, leave, or restart with a new entry.

A new engine boots in the background: it is a wake target with no waiter, so room is made for
it only from idle engines, never by cutting into requests. A removed one takes no new requests
(the router no longer resolves its names), serves those it already queued, and is stopped once
it has none in flight. A changed one is stopped at its next idle moment and boots from its new
entry the way a new one does. The decisions are taken in `Scheduler.decide`, like every other.

`RosterChanges` is a part of `Scheduler` (see `router.scheduling.state`), as `Actions` is.
"""

from __future__ import annotations

import collections
import logging
from config.diff import router_side
from config.schema import ModelSpec
from engines.engine import Engine, State
from router.scheduling.state import Decision, SchedulerState

log = logging.getLogger("hotswap")


class RosterChanges(SchedulerState):
    def add(self, engine: Engine) -> None:
        self.engines.append(engine)
        self.waiting[engine.name] = collections.deque()
        self.backoff.failures[engine.name] = 0
        self.to_boot.add(engine.name)
        self.poke()

    def retire(self, engine: Engine) -> None:
        engine.retiring = True
        self.pending_spec.pop(engine.name, None)
        self.to_boot.discard(engine.name)
        self.poke()

    def revive(self, engine: Engine) -> None:
        """Back in the roster before it was stopped: it serves again as it is."""
        log.info("%s is back in the roster before it stopped: it serves on", engine.name)
        engine.retiring = False
        self.poke()

    def respec(self, engine: Engine, spec: ModelSpec) -> None:
        """Restart `engine` from `spec` at its next idle moment; the router-side keys apply now."""
        self.pending_spec[engine.name] = spec
        engine.adopt(router_side(engine.spec, spec))
        self.poke()

    def roster_decisions(self) -> list["Decision"]:
        out = []
        for engine in self.engines:
            idle = engine.name not in self.busy and not self.waiting[engine.name] and not engine.in_flight
            if not idle or engine.state not in (State.AWAKE, State.SLEEPING, State.COLD, State.FAILED):
                continue
            if engine.retiring:
                out.append(Decision("retire", engine, "left the roster"))
            elif engine.name in self.pending_spec:
                out.append(Decision("respec", engine, "its roster entry changed"))
        return out

    async def _retire(self, engine: Engine) -> None:
        log.info("stopping %s: it left the roster and has no requests left", engine.name)
        await engine.stop()
        if not engine.retiring:  # back in the roster while it stopped
            self.to_boot.add(engine.name)
            return
        self.engines.remove(engine)
        for table in (self.waiting, self.backoff.failures, self.backoff.retry_at, self.residuals):
            table.pop(engine.name, None)
        self.handled.discard(engine.name)
        self.events.retired(engine)
        log.info("%s stopped and removed", engine.name)

    async def _respec(self, engine: Engine) -> None:
        spec = self.pending_spec.pop(engine.name, None)
        if spec is None or engine.retiring:  # a later reload removed it, or changed it back
            return
        log.info("restarting %s from its changed roster entry (was %s); it boots when there is room", engine.name, engine.state.value)
        engine.restarts["roster"] += 1
        engine.observer.restarted(engine, "roster")
        await engine.stop()
        engine.respec(spec)
        self.residuals.pop(engine.name, None)
        self.costs.forget(engine.name)  # they were another model's, or other flags'
        self.handled.discard(engine.name)
        self.backoff.succeeded(engine.name)
        if engine.name not in self.put_to_sleep:  # an operator's sleep lasts until a request asks for it
            self.to_boot.add(engine.name)
