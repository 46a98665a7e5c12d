"""Waking a parked engine before anyone asks for it (`swap.wake_ahead`).

A wake a request waits for costs it the wake and the canary. When a device has room nobody waits
for, or room held only by idle engines nobody has used within `reuse_horizon_s` and no interactive
demand holds (no demand), the parked engine most likely to be asked for next is woken then, so its next request finds it awake. What it may cost is bounded
by the numbers: the chance it is asked for within `reuse_horizon_s` times the waiting it saves must
beat what the idle engines parked for it are expected to cost (the same `expected_cost` victims are
ranked by) plus, should it go unused, the sleep that gives its room back.

An engine an operator put to sleep (`/admin/sleep`) stays asleep until a request asks for it.

A pre-woken engine that nobody has used is an ordinary idle victim, parked at once for a waiter
(`_evictable_in`: an unclaimed wake is not protected by `min_active_s`), and at the level it came
from when that was Level 2 (dropping its weights again is all it takes: the waiter pays no copy
out, and the engine is where it would be had it never woken). Each pre-wake and its outcome
(used, parked unused, failed) is an event: a counter, a mark on the timeline, /admin/status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from engines.engine import Engine, State
from router.scheduling import placement
from router.scheduling.actions import Actions
from router.scheduling.placement import Ledger, Victim
from router.scheduling.state import Decision


@dataclass
class WokenAhead:
    """One pre-wake, from its decision to its outcome."""

    engine: str
    level: Optional[int]  # the level it was asleep at
    at: float  # scheduler clock, when decided
    chance: float  # the chance it is asked for within reuse_horizon_s, then
    outcome: Optional[str] = None  # None while it waits to be used; used | unused | failed

    def as_dict(self, now: float) -> dict[str, object]:
        return {"engine": self.engine, "from_level": self.level, "ago_s": round(now - self.at, 3),
                "chance": round(self.chance, 3), "outcome": self.outcome or "pending"}


class WakeAhead(Actions):
    """The wake-ahead part of `Scheduler` (see `router.scheduling.state`)."""

    ahead: dict[str, WokenAhead]  # engine -> its pre-wake, until the outcome is known
    ahead_done: list[WokenAhead]  # the last outcomes, newest last (for /admin/status)
    quiet_since: dict[str, float]  # engine -> when it was last woken ahead or parked for idleness

    def ahead_decisions(self, ledger: Ledger, now: float, moving: set[str],
                        clear: Callable[[Engine], bool]) -> list[Decision]:
        """At most one pre-wake (or the parks that make its room), where no waiter needs the room.

        The promises it keeps (DESIGN.md, "The scheduler's promises"): a group is exclusive,
        so a sleeper whose group has another engine awake, on its way, or asked for is never woken ahead, nor
        anything parked for it (1); no wake/park cycle without demand, so an engine already woken ahead, or
        parked for idleness, is not woken ahead again before a request arrives for it (6); and a guess never
        takes the room of a model in use (`_ahead_victims`)."""
        if not self.swap.wake_ahead:
            return []
        wanted = {d for e in self.engines if self.waiting[e.name] and e.state is not State.AWAKE for d in e.spec.devices}
        wanted |= {d for name in self.making_room if (e := self._engine(name)) is not None for d in e.spec.devices}
        sleepers = [e for e in self.engines if e.state is State.SLEEPING and e.name not in self.busy and e.name not in moving
                    and e.name not in self.ahead and e.name not in self.put_to_sleep and not set(e.spec.devices) & wanted and not self.backoff.waiting(e, now)
                    and self.demand.rate(e.name, now) > 0 and clear(e) and not self._rival_stirs(e, ledger, moving)
                    and self.demand.last(e.name) > self.quiet_since.get(e.name, -math.inf)]
        for target in sorted(sleepers, key=lambda e: -self.demand.rate(e.name, now)):
            chance = self._reuse(target, now)
            saved = chance * self.waited(target, self.costs.wake_s(target.name, target.sleep_level), now)
            unused = (1 - chance) * self.costs.sleep_s(target.name)  # giving the room back, should nobody come
            if saved <= unused:
                continue
            if ledger.fits(target):
                self.ahead[target.name] = WokenAhead(target.name, target.sleep_level, now, chance)
                self.quiet_since[target.name] = now
                self.events.woke_ahead(target, "woken")
                return [Decision("wake", target, f"ahead of demand: {chance:.0%} likely asked for within "
                                                    f"{self.reuse_horizon_s:g} s, saves {saved:.1f} s expected")]
            chosen = placement.cheapest(ledger, target, self._ahead_victims(target, ledger, now, moving, clear), [])
            if chosen and sum(v.cost for v in chosen) < saved - unused:
                return [d for v in chosen for d in self._move(v, f"room to wake {target.name} ahead of demand "
                                                                 f"({chance:.0%} likely asked for within {self.reuse_horizon_s:g} s)",
                                                              ledger, now)]
        return []

    def _rival_stirs(self, engine: Engine, ledger: Ledger, moving: set[str]) -> bool:
        """Whether another engine of `engine`'s group is awake, on its way (an action, or this round's
        decisions), or asked for: then `engine` is no guess to wake, its group being exclusive."""
        group = engine.spec.group
        return group is not None and any(
            e is not engine and e.spec.group == group and (
                e.state in placement.HOLDS_SHARE or e.name in ledger.reserved or e.name in self.busy
                or e.name in moving or self.waiting[e.name] or e.name in self.making_room)
            for e in self.engines)

    def _ahead_victims(self, target: Engine, ledger: Ledger, now: float, moving: set[str],
                       clear: Callable[[Engine], bool]) -> list[Victim]:
        """The awake engines a guess may park: idle on the target's devices, nobody's interactive demand (in
        flight, queued, or within swap.interactive_hold_s), and not used within reuse_horizon_s, counted from
        a request's end as well as its arrival (a request longer than the horizon is still demand)."""
        return [Victim(e, "park", ledger.parked_frees(e), self.cost(e, "park", now)) for e in self.engines
                if e.state is State.AWAKE and e.name not in self.busy and e.name not in moving and not e.spec.pin
                and not e.in_flight and set(e.spec.devices) & set(target.spec.devices) and clear(e)
                and self._evictable_in(e, now, now) == 0 and self.interactive_demand(e, now)[0] is None
                and now - max(e.last_used, self.demand.last(e.name)) > self.reuse_horizon_s]

    def ahead_level(self, engine: Engine) -> Optional[int]:
        """The level an unused pre-woken engine goes back to: Level 2 when it came from there (a drop, at
        no cost to the waiter it makes room for); else None, chosen as for any park."""
        woken = self.ahead.get(engine.name)
        return 2 if woken is not None and woken.outcome is None and woken.level == 2 and engine.spec.reloads_weights else None

    def _settle_ahead(self) -> None:
        """Outcomes of the pre-wakes: used once it took a request (in flight counts: a park after its first
        request began must not drop it as unused); unused once parked (or stopped) before it did."""
        engines = {e.name: e for e in self.engines}
        for name, woken in list(self.ahead.items()):
            engine = engines.get(name)
            if engine is None:  # left the roster
                self.ahead.pop(name)
                continue
            if name in self.busy and engine.state is not State.AWAKE:
                continue  # its wake is still running
            if engine.state is State.AWAKE and (engine.in_flight or engine.last_used >= engine.since):
                self._ahead_ended(engine, "used")
            elif engine.state is not State.AWAKE and name not in self.busy:
                self._ahead_ended(engine, "unused" if engine.state is not State.FAILED else "failed")

    def _ahead_ended(self, engine: Engine, outcome: str) -> None:
        woken = self.ahead.pop(engine.name)
        woken.outcome = outcome
        self.ahead_done = [*self.ahead_done[-19:], woken]
        self.events.woke_ahead(engine, outcome)
