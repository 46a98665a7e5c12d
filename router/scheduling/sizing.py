"""What the router knows of sizes: the GPUs' memory and the host-RAM budget (`Capacity`), the
host RAM each model's weights take when parked at Level 1, and the roster a dry run (`--simulate`)
runs, sized the same way.

And, for `hotswap check`, what placement will make of a roster before anything runs (`preview`), with no second
model of placement: the engines are the router's own (`engines.engine.Engine`, never started), put in the states a
question needs, and asked of the scheduler's own arithmetic. Who can be awake together on a GPU is `Ledger`'s count
with those awake and every other engine asleep at the level it would sleep at; that level is `_choose_level`'s under
the host-RAM budget, first with every other engine stopped, then with every other level-1 candidate asleep at level 1
beside it; its reasons are `level1_why`'s, as /admin/status gives them."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from config.schema import ModelSpec, Roster
from config.simulate import simulate
from engines.engine import Engine, State
from engines.memory import PRIOR_FACTOR, discover_gpus, host_memory_total_gb, weights_gb
from router.scheduling.placement import EPS, Capacity, Ledger, most_awake
from router.scheduling.scheduler import Scheduler

log = logging.getLogger("hotswap")


def capacity(roster: Roster) -> Capacity:
    """GPU sizes (the roster's, else NVML's, else unknown) and the host-RAM budget for Level-1 sleepers."""
    seen = discover_gpus()
    gpus = {g.index: g.memory_gb for g in roster.gpus} if roster.gpus else seen
    if gpus is None:
        log.info("GPU sizes unknown (no gpus: in the roster and NVML sees none): placement counts shares only, "
                 "not the residual of sleeping engines")
    budget = roster.host.ram_budget_gb
    if budget is None:
        budget = round(host_memory_total_gb() / 2, 2)  # as status prints it, so the log, /ui and status agree
    return Capacity(gpus, budget, nvml=seen is not None, page_cache_gb=roster.host.page_cache_budget_gb or 0.0)


def level1_weights(specs: Iterable[ModelSpec], warn: Optional[Callable[[ModelSpec, str], None]] = None
                   ) -> dict[str, Optional[float]]:
    """Host RAM each `sleep_level: auto` engine's weights take at Level 1 (None: unknown, so Level 2). What it warns
    of goes to the log, or to `warn` (`hotswap check` prints it where the model is written)."""
    out: dict[str, Optional[float]] = {}
    for spec in specs:
        out[spec.name], why = weights_gb(spec)
        if spec.sleep_level != "auto" or spec.pin:  # a pinned model is never parked: its size decides nothing
            continue
        if out[spec.name] is None:
            instead = "sleeps at level 2" if spec.reloads_weights else "is stopped when parked (its --load-format cannot reload)"
            (warn or _log_warning)(spec, f"weight size unknown, so it {instead}: {why}")
        else:
            log.info("%s: weights %.1f GB (%s)", spec.name, out[spec.name], why)
    return out


def _log_warning(spec: ModelSpec, message: str) -> None:
    log.warning("%s: %s", spec.name, message)


# -- what placement will make of a roster: `hotswap check` --------------------------------------------------

LISTED_UP_TO = 10  # models on one GPU whose combinations are listed; above, only how many can be awake at once


@dataclass(frozen=True)
class Sleep:
    """The level a model would be parked at, and why (None: it is stopped, never parked; "pin": never parked)."""

    level: Optional[int | str]
    why: str
    # Level 1 alone, but not beside every other model that sleeps at level 1 alone: the level it goes to then, and why.
    crowded: Optional[int] = None
    crowded_why: str = ""


@dataclass
class DevicePreview:
    index: int
    memory_gb: Optional[float]
    models: list[str] = field(default_factory=list)
    shares: dict[str, float] = field(default_factory=dict)
    most_awake: int = 0
    together: list[tuple[str, ...]] = field(default_factory=list)  # the largest sets awake at once (pinned included)
    turns: list[tuple[str, str, str]] = field(default_factory=list)  # (a, b, why): never awake together
    alone_only: dict[str, str] = field(default_factory=dict)  # wakes only once the others' processes are stopped
    listed: bool = True  # False: too many models to list their combinations


@dataclass
class Preview:
    devices: list[DevicePreview]
    sleep: dict[str, Sleep]
    capacity: Capacity


def preview(roster: Roster, weights: dict[str, Optional[float]], capacity: Capacity) -> Preview:
    engines = [Engine(spec, roster.swap, None, Path(os.devnull)) for spec in roster.models]  # type: ignore[arg-type]
    scheduler = Scheduler(engines, roster.swap, roster.queue, capacity, weights=dict(weights))
    alone = {e.name: _alone(scheduler, e) for e in engines}
    level1 = [e for e in engines if alone[e.name].level == 1]
    sleep = {e.name: _beside(scheduler, e, [o for o in level1 if o is not e]) if e in level1 else alone[e.name]
             for e in engines}
    views: dict[int, DevicePreview] = {i: DevicePreview(i, gb) for i, gb in sorted((capacity.gpus or {}).items())}
    for engine in engines:
        for device in engine.spec.devices:
            view = views.setdefault(device, DevicePreview(device, (capacity.gpus or {}).get(device)))
            view.models.append(engine.name)
            view.shares[engine.name] = engine.spec.gpu_share
    for view in views.values():
        _fill(view, [e for e in engines if view.index in e.spec.devices], engines, sleep, scheduler)
    return Preview([v for v in views.values() if v.models], sleep, capacity)


def _alone(scheduler: Scheduler, engine: Engine) -> Sleep:
    """The level `engine` would be parked at with every other engine stopped (holding no host RAM)."""
    spec = engine.spec
    if spec.pin:
        return Sleep("pin", "pin: true, always awake")
    if spec.sleep_level in (0, 2):
        what = "KV-parked: its weights stay on the GPU" if spec.sleep_level == 0 else "weights dropped, reloaded from disk"
        return Sleep(spec.sleep_level, f"sleep_level: {spec.sleep_level} ({what})")
    _put([e for e in scheduler.engines if e is not engine], State.COLD, None)
    level, _ = scheduler._choose_level(engine, 0.0)
    if level != 1:
        return Sleep(level, scheduler.level1_why(engine) + (f"; {scheduler.no_level2(engine)}" if level is None else ""))
    need = scheduler.level1_need_gb(engine)
    return Sleep(1, "sized once it has slept" if need is None else f"about {need:.2f} GB of host RAM ({_estimate(scheduler, engine)})")


def _beside(scheduler: Scheduler, engine: Engine, others: list[Engine]) -> Sleep:
    """Level 1 alone: whether it still is with every other engine that sleeps at level 1 alone asleep there too."""
    alone = _alone(scheduler, engine)
    _put(others, State.SLEEPING, 1)
    level, _ = scheduler._choose_level(engine, 0.0)
    why = scheduler.level1_why(engine)
    _put(others, State.COLD, None)
    if level == 1:
        return alone
    names = ", ".join(e.name for e in others)
    return Sleep(1, alone.why, level, f"when {names} {'sleeps' if len(others) == 1 else 'sleep'} at level 1 too: {why}; "
                                      "the router keeps at level 1 those most likely to be asked for again")


def _estimate(scheduler: Scheduler, engine: Engine) -> str:
    return f"estimated: {scheduler.weights.get(engine.name) or 0:.2f} GB checkpoint x {PRIOR_FACTOR:g}"


def _put(engines: list[Engine], state: State, level: Optional[int]) -> None:
    for engine in engines:
        engine.state, engine.sleep_level = state, level


def _fill(view: DevicePreview, here: list[Engine], everyone: list[Engine], sleep: dict[str, Sleep],
          scheduler: Scheduler) -> None:
    """Who on `view`'s GPU can be awake together while the rest sleep at their level."""
    pinned = [e for e in here if e.spec.pin]
    free = [e for e in here if not e.spec.pin]

    def fits(awake: tuple[Engine, ...]) -> bool:
        groups = [e.spec.group for e in (*pinned, *awake) if e.spec.group is not None]
        if len(groups) != len(set(groups)):
            return False
        return _use(view.index, everyone, {*pinned, *awake}, sleep, scheduler) <= 1.0 + EPS

    view.most_awake = most_awake(here, scheduler.capacity)
    for engine in free:
        if not fits((engine,)):
            need = _use(view.index, everyone, {*pinned, engine}, sleep, scheduler)
            view.alone_only[engine.name] = (f"beside the others asleep it needs {need:.2f} of GPU {view.index}: it wakes "
                                            "only once the router has stopped enough of them (each boots cold when next asked)")
    if len(free) > LISTED_UP_TO:
        view.listed = False
        return
    fitting = [set(c) for n in range(len(free), 0, -1) for c in itertools.combinations(free, n) if fits(c)]
    largest = [s for s in fitting if not any(s < other for other in fitting)]
    view.together = [tuple(e.name for e in here if e in s or e.spec.pin) for s in largest if len(s) + len(pinned) > 1]
    for a, b in itertools.combinations(free, 2):
        if a.name in view.alone_only or b.name in view.alone_only or any({a, b} <= s for s in fitting):
            continue
        if a.spec.group is not None and a.spec.group == b.spec.group:
            why = f"group '{a.spec.group}'"
        else:
            why = f"with the others asleep, the two need {_use(view.index, everyone, {*pinned, a, b}, sleep, scheduler):.2f} of it"
        view.turns.append((a.name, b.name, why))


def _asleep_at(sleep: Sleep) -> Optional[int]:
    return sleep.level if isinstance(sleep.level, int) else None


def _use(device: int, everyone: list[Engine], awake: set[Engine], sleep: dict[str, Sleep], scheduler: Scheduler) -> float:
    """The share of `device` held with `awake` awake and every other engine asleep at its level (a stopped one: cold)."""
    for engine in everyone:
        level = _asleep_at(sleep[engine.name])
        engine.state = State.AWAKE if engine in awake else State.SLEEPING if level is not None else State.COLD
        engine.sleep_level = None if engine in awake else level
    return Ledger(everyone, scheduler.capacity, weights=scheduler.weights).use.get(device, 0.0)


def simulated_roster(roster: Roster) -> tuple[Roster, list[str]]:
    """`roster` with every engine run by the simulator (config.simulate), and what that assumed; the
    checkpoint sizes are read here as `level1_weights` reads them, so a dry run sees the sizes serve sees."""
    return simulate(roster, {spec.name: weights_gb(spec) for spec in roster.models})
