"""What moving an engine out of the way costs, and the level it would sleep at.

The cost part of `Scheduler` (see `router.scheduling.state`): an engine's expected cost is the waiting its
absence is likely to cause (predicted wake seconds × likelihood of reuse, from
`router.scheduling.estimates`); `sleep_level: auto` picks Level 1 while the host-RAM budget holds the
weights, and makes RAM for a more valuable engine by demoting a Level-1 sleeper.
"""

from __future__ import annotations

import math
from typing import Collection, Optional

from engines.engine import Engine, State
from router.scheduling.placement import Ledger
from router.scheduling.state import SchedulerState


NO_LEVEL2 = "its --load-format cannot reload weights from disk, so it never sleeps at level 2 (docs/operators.md)"


class Costs(SchedulerState):
    reuse_horizon_s = 60.0  # "needed again soon" means within this long (a benchmark running time faster scales it)

    def cost(self, engine: Engine, action: str, now: float) -> float:
        """What placement ranks victims by. bench/placement.py replaces it on the instance (LRU)."""
        return self.expected_cost(engine, action, now)

    def _level_alone(self, engine: Engine) -> Optional[int]:
        """The level for a park outside the loop's planning (an admin sleep): Level 1 only if it fits
        in host RAM as it is, without demoting anyone (None: stop it instead)."""
        return self._choose_level(engine, self.clock())[0]

    def _choose_level(self, engine: Engine, now: float, waking: Collection[str] = (),
                      ledger: Optional[Ledger] = None) -> tuple[Optional[int], list[Engine]]:
        """The level to park `engine` at, and the Level-1 sleepers to demote to make RAM for it.
        `waking`: engines about to wake, whose host copy of the weights is about to go. `ledger`:
        the GPU as planned, to tell a sleeper that can pass through it to Level 2 from one that
        would have to be stopped (and pay a cold boot later); without one, demote nobody.
        None: not Level 1, and its --load-format cannot reload from disk, so not Level 2 either:
        it is stopped, and boots cold when next needed."""
        if engine.spec.sleep_level != "auto":
            return engine.spec.sleep_level, []
        otherwise = 2 if engine.spec.reloads_weights else None
        weights = self.weights.get(engine.name)
        if weights is None:
            return otherwise, []
        used = self.level1_gb(exclude=waking)
        budget = self.capacity.ram_budget_gb
        if used + weights <= budget:
            return 1, []
        if ledger is None:
            return otherwise, []
        mine = self._level1_value(engine, now, passes=engine.spec.reloads_weights)

        def value(sleeper: Engine) -> float:
            return self._level1_value(sleeper, now, passes=ledger.fits(sleeper) and sleeper.spec.reloads_weights)

        sleepers = sorted((e for e in self.engines if e.state is State.SLEEPING and e.sleep_level == 1
                           and e.name not in self.busy and e.name not in waking and not e.spec.pin), key=value)
        chosen: list[Engine] = []
        lost = 0.0  # what the demotions chosen so far cost, together
        for sleeper in sleepers:
            lost += value(sleeper)
            if lost >= mine:
                break
            chosen.append(sleeper)
            used -= self.weights.get(sleeper.name) or 0.0
            if used + weights <= budget:
                return 1, chosen
        return otherwise, []

    def level1_gb(self, exclude: Collection[str] = ()) -> float:
        """Host RAM held (or about to be) by Level-1 sleepers' weights."""
        total = 0.0
        for engine in self.engines:
            if engine.name in exclude:
                continue
            action = self.doing.get(engine.name)
            parking_l1 = action is not None and action[0] == "park" and self.parking_level.get(engine.name) == 1
            demoting = action is not None and action[0] in ("demote", "stop")
            if parking_l1 or (engine.state is State.SLEEPING and engine.sleep_level == 1 and not demoting):
                total += self.weights.get(engine.name) or 0.0
        return total

    def _level1_value(self, engine: Engine, now: float, passes: bool) -> float:
        """Expected seconds of waiting that keeping `engine` at Level 1 saves: over a Level-2 wake
        when it can pass through the GPU to Level 2 (`passes`), else over the cold boot a stop costs."""
        instead = self.costs.wake_s(engine.name, 2) if passes else self.costs.boot_s(engine.name)
        return self._reuse(engine, now) * max(instead - self.costs.wake_s(engine.name, 1), 0.0)

    def _reuse(self, engine: Engine, now: float) -> float:
        """How likely `engine` is to be asked for within reuse_horizon_s."""
        return 1.0 - math.exp(-self.demand.rate(engine.name, now) * self.reuse_horizon_s)

    def expected_cost(self, engine: Engine, action: str, now: float) -> float:
        """Seconds of waiting that moving `engine` out of the way is expected to cost later:
        its predicted wake (or, stopped, the boot beyond its wake) times the chance it is needed
        again soon. Ties go to the least recently used."""
        if action == "stop":
            level = engine.sleep_level
            extra = self.costs.boot_s(engine.name) - self.costs.wake_s(engine.name, level)
        else:
            level, _ = self._choose_level(engine, now)
            extra = self.costs.boot_s(engine.name) if level is None else self.costs.wake_s(engine.name, level)
        recency = 1e-9 / (1.0 + max(0.0, now - self.demand.last(engine.name)))  # a tie-break only
        return self._reuse(engine, now) * max(extra, 0.0) + recency
