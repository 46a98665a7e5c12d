"""Staged weights: which Level-2 sleepers' checkpoints to read into the page cache, and when.

The staging part of `Scheduler` (see `router.scheduling.state`). A stage is the engine's
(`engines.waking.stage`: the worker extension reads the files vLLM's loader reads); this decides whose:

- the target of a wake whose room is being made, at once, when its victims' drain and sleep are
  expected to last at least its staged reload (`_lead_pays`: else the reload, waiting for the stage,
  would cost more than reading the disk itself), budget or not: the wake's own reload would read
  the same bytes into the page cache anyway;
- within `host.page_cache_budget_gb`, the Level-2 sleepers most likely to be asked for next
  (`Demand.rate`), one at a time (a background read must not slow a wake's reload on the same
  disk, so none starts while a wake runs), the likeliest first, skipping one that does not fit.

Page cache is evictable: the router cannot hold pages, only put them there; the budget bounds
what it puts there ahead of need. Every checkpoint read fills it, the awake engines' too (a boot's load,
a Level-2 reload, a stage): counted newest first, a staged checkpoint past the budget is taken as
evicted (`_forget_evicted`), so it is staged again ahead of its wake when it is among the likeliest,
rather than read from the disk by its wake's own stage. `wake_estimate_s` is what a wake about to begin
is predicted at: staged when it is, plus what a stage still running has left to read.
"""

from __future__ import annotations

import logging
from typing import Optional

from engines.engine import Engine, State
from router.scheduling.state import SchedulerState

log = logging.getLogger("hotswap")


class Staging(SchedulerState):
    def wake_estimate_s(self, engine: Engine, level: Optional[int]) -> float:
        """Seconds to wake `engine` from `level` now. A Level-2 wake whose stage is still reading joins it
        (engines.waking.stage): the staged wake plus the stage's read still to come, its checkpoint at the disk's
        measured rate (the cold reload's: the same bytes from the same disk) less what it has read so far."""
        running = level == 2 and engine.stager.running
        predicted = self.costs.wake_s(engine.name, level, staged=level == 2 and (engine.stager.staged or running))
        rate, gb, began = self.costs.reload_s_per_gb.get(False), self.weights.get(engine.name), self.stage_began.get(engine.name)
        if running and rate is not None and gb and began is not None:
            predicted += max(0.0, gb * rate - (self.clock() - began))
        return predicted

    def staged_gb(self) -> float:
        """The Level-2 sleepers' checkpoints in the page cache now (as far as the router knows), in GB."""
        return sum(self.weights.get(e.name) or 0.0 for e in self.engines if e.stager.staged and e.sleep_level == 2)

    def stage_ahead(self, now: float) -> None:
        """Begin the stages that should run now (no awaiting: each is a task of its engine's stager;
        its end pokes the loop). Called by the loop after each round of decisions."""
        try:
            self._forget_evicted()
            self._stage_targets()
            self._stage_likeliest(now)
        except Exception:  # a defect here must not stop the loop: staging only ever saves time
            log.exception("internal error while choosing checkpoints to stage")

    def _forget_evicted(self) -> None:
        budget = self.capacity.page_cache_gb
        if not budget:
            return
        read = sorted((e for e in self.engines if e.stager.read_at is not None and self.weights.get(e.name)),
                      key=lambda e: e.stager.read_at, reverse=True)
        held = 0.0
        for engine in read:
            held += self.weights[engine.name]
            # A target whose room is being made was staged for its wake, budget or not (`_stage_targets`).
            if held > budget and engine.stager.staged and not engine.stager.running and engine.name not in self.making_room:
                log.info("engine %s: its staged checkpoint is taken as evicted: with the checkpoints read since, %.0f GB, "
                         "it is past host.page_cache_budget_gb=%g", engine.name, held, budget)
                engine.stager.evicted()

    def _stageable(self, engine: Engine) -> bool:
        return engine.stager.enabled and engine.state is State.SLEEPING and engine.sleep_level == 2

    def _begin(self, engine: Engine, why: str) -> None:
        was_running = engine.stager.running
        task = engine.stager.begin(engine.client, self.swap.timeouts.stage, why)
        if task is not None and not was_running:
            self.stage_began[engine.name] = self.clock()
            task.add_done_callback(lambda _: self.poke())

    def _stage_targets(self) -> None:
        """Once per room made (a failed stage is not retried in a loop: the wake's own step looks again)."""
        for name, (victims, since) in self.making_room.items():
            engine = next((e for e in self.engines if e.name == name), None)
            if engine is None or self.staged_for.get(name) == since or not self._stageable(engine):
                continue
            self.staged_for[name] = since
            if not engine.stager.staged and self._lead_pays(engine, victims):
                self._begin(engine, "room")
        for name in [n for n in self.staged_for if n not in self.making_room]:
            del self.staged_for[name]

    def _lead_pays(self, target: Engine, victims: list[str]) -> bool:
        """Whether the victims' drain and sleep last long enough for a stage begun now to pay: the wake's
        reload waits for a stage still reading (vLLM runs utility calls one at a time), then reads the
        page cache. Read by the reload itself instead, the checkpoint costs what the stage's read does
        (the same bytes from the same disk), so the stage pays when the lead before the reload is at least
        the staged reload it adds. Until a staged reload is measured, it stages."""
        rate, gb = self.costs.reload_s_per_gb.get(True), self.weights.get(target.name)
        if rate is None or not gb:
            return True
        by_name = {e.name: e for e in self.engines}
        lead = max((self.costs.sleep_s(name) + (self.costs.drain_s(name, self.swap.drain_timeout_s)
                                                  if by_name[name].in_flight else 0.0)
                    for name in victims if name in by_name), default=0.0)
        if lead >= gb * rate:
            return True
        log.debug("engine %s: not staged for its wake: its victims' drain and sleep (%.1f s expected) are shorter than "
                  "its staged reload (%.1f s); its reload reads the disk", target.name, lead, gb * rate)
        return False

    def _stage_likeliest(self, now: float) -> None:
        budget = self.capacity.page_cache_gb
        if not budget or any(e.stager.running for e in self.engines):
            return
        if any(action == "wake" for action, *_ in self.doing.values()):
            return  # its reload has the disk
        ranked = sorted((e for e in self.engines if self._stageable(e) and e.name not in self.busy
                         and self.demand.rate(e.name, now) > 0 and self.weights.get(e.name)),
                        key=lambda e: -self.demand.rate(e.name, now))
        used = 0.0
        for engine in ranked:
            gb = self.weights[engine.name] or 0.0
            if used + gb > budget:
                continue
            used += gb
            if not engine.stager.staged and engine.stager.failure is None:  # a failed one waits for its next wake
                self._begin(engine, "ahead")
                return
