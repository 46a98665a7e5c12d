"""Where engines fit: GPU memory per device, and which engines to park to make room.

Pure arithmetic over what the engines are doing now; the scheduler asks, and acts.

Each device is measured in fractions of itself (1.0 = the whole GPU), because that is how
vLLM sizes an engine: `--gpu-memory-utilization` is the share of each of its devices it takes
when awake. A sleeping engine still holds its CUDA context and allocator pools (its
residual, in GB, converted with the device's size; uncounted when the size is unknown). A
KV-parked one (level 0: engines/waking/ladder.py) holds its weights besides (`weights_gb`, divided over its
devices); the KV tier is offered only where both the weights and the device sizes are known, and a
level-0 engine whose weights are unknown is counted at its whole share (what it frees is not known).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol

from config.schema import ModelSpec
from engines.engine import State
from engines.waking import KV_PARKED

EPS = 1e-9  # shares are written as decimals: 0.3 + 0.6 + 0.1 must fit in 1.0
EXHAUSTIVE_UP_TO = 12  # candidates searched exhaustively for the cheapest set; above, greedily

# States in which an engine holds its full share: it is awake, or on its way in or out.
HOLDS_SHARE = frozenset({State.BOOTING, State.AWAKE, State.DRAINING, State.WAKING, State.VERIFYING})


class Placed(Protocol):
    """What placement reads of an engine."""

    name: str
    spec: ModelSpec
    state: State
    sleep_level: Optional[int]

    @property
    def holds_process(self) -> bool: ...


@dataclass(frozen=True)
class Capacity:
    gpus: Optional[dict[int, float]]  # GB per device index; None: sizes unknown, shares only
    ram_budget_gb: float
    nvml: bool = False  # NVML sees the GPUs: a sleeper's residual is measured, not assumed
    page_cache_gb: float = 0.0  # host.page_cache_budget_gb: what staging ahead may fill (router/scheduling/staging.py)

    def residual(self, engine: Placed, device: int, measured: Optional[dict[int, float]] = None) -> float:
        """An engine's sleeping residual on `device`, as a fraction of it."""
        if self.gpus is None or device not in self.gpus:
            return 0.0
        gb = (measured or {}).get(device, engine.spec.sleep_residual_gb)
        return gb / self.gpus[device]


@dataclass(frozen=True)
class Victim:
    """An engine to move out of the way: park it (awake -> asleep), park it further (KV-parked ->
    Level 1/2: "deepen") or stop it (asleep -> cold). One engine may be offered more than once (a KV
    park and a full park): `cheapest` takes at most one of an engine's offers."""

    engine: Placed
    action: str  # "park" | "deepen" | "stop"
    frees: dict[int, float]  # fraction freed per device
    cost: float  # expected seconds of waiting this move causes later
    busy: bool = False  # it is serving requests (parked only when no idle choice exists)
    ready_in: float = 0.0  # seconds until it may be moved (min_active_s, max_hold_s); 0: now
    level: Optional[int] = None  # the rung it goes to, when the offer fixes it (a KV park: 0); None: chosen at the move
    why: str = ""  # for a stop: the costs it was chosen by, for the log


