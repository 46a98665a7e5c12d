"""What moving an engine out of the way costs, the ways it can move (its offers), and the level it would sleep at.

The cost part of `Scheduler` (see `router.scheduling.state`): an engine's expected cost is the waiting its
absence is likely to cause: the likelihood it is asked for again (from `router.scheduling.estimates`)
times the waiting its predicted wake makes (`waited`: every request that arrives while the wake runs
waits for it too). `sleep_level: auto` picks Level 1 while the host-RAM budget holds what the engines
hold for sleep (measured after every sleep and wake, `engines.memory.host`; estimated until then), and
makes RAM for a more valuable engine by demoting a Level-1 sleeper. A Level-2 wake is priced staged
when it will likely be (its checkpoint within host.page_cache_budget_gb: `staged_next`).

The KV tier (level 0, engines/waking/ladder.py) is not a level `_choose_level` picks: it frees less, so
whether it is enough depends on the waiter. The scheduler offers it beside the full park as a
victim of its own ("kv_park"), and a KV-parked sleeper a move further down ("deepen"); placement's
`cheapest` takes whichever makes the room at the least expected cost.
"""

from __future__ import annotations

import logging
import math
from typing import Collection, Optional

from engines.engine import Engine, State
from engines.memory import PRIOR_FACTOR
from engines.waking import KV_PARKED
from router.scheduling.history import SWAP
from router.scheduling.placement import Ledger, Victim
from router.scheduling.state import SchedulerState

log = logging.getLogger("hotswap")


NO_LEVEL2 = "its --load-format cannot reload weights from disk, so it never sleeps at level 2 (docs/operators.md)"


