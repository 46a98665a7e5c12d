"""The swap scheduler: which engines are awake, which sleep, and who waits.

Requests for an awake, promoted model are leased at once. Others wait in their model's
queue while the scheduler makes room: `decide` (pure policy, no awaiting) looks at every
engine and returns what to start now, and the loop starts each as its own task, so a wake
on one GPU never waits for a swap on another. An engine has at most one action at a time.

Room is GPU memory (`router.scheduling.placement`): a model wakes when its share fits on each of its
devices beside the awake shares and the sleepers' residuals. To make room the scheduler parks
idle engines, the cheapest by expected cost first (`router.scheduling.estimates`: predicted wake time ×
likelihood of reuse); a busy one only once the oldest waiter has waited `max_hold_s`; none
before it has been awake `min_active_s`; a pinned one never. A `group` is exclusive: its
models are never awake together. Whatever goes wrong inside an action is contained to the
engine it concerns: that engine is FAILED, its waiters get a 503, the others carry on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Optional

from engines.engine import Engine, State
from engines.waking import KV_PARKED
from router.errors import APIError
from router.scheduling import placement
from router.scheduling.ahead import WakeAhead
from router.scheduling.costs import NO_LEVEL2
from router.scheduling.placement import Ledger, Victim
from router.scheduling.state import BOOTING_ACTIONS, Decision, Plan
from router.tasks import spawn

log = logging.getLogger("hotswap")

# After a defect in the policy, the loop looks again this long later, pokes or not: a defect that
# repeats on every look must not spin the CPU, nor end scheduling for good.
DEFECT_PAUSE_S = 1.0


class Scheduler(WakeAhead):
    defect_pause_s = DEFECT_PAUSE_S

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        """Serve at once: every engine boots as an action of the loop, so one that has booted serves
        while the others still boot."""
        self.startup = {e.name for e in self.engines if e.state is State.COLD}
        self.startup_total = len(self.startup)
        if not self.startup:
            self._booted()
        self._task = spawn(self._run(), "scheduler")

    async def stop(self) -> None:
        self._stopping = True
        for task in [self._task, *self._actions]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._actions] if t is not None), return_exceptions=True)
        for queue in self.waiting.values():
            while queue:
                self._fail(queue.popleft(), APIError(503, "the router is shutting down; retry on another instance",
                                                     "shutting_down", retry_after=5))

    async def _run(self) -> None:
        """Promise 5: the loop never dies. A defect in the policy is logged (its traceback once), shown in
        /admin/status (`scheduler_defect`), and the loop looks again after `defect_pause_s`: a loop that
        stopped would leave every sleeping model unreachable until the router restarts."""
        while not self._stopping:
            self._poke.clear()
            try:
                plan = self.decide(self.clock())
                for decision in plan.decisions:
                    self._start(decision)
                self.stage_ahead(self.clock())  # overlaps a target's stage with its victims' drain and sleep
            except Exception as exc:
                self._loop_defect(exc)
                await asyncio.sleep(self.defect_pause_s)
                continue
            if plan.decisions:
                continue
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that
                # lands as the poke completes, and stop() would then wait on this loop forever.
                async with asyncio.timeout(plan.wait_s):
                    await self._poke.wait()
            except TimeoutError:
                pass

    def _loop_defect(self, exc: Exception) -> None:
        what = f"{type(exc).__name__}: {exc}"
        last = self.defect
        if last is None or last["error"] != what:
            log.exception("internal error in the scheduler's decisions; it looks again in %g s", self.defect_pause_s)
            self.defect = {"error": what, "count": 0, "first": self.clock()}
        self.defect["count"] += 1
        self.defect["last"] = self.clock()

    def _start(self, decision: Decision) -> None:
        name = decision.engine.name
        self.busy[name] = asyncio.get_running_loop().create_future()
        engine = decision.engine
        level = engine.sleep_level if engine.state is State.SLEEPING else None
        predicted = self.wake_estimate_s(engine, level) if decision.action in ("boot", "wake") else 0.0
        self.doing[name] = (decision.action, self.clock(), predicted)
        if decision.action in BOOTING_ACTIONS and (decision.action == "restart" or engine.state in (State.COLD, State.FAILED)):
            self.boots.add(name)
        if decision.action in ("park", "deepen") and decision.level is not None:
            self.parking_level[name] = decision.level
        task = spawn(self._act(decision), f"{decision.action}:{name}")
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    # -- the policy --------------------------------------------------------------------------

    def decide(self, now: float) -> Plan:
        """What to start now. Grants leases to awake engines' waiters on the way (no awaiting).

        A boot has its devices to itself (`boot_devices`): it starts only where no action is
        running, and nothing else starts on its devices until it ends (its end pokes the loop)."""
        self._forget_abandoned_rooms()
        self._settle_ahead()  # before any park's level is chosen: a used pre-wake parks as any engine would
        decisions: list[Decision] = []
        booting = self.boot_devices()
        changing = {d for e in self.engines if e.name in self.busy for d in e.spec.devices}  # an action moves memory there

        def clear(engine: Engine, boots: bool = False) -> bool:
            devices = set(engine.spec.devices)
            return not devices & booting and not (boots and devices & changing)

        def started(engine: Engine, boots: bool = False) -> None:
            changing.update(engine.spec.devices)
            if boots:
                booting.update(engine.spec.devices)

        for engine in self.engines:
            if engine.name in self.busy:
                continue
            if engine.state is State.FAILED and engine.name not in self.handled:
                decisions.append(Decision("failed", engine, engine.failure or f"engine {engine.name} failed"))
            elif engine.state is State.AWAKE and engine.gate.needs_restart:
                if clear(engine, boots=True):
                    decisions.append(Decision("restart", engine, engine.gate.needs_restart))
                    started(engine, boots=True)
            elif engine.state is State.AWAKE:
                self._grant(engine)
        moving = {d.engine.name for d in decisions}
        for decision in self.roster_decisions():
            if decision.engine.name not in moving and clear(decision.engine):
                decisions.append(decision)
                started(decision.engine)
        ledger = self.ledger()
        moving = {d.engine.name for d in decisions}
        waits: list[float] = []
        for target, oldest in self._targets(now, moving):
            boots = target.state in (State.COLD, State.FAILED)
            first = target.name in self.startup  # its first boot since start: no swap, so not in the swap history
            if not clear(target, boots):
                self.note_wait(target, now, oldest, booting)
                continue
            if first and placement.never_fits(self.engines, target) is not None:
                decisions.append(Decision("boot", target, "it can never fit"))  # the boot fails, saying why
                moving.add(target.name)
                continue
            victims, wait_s = self._make_room(ledger, target, oldest, now, moving)
            if victims is None:
                self.note_wait(target, now, oldest)
                if wait_s is not None:
                    waits.append(wait_s)
                continue
            ledger.reserve(target)  # first: a demotion passing through the GPU must not take its room
            moves = [d for victim in victims for d in self._move(victim, f"room {'to boot' if first else 'for'} {target.name}",
                                                                   ledger, now, batch=self.yields_to_users(target))]
            if not all(clear(d.engine) for d in moves):
                self.note_wait(target, now, oldest)
                continue
            moving.add(target.name)
            self.note_wait(target, now, oldest, started=True)
            if moves:
                self.making_room[target.name] = ([v.engine.name for v in victims], self.clock())
                decisions += moves
                for move in moves:
                    moving.add(move.engine.name)
                    started(move.engine)
            else:
                decisions.append(Decision("boot" if first else "wake", target, f"{self.queued(target)} waiting"))
                started(target, boots)
        for sleeper, passes, why in self.over_budget(ledger, moving, now):  # a first guess measured too low
            if clear(sleeper):
                decisions.append(Decision("demote" if passes else "stop", sleeper, why))
                moving.add(sleeper.name)
                started(sleeper)
        idle = self.swap.idle_sleep_s
        for engine in self.engines:
            if idle is None or engine.name in moving or engine.name in self.busy or engine.state is not State.AWAKE \
                    or engine.spec.pin or engine.in_flight or not clear(engine):
                continue
            idle_for, awake_for = now - engine.last_used, now - engine.since
            if idle_for >= idle and awake_for >= self.swap.min_active_s:
                moves = self._move(Victim(engine, "park", {}, 0.0), f"idle for {idle_for:.0f} s", ledger, now)
                if all(clear(d.engine) for d in moves):
                    self.quiet_since[engine.name] = now  # not woken ahead again before someone asks for it
                    decisions += moves
                    for move in moves:
                        started(move.engine)
            else:
                waits.append(max(idle - idle_for, self.swap.min_active_s - awake_for, 0.01))
        for decision in self.ahead_decisions(ledger, now, moving, clear):
            decisions.append(decision)
            moving.add(decision.engine.name)
            started(decision.engine)
        return Plan(tuple(decisions), min(waits) if waits and not decisions else None)

    def _forget_abandoned_rooms(self) -> None:
        """Promise 5: no `making_room` entry outlives its waiters. Room is made for a target until its wake
        takes the entry; one whose waiters all left (or that left the roster) never wakes, and its entry
        would keep wake-ahead off its GPUs, staging and the host-RAM sums treating it as about to wake,
        and its name in a table whose engine a reload removed. It goes once its victims' actions end
        (while they run, it is what keeps their room from being counted twice), or at once when the
        target left the roster."""
        engines = {e.name: e for e in self.engines}
        for name, (victims, _) in list(self.making_room.items()):
            target = engines.get(name)
            if target is None or not (self.waiting.get(name) or self._boots_unasked(target)
                                      or any(v in self.busy for v in victims)):
                del self.making_room[name]

    def _boots_unasked(self, engine: Engine) -> bool:
        """A boot nobody asked for, made room for like a waiter's: at start, or new in a reload."""
        return engine.state is State.COLD and (engine.name in self.to_boot or engine.name in self.startup)

    def _targets(self, now: float, moving: set[str]) -> list[tuple[Engine, float]]:
        """Engines with waiters that are not awake, oldest waiter first; then those to boot in the
        background (at start, or new in a reload), as if asked for just now (so no busy engine is
        ever parked for them), in `boot_order`."""
        out = []
        for engine in self.engines:
            queue = self.waiting[engine.name]
            if not (queue or self._boots_unasked(engine)) or engine.name in self.busy or engine.name in moving \
                    or engine.state is State.AWAKE:
                continue
            if self.backoff.waiting(engine, now):
                self._fail_waiters(engine, self.backoff.unavailable(engine))
                continue
            out.append((engine, queue[0].since if queue else now))
        order = {e.name: i for i, e in enumerate(sorted(self.engines, key=boot_order))}
        # A target only batch requests wait for ranks after every target someone interactive waits for,
        # however old its waiters: its room is the interactive ones' to take first.
        return sorted(out, key=lambda pair: (not self.waiting[pair[0].name], self.batch_only(pair[0]), pair[1],
                                             order[pair[0].name]))

    def _make_room(self, ledger: Ledger, target: Engine, oldest: float, now: float,
                   moving: set[str]) -> tuple[Optional[list[Victim]], Optional[float]]:
        """The victims to move so `target` can wake ([]: it fits), or (None, seconds to look again)."""
        pending, _ = self.making_room.get(target.name, ([], 0.0))
        if any(name in self.busy for name in pending):
            return None, None  # its room is still being made; the action's end pokes
        why = placement.never_fits(self.engines, target)
        if why is not None:
            self._fail_waiters(target, APIError(503, f"model '{target.name}' cannot be placed: {why}", "model_not_ready"))
            return None, None
        waits: list[float] = []
        forced, candidates, blocked = [], [], False
        # For work that yields to users, an engine with interactive demand is no victim (a group rival holding its
        # share blocks it).
        batch = self.yields_to_users(target)
        wake_s = self._target_wake_s(target) if batch else 0.0
        held: list[str] = []
        held_waits: list[float] = []  # when a hold ends by time alone (interactive_hold_s): look again then
        self.held_by.pop(target.name, None)
        # A sleeper with waiters of its own is a target itself: stopping it makes them wait out a boot.
        # It is offered only when nothing else on these GPUs is awake or on its way: no park will ever make the room.
        room_can_come = any(e is not target and not e.spec.pin and set(e.spec.devices) & set(target.spec.devices)
                            and e.state not in (State.SLEEPING, State.COLD, State.FAILED) for e in self.engines)
        for engine in self.engines:
            if engine is target or engine.spec.pin:
                continue
            rival = target.spec.group is not None and engine.spec.group == target.spec.group
            demand, ends_in = self.interactive_demand(engine, now, wake_s) if batch else (None, 0.0)
            if demand is not None:
                if set(engine.spec.devices) & set(target.spec.devices) or rival:
                    held.append(demand)
                    if ends_in:
                        held_waits.append(ends_in)
                blocked |= rival and (engine.state in placement.HOLDS_SHARE or engine.name in ledger.reserved
                                      or engine.name in self.busy)
                continue
            if engine.name in self.busy or engine.name in moving:
                blocked |= rival and (engine.state in placement.HOLDS_SHARE or engine.name in ledger.reserved)
                if not rival and self.doing.get(engine.name, ("",))[0] in ("boot", "wake"):  # parkable once awake a while
                    _, started, predicted = self.doing[engine.name]
                    ready_in = max(0.0, started + predicted - now) + self.swap.min_active_s
                    candidates.append(Victim(engine, "park", ledger.parked_frees(engine), self.cost(engine, "park", now),
                                             False, max(ready_in, 0.01)))
                continue
            if engine.state is State.SLEEPING and not (room_can_come and self.waiting[engine.name]):
                candidates += self._sleeper_offers(ledger, engine, now)
            elif engine.state is State.AWAKE:
                preempt = not batch and self.preemptible(engine)  # a user need not wait out batch work's hold or drain
                ready_in = self._evictable_in(engine, oldest, now, preempt)
                if ready_in > 0:
                    waits.append(ready_in)
                    blocked |= rival
                offers = self._park_offers(ledger, engine, now, engine.in_flight > 0, ready_in, rival)
                if preempt:
                    lost = self.preempt_cost(engine, now)
                    offers = [dataclasses.replace(v, cost=v.cost + lost) for v in offers]
                (forced if rival else candidates).extend(offers)
        if held:
            self.held_by[target.name] = "interactive demand keeps the room: " + "; ".join(held)
        if blocked:
            return None, min(waits + held_waits, default=None)
        now_idle = [v for v in candidates if not v.ready_in and not v.busy]
        now_any = [v for v in candidates if not v.ready_in]
        tiers = [now_idle, now_any]
        if not self.queued(target):  # a boot nobody asked for parks the roster's defaults last: they are meant to stay awake
            tiers.insert(0, [v for v in now_idle if not v.engine.spec.default])
        chosen = next((c for c in (placement.cheapest(ledger, target, tier, forced) for tier in tiers) if c is not None), None)
        # Parks of busy engines, now or soon (min_active_s, max_hold_s), may beat stopping idle sleepers:
        # a stop turns a sleeper's next wake into a cold boot, while waiting for a park (and for its
        # requests to drain) costs the waiters and whoever asks for the target meanwhile.
        later = placement.cheapest(ledger, target, [v for v in candidates if v.action == "park"], forced)
        later_wait = max((v.ready_in for v in later or ()), default=0.0)
        drain = max((self.costs.drain_s(v.engine.name, self.swap.drain_timeout_s) for v in later or ()
                     if v.busy and (batch or not self.preemptible(v.engine))), default=0.0)  # a preemption has no drain
        waiting_cost = self.waited(target, later_wait + drain, now, asking=self.queued(target)) + sum(v.cost for v in later or ())
        stops = chosen is not None and any(v.action == "stop" for v in chosen)
        chosen_cost = sum(v.cost for v in chosen or ())
        if chosen is not None and not (stops and later and waiting_cost < chosen_cost):
            if stops:  # the numbers an operator needs to see why a sleeper lost its process
                why = f"expected to cost {chosen_cost:.1f} s of waiting" + (
                    f", against {waiting_cost:.1f} s for waiting {later_wait + drain:.1f} s to park "
                    + ", ".join(v.engine.name for v in later) if later else "")
                chosen = [dataclasses.replace(v, why=why) if v.action == "stop" else v for v in chosen]
            return forced + chosen, None
        if later and not later_wait:  # busy engines whose hold is over: their drain beats the stops
            return forced + later, None
        wait = later_wait if later else min(waits, default=None)
        return None, min(held_waits + ([] if wait is None else [wait]), default=None)

    def _preempt(self, victim: Victim, why: str, ledger: Ledger, now: float) -> list[Decision]:
        """A batch-only engine's move for a user's waiter: its streams are cut at once (`preempted`), paused and
        resumed later as batch waiters of its model, instead of drained."""
        why = f"preempt {victim.engine.in_flight} batch request(s) of {victim.engine.name}: {why}"
        return [dataclasses.replace(d, preempt=True) if d.engine is victim.engine else d
                for d in self._move(victim, why, ledger, now, batch=False, preempt=True)]

    def _move(self, victim: Victim, why: str, ledger: Ledger, now: float, batch: bool = True,
              preempt: bool = False) -> list[Decision]:
        """The decisions that move `victim`: its park, and the Level-1 sleepers demoted for its host RAM
        (`batch`: the move yields to users, as all but room for a user's waiter do: it demotes no sleeper with
        interactive demand)."""
        engine = victim.engine
        if not batch and not preempt and engine.state is State.AWAKE and self.preemptible(engine):
            return self._preempt(victim, why, ledger, now)
        if victim.action == "stop":
            return [Decision("stop", engine, f"{why} ({victim.why})" if victim.why else why)]
        if victim.action == "deepen":
            level = victim.level  # offered for the host RAM as it was: another move of this round may have taken it
            if level == 1 and self.level1_gb(exclude={engine.name}, ledger=ledger) + (self.level1_need_gb(engine) or 0.0) \
                    > self.capacity.ram_budget_gb:
                level = 2 if engine.spec.reloads_weights else None
            self.plan_level1(ledger, engine, level, ())
            if level is None:
                return [Decision("stop", engine, f"{why}; no room for it at level 1 in host RAM, and {self.no_level2(engine)}")]
            return [Decision("deepen", engine, f"{why}; its weights' room, down to level {level}", level)]
        if victim.level == KV_PARKED:
            return [Decision("park", engine, f"{why}; its KV cache only (level 0)", KV_PARKED)]
        back = self.ahead_level(engine)
        level, demoted = (back, []) if back is not None else self._choose_level(engine, now, waking=ledger.reserved,
                                                                                 ledger=ledger, batch=batch)
        reason = self.level_reason(engine, level, ledger)
        self.plan_level1(ledger, engine, level, demoted)
        if level is None:
            numbers = f"; {reason}" if reason else ""
            return [Decision("stop", engine, f"{why}; no room for it at level 1 in host RAM, and "
                                             f"{self.no_level2(engine)}{numbers}")]
        # The count takes a running demotion or stop as done: a Level-1 copy waits until it is.
        freeing = [e.name for e in self.engines if self.doing.get(e.name, ("",))[0] in ("demote", "stop")
                   and self._host_now_gb(e) > 0] if level == 1 else []
        out = [Decision("park", engine, f"{why}; level {level}: {reason}" if reason else why, level,
                        after=(*(sleeper.name for sleeper in demoted), *freeing))]
        for sleeper in demoted:  # host RAM for Level 1 is short: the less valuable sleeper makes way
            passes = self.passes_through(sleeper, ledger)
            if passes:
                ledger.reserve(sleeper)
            out.append(Decision("demote" if passes else "stop", sleeper, f"host RAM for {engine.name} at level 1"
                                + ("" if sleeper.spec.reloads_weights else f", and {NO_LEVEL2}")))
        return out


def boot_order(engine: Engine) -> tuple[bool, bool]:
    """The order engines boot in when none is asked for: pinned ones first, `default` ones last (so
    those are the ones left awake when not all fit), else the roster's order."""
    return (not engine.spec.pin, engine.spec.default)