class Ledger:
    """What every engine holds on every device right now, plus what this round of decisions reserved."""

    def __init__(self, engines: Iterable[Placed], capacity: Capacity, reserved: Iterable[Placed] = (),
                 residuals: Optional[dict[str, dict[int, float]]] = None,
                 weights: Optional[dict[str, Optional[float]]] = None):
        self.capacity = capacity
        self.residuals = residuals or {}
        self.weights = weights or {}  # GB per engine (all its devices together), None: unknown
        self.reserved: set[str] = {e.name for e in reserved}
        # Host RAM for sleep (GB) that this round's parks, demotions and stops will leave an engine holding,
        # in place of what it holds now: a second park planned in the round counts the first one's copy.
        self.host_planned: dict[str, float] = {}
        self.engines = list(engines)
        self.use: dict[int, float] = {}
        for engine in self.engines:
            for device, fraction in self.held(engine).items():
                self.use[device] = self.use.get(device, 0.0) + fraction

    def held(self, engine: Placed) -> dict[int, float]:
        """What `engine` holds on each of its devices (a reserved engine: its full share)."""
        devices = engine.spec.devices
        if engine.name in self.reserved or engine.state in HOLDS_SHARE or (
                engine.state is State.FAILED and engine.holds_process):
            return {d: engine.spec.gpu_share for d in devices}
        if engine.state is State.SLEEPING and engine.sleep_level == KV_PARKED:
            return {d: self.kv_parked(engine, d) for d in devices}
        if engine.state is State.SLEEPING:
            return {d: self.residual(engine, d) for d in devices}
        return {d: 0.0 for d in devices}

    def residual(self, engine: Placed, device: int) -> float:
        return self.capacity.residual(engine, device, self.residuals.get(engine.name))

    def weights_on(self, engine: Placed, device: int) -> Optional[float]:
        """Its weights' part of `device`, as a fraction of it (None: its weights or the device's size unknown)."""
        gb = self.weights.get(engine.name, engine.spec.weights_gb)
        gpus = self.capacity.gpus
        if gb is None or gpus is None or device not in gpus:
            return None
        return gb / len(engine.spec.devices) / gpus[device]

    def kv_offered(self, engine: Placed) -> bool:
        """Whether a KV park can be planned for `engine`: what it keeps (its weights) is known on each device,
        and less than its share (else the KV cache is nothing to speak of)."""
        return all((w := self.weights_on(engine, d)) is not None and w + self.residual(engine, d) < engine.spec.gpu_share - EPS
                   for d in engine.spec.devices)

    def kv_parked(self, engine: Placed, device: int) -> float:
        """What a KV-parked engine holds on `device`: its weights and its residual, never more than its share."""
        weights = self.weights_on(engine, device)
        if weights is None:
            return engine.spec.gpu_share
        return min(weights + self.residual(engine, device), engine.spec.gpu_share)

    def reserve(self, engine: Placed) -> None:
        """Count `engine` at its full share from now on (it is about to wake or boot)."""
        before = self.held(engine)
        self.reserved.add(engine.name)
        for device, fraction in self.held(engine).items():
            self.use[device] = self.use.get(device, 0.0) + fraction - before.get(device, 0.0)

    def shortfall(self, engine: Placed, victims: Iterable[Victim] = ()) -> dict[int, float]:
        """How much is missing on each device for `engine` to be awake (empty: it fits)."""
        freed: dict[int, float] = {}
        for victim in victims:
            for device, fraction in victim.frees.items():
                freed[device] = freed.get(device, 0.0) + fraction
        held = self.held(engine)
        out = {}
        for device in engine.spec.devices:
            after = self.use.get(device, 0.0) - held.get(device, 0.0) - freed.get(device, 0.0) + engine.spec.gpu_share
            if after > 1.0 + EPS:
                out[device] = after - 1.0
        return out

    def fits(self, engine: Placed, victims: Iterable[Victim] = ()) -> bool:
        return not self.shortfall(engine, victims)

    def parked_frees(self, engine: Placed, level: Optional[int] = None) -> dict[int, float]:
        """What parking an awake engine gives back on each device: its share minus its residual, or, KV-parked
        (`level` 0), minus its weights too."""
        keeps = self.kv_parked if level == KV_PARKED else self.residual
        return {d: max(self.held(engine)[d] - keeps(engine, d), 0.0) for d in engine.spec.devices}

    def deepened_frees(self, engine: Placed) -> dict[int, float]:
        """What a KV-parked engine gives back going down to Level 1 or 2: its weights."""
        return {d: max(self.held(engine)[d] - self.residual(engine, d), 0.0) for d in engine.spec.devices}

    def stopped_frees(self, engine: Placed) -> dict[int, float]:
        return dict(self.held(engine))


def cheapest(ledger: Ledger, target: Placed, candidates: list[Victim], base: list[Victim]) -> Optional[list[Victim]]:
    """The victims (beyond `base`, which must move anyway) with the least total cost after which
    `target` fits; [] if it fits already; None if no set does.

    Only candidates on the target's devices can help. Rosters are small, so the search is
    exhaustive; past EXHAUSTIVE_UP_TO candidates it is greedy by cost per share freed."""
    needed = ledger.shortfall(target, base)
    if not needed:
        return []
    useful = [v for v in candidates if any(v.frees.get(d, 0.0) > EPS for d in needed)]
    if not ledger.fits(target, [*base, *_most_of_each(useful)]):
        return None
    if len(useful) > EXHAUSTIVE_UP_TO:
        return _greedy(ledger, target, useful, base, needed)
    best: Optional[tuple[float, int, list[Victim]]] = None
    for size in range(1, len(useful) + 1):
        for combo in itertools.combinations(useful, size):
            cost = sum(v.cost for v in combo)
            if best is not None and (cost, size) >= best[:2]:
                continue
            if len({v.engine.name for v in combo}) == size and ledger.fits(target, [*base, *combo]):
                best = (cost, size, list(combo))
    return best[2] if best else None