class Costs(SchedulerState):
    @property
    def reuse_horizon_s(self) -> float:
        return self.swap.reuse_horizon_s

    def cost(self, engine: Engine, action: str, now: float) -> float:
        """What placement ranks victims by. bench/placement.py replaces it on the instance (LRU)."""
        return self.expected_cost(engine, action, now)

    def _park_offers(self, ledger: Ledger, engine: Engine, now: float, busy: bool, ready_in: float,
                     rival: bool) -> list[Victim]:
        """The ways an awake engine can make room: a full park (at the level `_move` chooses) and, where
        the KV tier is known to fit (placement's `kv_offered`), a KV park, first (the cheaper wake, when both
        are enough). A rival in the waiter's group must leave its share, so it is offered the full park only.
        A `sleep_level: 0` engine whose KV park cannot be sized (weights or GPU sizes unknown) frees nothing
        placement can count: it is offered a stop instead, as when its weights' room is needed."""
        fixed_kv = engine.spec.sleep_level == KV_PARKED
        if fixed_kv and not ledger.kv_offered(engine):
            return [Victim(engine, "stop", ledger.stopped_frees(engine), self.cost(engine, "stop", now), busy, ready_in)]
        full = Victim(engine, "park", ledger.parked_frees(engine, KV_PARKED if fixed_kv else None),
                      self.cost(engine, "park", now), busy, ready_in)
        if rival or engine.spec.sleep_level != "auto" or not ledger.kv_offered(engine):
            return [full]
        kv = Victim(engine, "park", ledger.parked_frees(engine, KV_PARKED), self.cost(engine, "kv_park", now), busy,
                    ready_in, level=KV_PARKED)
        return [kv, full]

    def preempt_cost(self, engine: Engine, now: float) -> float:
        """Seconds of waiting a preemption of `engine`'s batch streams costs them: each waits at least its
        engine's wake back (as predicted, from the level it would park at), and all of what they had (prompt
        plus tokens generated so far) is computed again at the engine's prefill rate (`WakeCosts.prefill_s`)."""
        level, _ = self._choose_level(engine, now)
        recompute = self.costs.prefill_s(engine.name, engine.leases.tokens_in_flight())
        return engine.in_flight * self._next_wake_s(engine, level) + recompute

    def _sleeper_offers(self, ledger: Ledger, engine: Engine, now: float) -> list[Victim]:
        """A sleeper can be stopped; a KV-parked one can also go down a rung, freeing its weights but
        keeping its process (and its next wake short of a boot)."""
        stop = Victim(engine, "stop", ledger.stopped_frees(engine), self.cost(engine, "stop", now))
        level = self.deeper_level(engine, now) if engine.sleep_level == KV_PARKED else None
        if level is None:
            return [stop]
        return [Victim(engine, "deepen", ledger.deepened_frees(engine), self.cost(engine, "deepen", now), level=level), stop]

    def _level_alone(self, engine: Engine) -> Optional[int]:
        """The level for a park outside the loop's planning (an admin sleep): Level 1 only if it fits
        in host RAM as it is, without demoting anyone (None: stop it instead)."""
        return self._choose_level(engine, self.clock())[0]

    def _choose_level(self, engine: Engine, now: float, waking: Collection[str] = (),
                      ledger: Optional[Ledger] = None, batch: bool = False) -> tuple[Optional[int], list[Engine]]:
        """The level to park `engine` at, and the Level-1 sleepers to demote to make RAM for it.
        `waking`: engines about to wake, never demoted for it (their room is being made). `ledger`:
        the GPU as planned, to tell a sleeper that can pass through it to Level 2 from one that
        would have to be stopped (and pay a cold boot later); without one, demote nobody. `batch`: it
        makes room for a target only batch requests wait for, so no sleeper with interactive demand goes.
        None: not Level 1, and not Level 2 either (its --load-format cannot reload from disk, or its
        sleep_level is 1): it is stopped, and boots cold when next needed."""
        fixed = engine.spec.sleep_level != "auto"
        if fixed and engine.spec.sleep_level != 1:
            return engine.spec.sleep_level, []
        # A fixed Level 1 keeps to the budget too: where the RAM cannot be made, a stop is its only way out.
        otherwise = 2 if not fixed and engine.spec.reloads_weights else None
        need = self.level1_need_gb(engine)
        if need is None:
            return (1 if fixed else otherwise), []  # unsized: measured after its sleep, and held to the budget then
        # Engines about to wake still count: their copy goes only once their wake ends, after this park has
        # copied out beside it (the wake waits for the room this park makes).
        used = self.level1_gb(exclude={engine.name}, ledger=ledger)
        budget = self.capacity.ram_budget_gb
        if used + need <= budget:
            return 1, []
        if ledger is None:
            return otherwise, []
        mine = self._level1_value(engine, now, passes=otherwise == 2)

        def value(sleeper: Engine) -> float:
            return self._level1_value(sleeper, now, passes=self.passes_through(sleeper, ledger))

        sleepers = sorted((e for e in self.engines if e.state is State.SLEEPING and e.sleep_level == 1
                           and e.name not in self.busy and e.name not in waking and not e.spec.pin
                           and e.name not in ledger.host_planned  # already moved this round
                           and not (batch and self.interactive_demand(e, now)[0])), key=value)
        chosen: list[Engine] = []
        lost = 0.0  # what the demotions chosen so far cost, together
        for sleeper in sleepers:
            lost += value(sleeper)
            if lost >= mine:
                break
            chosen.append(sleeper)
            used -= self.host_gb(sleeper)  # a demotion empties its host cache, a stop ends its process
            if used + need <= budget:
                return 1, chosen
        return otherwise, []

    def _releasing(self, waking: Collection[str]) -> set[str]:
        """Of the engines about to wake, those whose wake empties their host cache (the worker extension)."""
        return {e.name for e in self.engines if e.name in waking and e.host.releases}

    def level_reason(self, engine: Engine, level: Optional[int], ledger: Optional[Ledger] = None) -> str:
        """Why an `auto` engine parks at `level` (or an `auto` or `1` one stops, None) rather than Level 1,
        with the numbers; kept for /admin/status. Empty for Level 1 and for any other fixed level."""
        reason = "" if level == 1 or engine.spec.sleep_level not in ("auto", 1) else self.level1_why(engine, ledger)
        self.host_why[engine.name] = reason or None
        # An unknown size was said once at start (sizing.level1_weights); every park need not repeat it.
        return reason if self.level1_need_gb(engine) is not None else ""

    def over_budget(self, ledger: Ledger, moving: Collection[str], now: float) -> list[tuple[Engine, bool, str]]:
        """When what the engines hold for sleep, as measured, is over host.ram_budget_gb (a Level-1 sleep
        that held more than its first guess): the least valuable Level-1 sleepers to demote (True) or stop
        (False) until it is not. An awake engine's cached copy is not moved: only its stop would free it. Nor
        is a sleeper with interactive demand: the park that overshot may have been batch work's, and once it
        ends its own copy (at least the excess) can go instead."""
        budget = self.capacity.ram_budget_gb
        # Engines whose wake is under way or waits for its room give their copy back once woken: an excess
        # they make ends with that wake, and moving a sleeper for it would cost its next wake for nothing.
        waking = {n for n in self.making_room} | {n for n, (action, *_) in self.doing.items() if action == "wake"}
        excess = self.level1_gb(exclude=self._releasing(waking)) - budget
        if excess <= 0:
            return []
        sleepers = sorted((e for e in self.engines if e.state is State.SLEEPING and e.sleep_level == 1 and not e.spec.pin
                           and e.name not in self.busy and e.name not in moving and e.name not in waking
                           and self.host_gb(e) > 0 and not self.interactive_demand(e, now)[0]),
                          key=lambda e: self._level1_value(e, now, passes=self.passes_through(e, ledger)))
        out = []
        for sleeper in sleepers:
            if excess <= 0:
                break
            passes = self.passes_through(sleeper, ledger)
            if passes:
                ledger.reserve(sleeper)  # it passes through the GPU on its way to Level 2
            out.append((sleeper, passes, f"host RAM over host.ram_budget_gb={budget:g} by measurement: the engines hold "
                                         f"{excess + budget:.2f} GB for sleep, {self.host_gb(sleeper):.2f} GB of it {sleeper.name}'s"
                                         + ("" if sleeper.spec.reloads_weights else f", and {NO_LEVEL2}")))
            excess -= self.host_gb(sleeper)
        return out

    @staticmethod
    def no_level2(engine: Engine) -> str:
        """Why `engine`, refused Level 1, cannot sleep at Level 2 instead (for the log)."""
        return "its sleep_level: 1 rules out level 2" if engine.spec.sleep_level == 1 else NO_LEVEL2

    def passes_through(self, sleeper: Engine, ledger: Ledger) -> bool:
        """Whether demoting a Level-1 sleeper (through the GPU to Level 2) gives its host RAM back: the GPU
        has room for it, it can reload, and a Level-1 wake empties its host cache (the worker extension);
        else only stopping it does."""
        return ledger.fits(sleeper) and sleeper.spec.reloads_weights and sleeper.host.releases

    # -- host RAM: what the engines hold for sleep (measured, else estimated) -----------------------------

    def level1_gb(self, exclude: Collection[str] = (), ledger: Optional[Ledger] = None) -> float:
        """Host RAM the engines hold for sleep, or are about to (what host.ram_budget_gb bounds):
        Level-1 copies, and what stays cached after a wake. `exclude`: engines left out. `ledger`: the round
        being planned, whose moves count as made (`Ledger.host_planned`)."""
        planned = ledger.host_planned if ledger is not None else {}
        return sum(planned.get(e.name, self.host_gb(e)) for e in self.engines if e.name not in exclude)

    def plan_level1(self, ledger: Ledger, engine: Engine, level: Optional[int], demoted: Collection[Engine]) -> None:
        """Count in `ledger` what parking `engine` at `level`, and demoting or stopping `demoted`, will hold."""
        if level == 1:
            ledger.host_planned[engine.name] = max(self.host_gb(engine), self.level1_need_gb(engine) or 0.0)
        elif level is None:  # stopped
            ledger.host_planned[engine.name] = 0.0
        for sleeper in demoted:
            ledger.host_planned[sleeper.name] = 0.0

    def host_gb(self, engine: Engine) -> float:
        """What the budget counts for `engine`: as its running action will leave it, else as last measured,
        else its estimate while it may hold a Level-1 copy."""
        action = self.doing.get(engine.name, ("",))[0]
        if action == "stop" or engine.state is State.COLD or (engine.state is State.FAILED and not engine.holds_process):
            return 0.0  # no process, nothing held (its last measurement is of a process that is gone)
        if action == "demote":  # chosen only where the wake empties the cache (passes_through)
            return 0.0
        now = self._host_now_gb(engine)
        if action in ("park", "deepen", "sleep") and self.parking_level.get(engine.name) == 1:
            return max(now, self.level1_need_gb(engine) or 0.0)
        return now

    def _host_now_gb(self, engine: Engine) -> float:
        if engine.host.held_gb is not None:
            return engine.host.held_gb
        if engine.host.level1_copy or (engine.state is State.SLEEPING and engine.sleep_level == 1):
            return self.level1_estimate_gb(engine) or 0.0
        return 0.0

    def level1_need_gb(self, engine: Engine) -> Optional[float]:
        """What parking `engine` at Level 1 would have it hold: its last Level-1 sleep's measurement, else
        the estimate (None: neither known, so not Level 1). Not less than it holds already."""
        measured = engine.host.level1_gb
        need = measured if measured is not None else self.level1_estimate_gb(engine)
        return None if need is None else max(need, engine.host.held_gb or 0.0)

    def level1_estimate_gb(self, engine: Engine) -> Optional[float]:
        """The first guess: the checkpoint × PRIOR_FACTOR (engines/memory/host.py says why that factor)."""
        weights = self.weights.get(engine.name)
        return None if weights is None else weights * PRIOR_FACTOR

    def level1_why(self, engine: Engine, ledger: Optional[Ledger] = None) -> str:
        """The numbers behind a Level-1 refusal, for the log and /admin/status."""
        need, measured = self.level1_need_gb(engine), engine.host.level1_gb is not None
        if need is None:
            return f"its weights' size is unknown ({engine.name}: set weights_gb), so level 1 cannot be sized"
        others = self.level1_gb(exclude={engine.name}, ledger=ledger)
        how = "measured at its last level-1 sleep" if measured else \
            f"estimated: {self.weights.get(engine.name) or 0:.2f} GB checkpoint x {PRIOR_FACTOR:g}"
        return (f"host RAM for level 1: it would hold {need:.2f} GB ({how}) beside {others:.2f} GB the others hold "
                f"for sleep, over host.ram_budget_gb={self.capacity.ram_budget_gb:g}")

    def staged_next(self, engine: Engine) -> bool:
        """Whether `engine`'s next Level-2 wake will likely find its checkpoint staged: it is staged now, or
        it stages and its checkpoint fits host.page_cache_budget_gb, so the staging ahead keeps it in the
        page cache while it is among the likeliest to be asked for (router/scheduling/staging.py)."""
        if engine.stager.staged:
            return True
        gb = self.weights.get(engine.name)
        return engine.stager.enabled and gb is not None and 0 < gb <= self.capacity.page_cache_gb

    def _level1_value(self, engine: Engine, now: float, passes: bool) -> float:
        """Expected seconds of waiting that keeping `engine` at Level 1 saves: over a Level-2 wake
        when it can pass through the GPU to Level 2 (`passes`), else over the cold boot a stop costs."""
        instead = self._next_wake_s(engine, 2 if passes else None)
        return self._reuse(engine, now) * max(self.waited(engine, instead, now)
                                              - self.waited(engine, self.costs.wake_s(engine.name, 1), now), 0.0)

    def _reuse(self, engine: Engine, now: float, within_s: Optional[float] = None) -> float:
        """How likely `engine` is to be asked for within reuse_horizon_s (or `within_s`)."""
        return 1.0 - math.exp(-self.demand.rate(engine.name, now) * (within_s or self.reuse_horizon_s))

    def waited(self, engine: Engine, seconds: float, now: float, asking: int = 1) -> float:
        """Seconds of waiting that `seconds` before `engine` can answer cost once `asking` requests ask for
        it: those wait them all, and each one its demand sends meanwhile waits half of them on average.
        A 50 s boot of a model asked for once every 5 s costs its requests 300 s, not 50."""
        seconds = max(seconds, 0.0)
        return seconds * (asking + self.demand.rate(engine.name, now) * seconds / 2)

    def blocked_by_boot(self, engine: Engine, now: float) -> float:
        """Expected seconds the others on its devices wait behind a cold boot of `engine`: a boot has its
        devices to itself (`boot_devices`), so no wake starts there until it ends. Every request a neighbour
        that is not awake is sent meanwhile (at its own demand's rate) waits out the rest of the boot
        (`waited` with nobody asking yet): a busy neighbour's burst queues behind it, not only its first
        request. An awake neighbour answers during the boot."""
        boot = self.costs.boot_s(engine.name)
        mine = set(engine.spec.devices)
        return sum(self.waited(other, boot, now, asking=0) for other in self.engines
                   if other is not engine and not other.spec.pin and other.state is not State.AWAKE
                   and mine & set(other.spec.devices))

    def _next_wake_s(self, engine: Engine, level: Optional[int]) -> float:
        """Its predicted wake from `level` (None: a boot), staged where its next one likely will be."""
        return self.costs.wake_s(engine.name, level, level == 2 and self.staged_next(engine))

    def _target_wake_s(self, target: Engine) -> float:
        """How long `target` would take to answer were its room made now: its wake, or a boot."""
        if target.state in (State.COLD, State.FAILED):
            return self.costs.boot_s(target.name)
        return self._next_wake_s(target, target.sleep_level)

    def deeper_level(self, engine: Engine, now: float) -> Optional[int]:
        """The rung a KV-parked `engine` goes down to when its weights' room is needed: what a full park
        would choose now (Level 1 while host RAM holds it as it is, else 2); None: neither (a stop)."""
        if engine.spec.sleep_level != "auto":
            return None  # a fixed level 0 is never taken further: it is stopped
        return self._choose_level(engine, now)[0]

    def expected_cost(self, engine: Engine, action: str, now: float) -> float:
        """Seconds of waiting that moving `engine` out of the way is expected to cost later:
        the waiting its predicted wake makes (or, stopped, its boot beyond its wake) times the chance it
        is needed again soon; a cold boot also counts what it makes the others on its devices wait. "kv_park": a
        KV park's wake; "deepen": a KV-parked engine's wake from the rung below beyond its KV wake. Ties
        go to the least recently used."""
        if action == "stop":  # a sleeper's: the boot beyond the wake it would have had; an awake one's: the whole boot
            level = engine.sleep_level
            wake = 0.0 if level is None else self._next_wake_s(engine, level)
            extra = self.waited(engine, self.costs.boot_s(engine.name), now) - self.waited(engine, wake, now) \
                + self.blocked_by_boot(engine, now)
        elif action == "kv_park":
            extra = self.waited(engine, self.costs.wake_s(engine.name, KV_PARKED), now)
        elif action == "deepen":
            extra = self.waited(engine, self._next_wake_s(engine, self.deeper_level(engine, now)), now) \
                - self.waited(engine, self.costs.wake_s(engine.name, KV_PARKED), now)
        else:
            level, _ = self._choose_level(engine, now)
            extra = self.waited(engine, self._next_wake_s(engine, level), now) \
                + (self.blocked_by_boot(engine, now) if level is None else 0.0)
        recency = 1e-9 / (1.0 + max(0.0, now - self.demand.last(engine.name)))  # a tie-break only
        # A park's wake may never be waited for: room that frees wakes it ahead of demand. A stopped
        # engine is never booted ahead, so its boot is paid by its next request however late that
        # comes: its chance is of any request while its demand is remembered, not of one soon.
        within = self.swap.demand_tau_s if action == "stop" else None
        return self._reuse(engine, now, within) * max(extra, 0.0) + recency

    # -- holds: when an awake engine may be moved, and why a waiter is not served yet ----------------

    def _evictable_in(self, engine: Engine, oldest: float, now: float, preempt: bool = False) -> float:
        """Seconds until an awake engine may be parked for a waiter that arrived at `oldest` (0: now).
        min_active_s protects a wake someone asked for: an engine booted in the background and not
        used since is parked at once (as the latest booted was while the roster booted). `preempt`: its
        work is batch only and the waiter is a user's, so max_hold_s does not hold it (min_active_s still
        does: it is what keeps a model from being swapped out as it arrives, whoever asked for it)."""
        return self._hold(engine, oldest, now, preempt)[0]

    def _hold(self, engine: Engine, oldest: float, now: float, preempt: bool = False) -> tuple[float, str]:
        """`_evictable_in`'s seconds, and which rule holds the engine for them: min_active or max_hold."""
        unclaimed = engine.last_used < engine.since and not engine.in_flight
        wait, rule = (0.0 if unclaimed else self.swap.min_active_s - (now - engine.since)), "min_active"
        if engine.in_flight and not preempt and oldest + self.swap.max_hold_s - now > wait:
            wait, rule = oldest + self.swap.max_hold_s - now, "max_hold"
        return max(wait, 0.0), rule

    def note_wait(self, target: Engine, now: float, oldest: float, booting: Collection[int] = (),
                  started: bool = False) -> None:
        """Record why `target`'s waiters are not served at this look of the loop (`started`: its wake, boot
        or the parks for it begin now), for their activity records (history.WaitParts), and log a hold once,
        when it begins. Only recorded: no decision reads it."""
        if not self.waiting[target.name]:
            return  # a boot in the background: nobody waits
        reason, why = self._why_waiting(target, now, oldest, set(booting), started)
        if self.wait_parts.note(target.name, reason, now, why) and why:
            log.info("%s: %d request(s) waiting are held (%s): %s", target.name, self.queued(target), reason, why)

    def _why_waiting(self, target: Engine, now: float, oldest: float, booting: set[int], started: bool) -> tuple[str, str]:
        """The reason (history.py's names) and its words, read from the state `decide` just read: its own swap
        under way, a boot on its GPUs, batch yielding to users (`held_by`, set by `_make_room` this pass), the
        awake engine in its way whose hold ends first (`_hold`), another engine's action, else the queue."""
        pending, _ = self.making_room.get(target.name, ([], 0.0))
        if started or any(name in self.busy for name in pending):
            return SWAP, ""
        devices = set(target.spec.devices)

        def near(e: Engine) -> bool:  # shares a GPU with the target, or its group
            return e is not target and (bool(devices & set(e.spec.devices))
                                        or (target.spec.group is not None and e.spec.group == target.spec.group))

        if devices & booting:
            other = next((e.name for e in self.engines if near(e) and e.name in self.boots), "another engine")
            return "boot", (f"'{other}' is booting on its GPU(s), which it has to itself until it has booted "
                            "(vLLM sizes its KV cache from the memory free meanwhile)")
        if target.name in self.held_by:
            return "interactive", f"batch work yields to users: {self.held_by[target.name]}"
        preempt_ok = not self.yields_to_users(target)
        holds = [(*self._hold(e, oldest, now, preempt_ok and self.preemptible(e)), e) for e in self.engines
                 if near(e) and not e.spec.pin and e.state is State.AWAKE and e.name not in self.busy]
        holds = [h for h in holds if h[0] > 0]
        if holds:
            seconds, rule, e = min(holds, key=lambda h: h[0])
            if rule == "min_active":
                return rule, (f"'{e.name}' has been awake {now - e.since:.1f} s, under swap.min_active_s="
                              f"{self.swap.min_active_s:g}: it may be parked for them in {seconds:.1f} s")
            return rule, (f"'{e.name}' is serving {e.in_flight} request(s), parked for them once the oldest has waited "
                          f"swap.max_hold_s={self.swap.max_hold_s:g}, in {seconds:.1f} s")
        other = next((e for e in self.engines if near(e) and e.name in self.busy), None)
        if other is not None:
            action = self.doing.get(other.name, ("an action",))[0]
            return "other_wake", f"'{other.name}' has a {action} under way on its GPU(s)"
        return "queue", ""
