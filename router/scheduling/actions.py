"""What the scheduler does, as opposed to what it decides: boot, wake, park, deepen (a KV-parked
engine a rung further down), stop, demote, restart, and the bookkeeping of failures. Each action runs as its own task, owns its engine
until it ends, and contains whatever goes wrong to that engine.

`Actions` is the action part of `Scheduler` (see `router.scheduling.state`); the policy is in `scheduler.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional, Union

from engines.engine import Engine, EngineFailed, State
from engines.memory import process_gpu_memory_gb
from engines.waking import KV_PARKED
from router.errors import APIError, for_clients
from router.scheduling import placement
from router.scheduling.costs import Costs
from router.scheduling.history import SwapRecord
from router.scheduling.roster_changes import RosterChanges
from router.scheduling.staging import Staging
from router.scheduling.state import MID_TRANSITION, Decision
from router.tasks import spawn

log = logging.getLogger("hotswap")


class Actions(Costs, RosterChanges, Staging):
    # -- boot --------------------------------------------------------------------------------

    async def _boot(self, engine: Engine) -> None:
        """A first boot since the router started. No swap: nobody waited for it to be moved, and a
        request for it only moves it up the line. Once booted (baseline recorded) it serves, while
        the others may still boot."""
        self.making_room.pop(engine.name, None)
        self.to_boot.discard(engine.name)  # changed in a reload before its first boot: this is that boot
        self.boots_begun += 1
        log.info("booting %s (%d/%d)", engine.name, self.boots_begun, self.startup_total)
        why = placement.never_fits(self.engines, engine)
        if why is not None:
            raise engine.fail(f"boot failed: it cannot be placed: {why}")
        started = time.monotonic()
        await engine.boot()
        self.costs.observe_boot(engine.name, time.monotonic() - started, engine.last_phases.get("gate", 0.0))
        self.backoff.succeeded(engine.name)
        log.info("%s booted in %.1f s", engine.name, time.monotonic() - started)
        self._grant(engine)

    def _boot_ended(self, engine: Engine) -> None:
        self.startup.discard(engine.name)
        if not self.startup and not self.booted:
            self._booted()

    def _booted(self) -> None:
        """Every engine has had its first boot (booted or failed): `router.live` says how it went."""
        self.booted = True
        self.boot_done.set()

    # -- one action ----------------------------------------------------------------------------

    async def _act(self, decision: Decision) -> None:
        engine = decision.engine
        try:
            if decision.action == "boot":
                await self._boot(engine)
            elif decision.action == "wake":
                await self._wake(engine)
            elif decision.action == "park":
                await self._park(engine, decision.why, 2 if decision.level is None else decision.level, decision.after,
                                 decision.preempt)
            elif decision.action == "deepen":
                await self._deepen(engine, decision.why, 2 if decision.level is None else decision.level)
            elif decision.action == "stop":
                await self._stop(engine, decision.why, decision.preempt)
            elif decision.action == "demote":
                await self._demote(engine, decision.why)
            elif decision.action == "retire":
                await self._retire(engine)
            elif decision.action == "respec":
                await self._respec(engine)
            elif decision.action == "restart":
                log.warning("restarting %s now (mid-life acceptance collapse: %s); its requests wait", engine.name, decision.why)
                await self._restart_in_place(engine, "midlife")
            else:
                await self._handle_failure(engine, decision.why)
        except EngineFailed as exc:
            await self._handle_failure(engine, str(exc))
        except Exception as exc:  # a defect: contained to the engine the action concerned
            log.exception("internal error during %s %s", decision.action, engine.name)
            await self._defect(decision.action, exc, engine)
        finally:
            if decision.action == "boot":
                self._boot_ended(engine)
            self._done(engine)

    def _done(self, engine: Engine) -> None:
        self.doing.pop(engine.name, None)
        self.boots.discard(engine.name)
        self.parking_level.pop(engine.name, None)
        future = self.busy.pop(engine.name, None)
        if future is not None and not future.done():
            future.set_result(None)
        self.poke()

    async def _wake(self, target: Engine) -> None:
        swap_id = next(self.swap_ids)
        moved, since = self.making_room.pop(target.name, ([], time.monotonic()))
        started = min(since, time.monotonic())
        level = target.sleep_level if target.state is State.SLEEPING else None
        predicted = self.wake_estimate_s(target, level)
        restart = self.pending_restart.pop(target.name, None)
        self.handled.discard(target.name)
        if target.name in self.to_boot and not self.queued(target):
            log.info("booting %s in the background (new or changed in the roster; predicted %.1f s)", target.name, predicted)
        else:
            log.info("waking %s from %s (%d waiting; predicted %.1f s)", target.name,
                     f"level {level}" if level else target.state.value, self.queued(target), predicted)
        self.to_boot.discard(target.name)
        if self.queued(target):  # a request waited through an operator's sleep: it asked, so that sleep is over
            self.put_to_sleep.discard(target.name)
        woke = time.monotonic()
        # A victim a reload removed since its park has no phases left to report (and no engine to read).
        victims = [e for e in map(self._engine, moved) if e is not None]
        phases = {p: s for victim in victims for p, s in victim.last_phases.items()}
        try:
            if restart is not None:
                await target.restart(restart)
            elif target.state is State.SLEEPING:
                await target.wake()
            elif target.state is State.COLD:
                await target.boot()
            else:
                await target.restart("failed")
        except EngineFailed as exc:
            self._record(swap_id, target, moved, "failed", started, {**phases, **target.last_phases}, predicted, str(exc))
            await self._handle_failure(target, str(exc))
            return
        if level is not None and restart is None:
            reload_s = sum(target.last_phases.get(p, 0.0) for p in ("reload_draft", "reload_weights"))
            self.costs.observe_wake(target.name, level, time.monotonic() - woke, reload_s, target.last_phases.get("wake_weights", 0.0),
                                    stage_s=target.last_phases.get("stage", 0.0), staged=target.stager.found_resident,
                                    cached=target.stager.cached)
        else:
            self.costs.observe_boot(target.name, time.monotonic() - woke, target.last_phases.get("gate", 0.0))
        self.backoff.succeeded(target.name)
        self._grant(target, swap_id)
        self._record(swap_id, target, moved, "ok", started, {**phases, **target.last_phases}, predicted)

    async def _park(self, engine: Engine, why: str, level: int, after: tuple[str, ...] = (), preempt: bool = False) -> None:
        log.info("parking %s at level %d (%s)", engine.name, level, why)
        self.events.evicted(engine, "preempt" if preempt else _reason(why))
        # Its Level-1 copy was given the host RAM those demotions and stops free: copied out before they end,
        # both would be held at once, over host.ram_budget_gb.
        freeing = [self.busy[name] for name in after if name in self.busy]
        if freeing:
            await asyncio.wait(freeing)
        started, serving = time.monotonic(), engine.in_flight > 0 and not preempt  # a preemption's cut is no drain to learn
        await engine.sleep(level, preempt=why if preempt else None)
        self.costs.observe_sleep(engine.name, time.monotonic() - started, engine.last_phases.get("drain") if serving else None)
        self._log_host_memory(engine, level)
        # KV-parked, what its processes hold is its weights besides its residual: not a residual to keep.
        if self.capacity.nvml and level != KV_PARKED:
            await asyncio.to_thread(self._measure_residual, engine)

    async def _deepen(self, engine: Engine, why: str, level: int) -> None:
        log.info("parking %s further, from its KV park down to level %d (%s)", engine.name, level, why)
        self.events.evicted(engine, _reason(why))
        started = time.monotonic()
        await engine.park_further(level)
        self.costs.observe_sleep(engine.name, time.monotonic() - started)
        self._log_host_memory(engine, level)
        if self.capacity.nvml:
            await asyncio.to_thread(self._measure_residual, engine)

    async def _stop(self, engine: Engine, why: str, preempt: bool = False) -> None:
        was = f"asleep at level {engine.sleep_level}" if engine.state is State.SLEEPING else engine.state.value
        log.info("stopping %s (%s): %s; it boots cold when next needed", engine.name, was, why)
        self.events.evicted(engine, "preempt" if preempt else "stop")
        if engine.state is State.AWAKE:  # its requests finish first (or are cut at swap.drain_timeout_s), as before a sleep
            await engine.drain(preempt=why if preempt else None)
        await engine.stop()

    async def _demote(self, engine: Engine, why: str) -> None:
        log.info("demoting %s from level 1 to level 2 (%s)", engine.name, why)
        self.events.evicted(engine, "demote")
        await engine.demote()

    async def _restart_in_place(self, engine: Engine, reason: str) -> None:
        self.handled.discard(engine.name)
        started = time.monotonic()
        await engine.restart(reason)
        self.costs.observe_boot(engine.name, time.monotonic() - started, engine.last_phases.get("gate", 0.0))
        self._grant(engine)

    def _log_host_memory(self, engine: Engine, level: int) -> None:
        """What a park left held in host RAM, measured against what was expected, and the budget's total."""
        host = engine.host
        expected = self.level1_estimate_gb(engine) if level == 1 else None
        guess = f"; estimated {expected:.2f} GB from its checkpoint" if expected is not None else ""
        total = f"the engines hold {self.level1_gb():.2f} of host.ram_budget_gb={self.capacity.ram_budget_gb:g} GB for sleep"
        if host.held_gb is None:
            log.info("%s asleep at level %d; its host memory is unmeasured (%s), counted by estimate%s; %s",
                     engine.name, level, host.problem, guess, total)
        else:
            log.info("%s asleep at level %d holds %.2f GB of host RAM for sleep (%s%s); %s",
                     engine.name, level, host.held_gb, host.source, guess, total)

    def _measure_residual(self, engine: Engine) -> None:
        """What a parked engine's processes still hold on each device, through NVML (in a thread:
        NVML and the /proc walk block)."""
        if engine.process is None or engine.process.pid is None:
            return
        pids = engine.process.group_pids()
        measured = {d: process_gpu_memory_gb(pids, d) for d in engine.spec.devices}
        measured = {d: gb for d, gb in measured.items() if gb is not None}
        if measured:
            self.residuals[engine.name] = measured

    def _record(self, swap_id: int, target: Engine, moved: list[str], result: str, started: float,
                phases: dict[str, float], predicted: float, error: Optional[str] = None) -> None:
        record = SwapRecord(target.name, moved, result, time.monotonic() - started, phases, predicted,
                            target.spec.group or "", error=error, gates=list(target.progress.gates), id=swap_id)
        self.history.append(record)
        steps = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
        made_room = f" (made room: parked {', '.join(moved)})" if moved else ""
        if result == "ok":
            log.info("%s awake after %.2f s%s, predicted %.2f s: %s", target.name, record.seconds, made_room, predicted, steps)
        else:  # the engine has logged its failure in full; one line here ties it to the swap
            log.error("waking %s failed after %.2f s: %s", target.name, record.seconds, (error or "").splitlines()[0])
        self.events.swap_done(record)

    def _engine(self, name: str) -> Optional[Engine]:
        """The engine of that name, None once a reload removed it: names outlive engines in the
        scheduler's tables, and a bare lookup raising inside the loop would end it."""
        return next((e for e in self.engines if e.name == name), None)

    # -- admin actions ------------------------------------------------------------------------
    # An operator's action runs as a task the scheduler owns, not in the HTTP handler that asked
    # for it: a caller that disconnects (`curl -m 1`) cancels its handler, and a sleep cancelled
    # mid-drain would leave its engine DRAINING with no action driving it (counted at its full
    # share, and back only through a cold restart). The caller only waits for the outcome;
    # stop() ends the action with the others.

    async def swap_in(self, engine: Engine) -> str:
        """Wake `engine` the way a request would (making room), without leasing it to anyone."""
        return await self._admin(engine, "swap", self._swap_in)

    async def sleep(self, engine: Engine, level: Optional[int] = None) -> str:
        """`level`: the rung an operator asked for (router.admin checked the engine may use it); None: chosen."""
        return await self._admin(engine, "sleep", lambda e: self._sleep(e, level))

    async def restart(self, engine: Engine) -> str:
        return await self._admin(engine, "restart", self._restart)

    async def _admin(self, engine: Engine, name: str, run: Callable[[Engine], Awaitable[str]]) -> str:
        task = spawn(_answer(run(engine)), f"admin {name}:{engine.name}")
        self._actions.add(task)  # held (and ended by stop()) like the loop's own actions
        task.add_done_callback(self._actions.discard)
        try:
            outcome = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.info("admin %s %s: the caller left before it ended; it runs on (see /admin/status)", name, engine.name)
            raise
        if isinstance(outcome, APIError):
            raise outcome
        return outcome

    async def _swap_in(self, engine: Engine) -> str:
        if engine.state is State.AWAKE and engine.name not in self.busy:
            return "already awake"
        await self.acquire(engine, admin=True)
        self.release(engine)
        return self._outcome(engine)

    async def _sleep(self, engine: Engine, asked: Optional[int] = None) -> str:
        # By an operator: not woken ahead of demand nor booted in the background, only by a request, from the
        # moment asked (a reload may restart it while this waits for its turn).
        if asked == 1:
            self._level1_fits(engine)
        if engine.state in (State.AWAKE, State.SLEEPING):
            self.put_to_sleep.add(engine.name)

        async def action() -> str:
            if engine.state is not State.AWAKE:
                return f"not awake ({engine.state.value})"
            level = self._level_alone(engine) if asked is None else asked
            reason = self.level_reason(engine, level) if asked is None else f"level {asked} as asked"
            if level is None:
                numbers = f"; {reason}" if reason else ""
                await self._stop(engine, f"on request; no room for it at level 1 in host RAM, and "
                                         f"{self.no_level2(engine)}{numbers}")
            else:
                self.parking_level[engine.name] = level  # its copy counts for the host RAM of parks decided meanwhile
                await self._park(engine, f"on request; level {level}: {reason}" if reason else "on request", level)
            return self._outcome(engine)
        return await self._exclusively(engine, "sleep", action)

    def _level1_fits(self, engine: Engine) -> None:
        """An asked-for Level 1 keeps to host.ram_budget_gb as a chosen one does: else a 409 with the numbers."""
        need = self.level1_need_gb(engine)
        if need is not None and self.level1_gb(exclude={engine.name}) + need > self.capacity.ram_budget_gb:
            raise APIError(409, f"{engine.name} cannot sleep at level 1 now: {self.level1_why(engine)}", "level_unavailable",
                           param="level")

    async def _restart(self, engine: Engine) -> str:
        if engine.state is not State.AWAKE:  # a cold boot needs room like any wake
            self.pending_restart[engine.name] = "admin"
            return await self._swap_in(engine)

        async def action() -> str:
            await self._restart_in_place(engine, "admin")  # drains first, like a sleep
            return self._outcome(engine)
        return await self._exclusively(engine, "restart", action, boots=True)

    async def _exclusively(self, engine: Engine, name: str, action: Callable[[], Awaitable[str]], boots: bool = False) -> str:
        """Run an admin action once no other action holds `engine` and none on its devices stands in
        its way (the rule `decide` keeps: see `boot_devices`), holding it meanwhile."""
        while blockers := self._blocking(engine, boots):
            await asyncio.shield(blockers[0])
        self.busy[engine.name] = asyncio.get_running_loop().create_future()
        self.doing[engine.name] = (name, self.clock(), 0.0)
        if boots:
            self.boots.add(engine.name)
        try:
            return await action()
        except EngineFailed as exc:
            await self._handle_failure(engine, str(exc))
            return self._outcome(engine)
        except APIError:
            raise
        except Exception as exc:  # a defect: the admin caller hears of it now, not at its own timeout
            log.exception("internal error in admin %s %s", name, engine.name)
            await self._defect(f"admin {name}", exc, engine)
            raise APIError(500, f"admin {name} {engine.name} failed on an internal error: {exc!r} "
                           "(traceback in the router log)", "internal_error") from None
        finally:
            self._done(engine)

    def _blocking(self, engine: Engine, boots: bool) -> list[asyncio.Future[None]]:
        """The running actions an admin action on `engine` waits for: its own; a boot on its devices;
        and, when it boots itself, any action on its devices."""
        mine = set(engine.spec.devices)
        return [self.busy[e.name] for e in self.engines if e.name in self.busy and (e is engine or (
            mine & set(e.spec.devices) and (boots or e.name in self.boots or e.state is State.BOOTING)))]

    @staticmethod
    def _outcome(engine: Engine) -> str:
        if engine.state is State.FAILED:
            raise APIError(503, f"model '{engine.name}' failed: {engine.failure}", "engine_failed")
        return engine.state.value

    # -- failures ------------------------------------------------------------------------------

    async def _handle_failure(self, engine: Engine, reason: str) -> None:
        self._count_failure(engine, reason)
        await engine.stop_after_failure()  # a broken engine must not keep holding the GPU

    def _count_failure(self, engine: Engine, reason: str) -> None:
        """One failure, counted once: its waiters hear why at once, and it backs off."""
        if engine.name in self.handled:
            return
        self.handled.add(engine.name)
        self.making_room.pop(engine.name, None)
        delay = self.backoff.failed(engine.name)
        self._fail_waiters(engine, APIError(503, f"model '{engine.name}' is unavailable: {for_clients(reason)}", "engine_failed",
                                            retry_after=max(1.0, delay)))

    async def _defect(self, what: str, exc: Exception, engine: Engine) -> None:
        """After an unexpected exception (its traceback already logged): `engine`, and any engine
        left mid-transition with no action driving it, end FAILED, and their waiters get a 503."""
        cause = f"internal error during {what}: {exc!r} (traceback in the router log)"
        for e in self.engines:
            orphaned = e.state in MID_TRANSITION and e.name not in self.busy
            if e.state is not State.FAILED and (e is engine or orphaned):
                e.fail(cause)
            if e.state is State.FAILED and (e is engine or orphaned) and e.name not in self.handled:
                self._count_failure(e, e.failure or cause)
                try:
                    await e.stop_after_failure()
                except Exception:
                    log.exception("could not stop %s after an internal error", e.name)


async def _answer(action: Awaitable[str]) -> Union[str, APIError]:
    """An admin action's outcome as a value: its caller may be gone, and an APIError nobody awaits
    would be reported as a crashed task."""
    try:
        return await action
    except APIError as exc:
        return exc


def _reason(why: str) -> str:
    """The `reason` label of an eviction, from the decision's words."""
    for prefix, reason in (("room to boot", "boot"), ("room", "room"), ("idle", "idle"), ("on request", "admin"),
                           ("host RAM", "demote")):
        if why.startswith(prefix):
            return reason
    return "other"