def _greedy(ledger: Ledger, target: Placed, useful: list[Victim], base: list[Victim],
            needed: dict[int, float]) -> Optional[list[Victim]]:
    def per_share(v: Victim) -> float:
        return v.cost / max(EPS, sum(v.frees.get(d, 0.0) for d in needed))

    chosen: list[Victim] = []
    for victim in sorted(useful, key=per_share):
        if any(v.engine.name == victim.engine.name for v in chosen):
            continue  # one offer per engine
        chosen.append(victim)
        if ledger.fits(target, [*base, *chosen]):
            break
    else:
        return None
    for victim in sorted(chosen, key=lambda v: -v.cost):  # drop what turned out unnecessary, dearest first
        rest = [v for v in chosen if v is not victim]
        if ledger.fits(target, [*base, *rest]):
            chosen = rest
    return chosen


def _most_of_each(victims: list[Victim]) -> list[Victim]:
    """Of each engine's offers, the one that frees the most: whether any set of offers can make room."""
    best: dict[str, Victim] = {}
    for v in victims:
        if v.engine.name not in best or sum(v.frees.values()) > sum(best[v.engine.name].frees.values()):
            best[v.engine.name] = v
    return list(best.values())


def most_awake(engines: Iterable[Placed], capacity: Capacity) -> int:
    """How many of `engines` can be awake at once: the pinned first, then the smallest shares, one per
    group, while each device holds the awake shares plus every sleeper's residual. Greedy, which is
    exact on one GPU (the smallest shares are the most that fit) and a fair count on several."""
    engines = list(engines)
    use: dict[int, float] = {}
    for engine in engines:
        for device in engine.spec.devices:
            use[device] = use.get(device, 0.0) + capacity.residual(engine, device)
    groups: set[str] = set()
    count = 0
    for engine in sorted(engines, key=lambda e: (not e.spec.pin, e.spec.gpu_share)):
        if engine.spec.group is not None and engine.spec.group in groups:
            continue
        extra = {d: engine.spec.gpu_share - capacity.residual(engine, d) for d in engine.spec.devices}
        if all(use.get(d, 0.0) + x <= 1.0 + EPS for d, x in extra.items()):
            for d, x in extra.items():
                use[d] = use.get(d, 0.0) + x
            if engine.spec.group is not None:
                groups.add(engine.spec.group)
            count += 1
    return count


def never_fits(engines: Iterable[Placed], target: Placed) -> Optional[str]:
    """Why `target` cannot be awake even with every other unpinned engine stopped; None if it can."""
    group = target.spec.group
    rival = next((e for e in engines if e is not target and e.spec.pin and group is not None and e.spec.group == group), None)
    if rival is not None and not target.spec.pin:
        return f"it shares group '{group}' with {rival.name}, which is pinned (always awake)"
    for device in target.spec.devices:
        pinned = [e for e in engines if e is not target and e.spec.pin and device in e.spec.devices]
        total = target.spec.gpu_share + sum(e.spec.gpu_share for e in pinned)
        if total > 1.0 + EPS:
            names = ", ".join(f"{e.name} {e.spec.gpu_share:g}" for e in pinned)
            return (f"it needs {target.spec.gpu_share:g} of GPU {device}, and pinned models hold {total - target.spec.gpu_share:g} "
                    f"of it ({names})")
    return None


@dataclass
class DeviceView:
    """One device's placement, for /admin/status, /ui and metrics."""

    index: int
    memory_gb: Optional[float]
    planned: float = 0.0  # shares of engines awake or on their way in or out
    residual: float = 0.0  # what sleeping engines hold: their residuals (and a KV-parked one's weights)
    shares: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> ("awake", 0.25) / ("sleeping", 0.01)

    @property
    def engines(self) -> dict[str, str]:
        """`shares` as text: name -> "awake 0.25" / "sleeping 0.01"."""
        return {name: f"{state} {fraction:.3g}" for name, (state, fraction) in self.shares.items()}


def devices_view(ledger: Ledger) -> list[DeviceView]:
    gpus = ledger.capacity.gpus or {}
    views: dict[int, DeviceView] = {i: DeviceView(i, gb) for i, gb in sorted(gpus.items())}
    for engine in ledger.engines:
        for device, fraction in ledger.held(engine).items():
            view = views.setdefault(device, DeviceView(device, gpus.get(device)))
            if engine.state is State.SLEEPING and engine.name not in ledger.reserved:
                view.residual += fraction  # a KV-parked engine's weights with it: held by a sleeper
                view.shares[engine.name] = ("kv-parked" if engine.sleep_level == KV_PARKED else "sleeping", fraction)
            elif fraction > 0:
                view.planned += fraction
                view.shares[engine.name] = (engine.state.value, fraction)
    return [views[i] for i in sorted(views)]


CostFn = Callable[[Placed, str, float], float]  # (engine, "park" | "kv_park" | "deepen" | "stop", now) -> expected seconds of waiting caused
