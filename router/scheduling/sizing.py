"""What the router knows of sizes: the GPUs' memory and the host-RAM budget (`Capacity`), the
host RAM each model's weights take when parked at Level 1, and the roster a dry run (`--simulate`)
runs, sized the same way."""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from config.schema import ModelSpec, Roster
from config.simulate import simulate
from engines.memory import discover_gpus, host_memory_total_gb, weights_gb
from router.scheduling.placement import Capacity

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
        budget = host_memory_total_gb() / 2
    return Capacity(gpus, budget, nvml=seen is not None, page_cache_gb=roster.host.page_cache_budget_gb or 0.0)


def level1_weights(specs: Iterable[ModelSpec]) -> dict[str, Optional[float]]:
    """Host RAM each `sleep_level: auto` engine's weights take at Level 1 (None: unknown, so Level 2)."""
    out: dict[str, Optional[float]] = {}
    for spec in specs:
        out[spec.name], why = weights_gb(spec)
        if spec.sleep_level != "auto":
            continue
        if out[spec.name] is None:
            log.warning("%s: weight size unknown, so it sleeps at level 2: %s", spec.name, why)
        else:
            log.info("%s: weights %.1f GB (%s)", spec.name, out[spec.name], why)
    return out


def simulated_roster(roster: Roster) -> tuple[Roster, list[str]]:
    """`roster` with every engine run by the simulator (config.simulate), and what that assumed; the
    checkpoint sizes are read here as `level1_weights` reads them, so a dry run sees the sizes serve sees."""
    return simulate(roster, {spec.name: weights_gb(spec) for spec in roster.models})
