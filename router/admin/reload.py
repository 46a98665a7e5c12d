"""Roster hot reload: SIGHUP, `POST /admin/reload` and `hotswap reload` re-read the --config file.

The new roster is validated in full first (the same loader as at start, placement checks
included); if anything is wrong nothing changes, and every error is logged and returned as
`file:line:col: field: message`. Otherwise the difference (`config.diff`) is taken against
what runs and applied right after, with no await between the two, so no request sees half of a
reload and no engine changes under it: names resolve to the new table, keys and limits are the
new ones, and the scheduler is told which engines join, leave, come back or restart
(`router.scheduling.roster_changes`), which it then does in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from config import RosterError, load_roster
from config.diff import RosterDiff, diff
from config.schema import Roster
from router.errors import APIError
from router.keys import KeyTable
from router.live import Router
from router.scheduling import capacity, level1_weights, simulated_roster
from router.tasks import spawn
from router.virtuals import Virtuals

log = logging.getLogger("hotswap")


class Reloads:
    def __init__(self, router: Router):
        self.router = router
        self.lock = asyncio.Lock()  # one reload at a time: each diffs against what the last applied
        self.last: Optional[dict[str, Any]] = None  # for /admin/status
        self._signalled: set[asyncio.Task[None]] = set()

    async def reload(self, trigger: str) -> RosterDiff:
        """Apply the --config file as it is now; raise RosterError (nothing changed) when it is invalid,
        or APIError 409 while the engines are still booting."""
        router = self.router
        scheduler = router.placement
        if scheduler.closing:
            raise APIError(503, "the router is shutting down; the roster is not reloaded", "shutting_down")
        if not scheduler.booted:
            raise APIError(409, "the router is still booting its engines; reload once /admin/status says booted: true "
                           "(a SIGHUP sent now is applied when the boot ends)", "still_booting", retry_after=5)
        async with self.lock:
            source = router.roster.source
            try:
                new = await asyncio.to_thread(load_roster, source)
                if router.simulated:  # the dry run stays one: the file names real engines
                    new = (await asyncio.to_thread(simulated_roster, new))[0]
            except RosterError as exc:
                for issue in exc.issues:
                    log.error("%s", issue)
                log.error("roster reload (%s) refused: %d error(s) in %s; nothing changed, still serving the roster in force",
                          trigger, len(exc.issues), source)
                self.last = {"at": time.time(), "trigger": trigger, "result": "refused", "errors": [str(i) for i in exc.issues]}
                raise
            changes, weights = await self._decide(new)
            apply(router, new, changes, weights)  # right after the decision: nothing can run in between
            for line in changes.summary():
                (log.warning if line.startswith("!") else log.info)("roster reload (%s): %s", trigger, line)
            self.last = {"at": time.time(), "trigger": trigger, "result": "applied", "changes": changes.as_dict()}
            return changes

    async def _decide(self, new: Roster) -> tuple[RosterDiff, dict[str, Optional[float]]]:
        """What applying `new` changes, decided against what runs as this returns, and the Level-1
        weights of what it adds or changes. Sizing reads the disk (an await), and meanwhile an engine
        an earlier reload removed may finish stopping and leave: so the diff is taken again after
        each await until nothing is left to size. Each new entry is sized once, so this ends."""
        weights: dict[str, Optional[float]] = {}
        while True:
            engines = self.router.engines.values()
            # Against what runs (an engine waiting for its restart runs its old entry, with the new
            # router-side keys): what the reload reports is what it does.
            changes = diff(self.router.roster, {e.name: e.spec for e in engines}, new, {e.name for e in engines if e.retiring})
            unsized = [spec for spec in changes.to_size if spec.name not in weights]
            if not unsized:
                return changes, {spec.name: weights[spec.name] for spec in changes.to_size}
            weights.update(await asyncio.to_thread(level1_weights, unsized))

    def on_signal(self) -> None:
        """SIGHUP: applied once the boot has ended; the outcome is in the log (and /admin/status)."""
        task = spawn(self._on_signal(), "reload:SIGHUP")
        self._signalled.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._signalled.discard)

    async def _on_signal(self) -> None:
        if not self.router.placement.booted:
            log.info("SIGHUP: the roster is reloaded once every engine has booted")
            await self.router.placement.boot_done.wait()
        try:
            await self.reload("SIGHUP")
        except RosterError:
            pass  # logged, error by error, by reload()
        except APIError as exc:
            log.warning("SIGHUP: roster not reloaded: %s", exc.message)
        except Exception:
            log.exception("roster reload (SIGHUP): internal error (traceback above); see /admin/status for what is in force")


def apply(router: Router, new: Roster, changes: RosterDiff, weights: dict[str, Optional[float]]) -> None:
    """Put `new` in force at once (no await in here), all of it or (if anything cannot be built)
    none of it. The listener stays as it is: changing it needs a restart."""
    scheduler = router.placement
    # First everything that can fail, touching nothing of what is in force.
    keys = KeyTable(new.auth)
    sizes = capacity(new) if "gpus" in changes.sections or "host" in changes.sections else scheduler.capacity
    joining = {spec.name: router.new_engine(spec) for spec in changes.added}
    engines = {**router.engines, **joining}
    by_name = {n: engines[m.name] for m in new.models for n in m.names}
    virtuals = Virtuals(new.virtual_models, by_name)
    # Then the switch, in plain assignments and bookkeeping.
    router.roster = new.model_copy(update={"listen": router.roster.listen})
    router.keys = keys
    scheduler.swap, scheduler.limits, scheduler.capacity = new.swap, new.queue, sizes
    scheduler.demand.tau_s = new.swap.demand_tau_s
    for engine in router.engines.values():
        engine.swap = new.swap
    for name in changes.removed:
        scheduler.retire(router.engines[name])
    for name in changes.revived:
        scheduler.revive(router.engines[name])
    for engine in joining.values():
        router.add_engine(engine)
    for change in changes.changed:
        engine = router.engines[change.name]
        if change.restart:
            scheduler.respec(engine, change.spec)
        else:
            engine.adopt(change.spec)
    restarting = {c.name for c in changes.changed if c.restart}
    for name in router.engines:  # an engine back to the entry it runs no longer waits for a restart
        if name not in restarting:
            scheduler.pending_spec.pop(name, None)
    router.by_name = by_name
    router.virtuals = virtuals
    for name, gb in weights.items():
        if scheduler.weights.get(name) != gb:  # why its last park was not at level 1 was told with the old size
            scheduler.host_why.pop(name, None)
    scheduler.weights.update(weights)
    scheduler.poke()
