"""/admin/status as plain data: what `hotswap status`, /ui and operators' scripts read."""

from __future__ import annotations

import time
from typing import Any, Optional

from config.sections import BATCH
from engines.engine import Engine
from router.admin.reload import Reloads
from router.live import Router
from router.scheduling import devices_view


def router_status(router: Router, reloads: Reloads) -> dict[str, Any]:
    scheduler = router.placement
    return {
        "ready": router.ready,
        "booted": scheduler.booted,
        "simulated": router.simulated,  # `serve --simulate`: a dry run, no engine is real
        "scheduler_defect": defect_status(router),
        "placement": placement_status(router),
        "engines": [engine_status(router, e) for e in router.engines.values()],
        "last_swap": scheduler.last_swap.as_dict() if scheduler.last_swap else None,
        "swaps": [r.as_dict() for r in reversed(scheduler.history)],
        "roster": {"source": router.roster.source, "last_reload": reloads.last},
    }


def defect_status(router: Router) -> Optional[dict[str, Any]]:
    """Null unless the scheduler's decisions raised (its loop goes on, looking again each second): a bug to
    report, with the traceback the router logged the first time."""
    defect, now = router.placement.defect, router.placement.clock()
    if defect is None:
        return None
    return {"error": defect["error"], "count": defect["count"], "first_ago_s": round(now - defect["first"], 3),
            "last_ago_s": round(now - defect["last"], 3)}


def placement_status(router: Router) -> dict[str, Any]:
    scheduler = router.placement
    devices = []
    for view in devices_view(scheduler.ledger()):
        devices.append({"index": view.index, "memory_gb": view.memory_gb, "planned": round(view.planned, 4),
                        "residual": round(view.residual, 4), "free": round(max(0.0, 1.0 - view.planned - view.residual), 4),
                        "engines": view.engines})
    now = scheduler.clock()
    return {"devices": devices, "wake_ahead": [w.as_dict(now) for w in reversed(scheduler.ahead_done)],
            "host": {"ram_budget_gb": round(scheduler.capacity.ram_budget_gb, 4),
                     "level1_gb": round(scheduler.level1_gb(), 4),
                     "page_cache_budget_gb": scheduler.capacity.page_cache_gb,
                     "staged_gb": round(scheduler.staged_gb(), 4)}}


def engine_status(router: Router, e: Engine) -> dict[str, Any]:
    now = time.monotonic()
    scheduler = router.placement
    doing = scheduler.doing.get(e.name)
    return {
        "name": e.name,
        "aliases": e.spec.aliases,
        "state": e.state.value,
        "for_s": round(now - e.since, 3),
        "action": doing[0] if doing else None,
        "group": e.spec.group,
        "devices": e.spec.devices,
        "gpu_share": e.spec.gpu_share,
        "pin": e.spec.pin,
        "sleep_level": e.sleep_level,
        "sleep_level_policy": e.spec.sleep_level,
        "weights_gb": scheduler.weights.get(e.name),
        "host_memory": host_memory_status(router, e),
        "staging": e.stager.as_dict(),  # engines.waking.stage: staged (in the page cache as the router knows), running, last report
        "wake_estimate_s": round(scheduler.predicted_wait(e, scheduler.clock()), 2),
        "woken_ahead": scheduler.ahead[e.name].as_dict(scheduler.clock()) if e.name in scheduler.ahead else None,
        "held_for_s": _held(router, e),  # held off client traffic for an operator's trial (router.keys); null: not held
        "in_flight": e.in_flight,
        "queued": scheduler.queued(e),
        "queued_by_class": scheduler.queued_by_class(e),  # {interactive: N, batch: M}: batch is served after interactive
        "interactive_demand": scheduler.interactive_demand(e, scheduler.clock())[0],  # why batch may not take its room
        # Why its queued batch requests wait for room (null: none waits). The scheduler's note outlives its waiters
        # (it is made anew only while some wait), so it is read only while one does.
        "batch_held_by": scheduler.held_by.get(e.name) if scheduler.queued_by_class(e)[BATCH] else None,
        # What its queued requests wait for at the scheduler's last look: {reason: swap | min_active | max_hold | ..., why}
        "waiting_for": scheduler.wait_parts.now(e.name) if scheduler.queued(e) else None,
        "port": e.port,
        "pid": e.process.pid if e.process else None,
        "boot_deadline_in_s": round(e.progress.boot_deadline - now, 1) if e.progress.boot_deadline else None,
        "boot_reason": e.progress.boot_reason,  # engines.progress: first, stopped, roster, gate, failed, midlife, admin
        "step": e.progress.step,  # booting: start, load, gate; waking: the wake step running
        "gate_story": list(e.progress.gates),  # since its last wake or boot began: e.g. refused, restarted, passed
        "last_phases": {k: round(v, 4) for k, v in e.last_phases.items()},
        "last_verdict": e.gate.last_verdict.as_dict() if e.gate.last_verdict else None,
        "verdicts": [v.as_dict() for v in reversed(router.verdicts[e.name])],
        "failures": scheduler.backoff.failures[e.name],
        "restarts": sum(e.restarts.values()),
        "restarts_by_reason": dict(e.restarts),
        "baseline_mal": e.gate.baseline.mal if e.gate.baseline else None,
        "observed_mal": e.gate.observed_mal,
        "observed_mal_source": e.gate.observed_mal_source,  # "answer" (its own numbers) or "counters"
        "logprob_drift": _drift(e),
        "collapsed": e.gate.midlife.collapsed,
        "last_collapse": e.gate.midlife.last_collapse,
        "acceptance_watch": e.gate.midlife.last,  # the mid-life window's last MAL and where it came from
        "restart_pending": e.gate.needs_restart,
        "roster_change_pending": e.name in scheduler.pending_spec,
        "retiring": e.retiring,
        "watch_error": e.gate.watch_error,
        "failure": e.failure,
        "last_log_lines": e.last_log_lines(20),
        "log_file": str(e.process.log_path) if e.process else None,
    }


def host_memory_status(router: Router, e: Engine) -> dict[str, Any]:
    """What the engine holds in host RAM for sleep: estimated (checkpoint x prior) vs measured, and what
    the budget counts for it; `source` is where the counted number came from (extension | proc | estimate)."""
    scheduler = router.placement
    measured = e.host.as_dict()
    estimate = scheduler.level1_estimate_gb(e)
    return {**measured,
            "source": measured["source"] if measured["measured_gb"] is not None else "estimate",
            "estimated_gb": None if estimate is None else round(estimate, 4),
            "counted_gb": round(scheduler.host_gb(e), 4),
            "not_level1_because": scheduler.host_why.get(e.name)}


def _drift(e: Engine) -> dict[str, Any]:
    """The logprob check's numbers: the last judged canary's drift, the engine's own cold-boot spread, the limit."""
    v = e.gate.last_verdict
    return {"last": v.logprob_drift if v is not None and v.result != "baseline" else None, "spread": e.gate.logprob_spread,
            "max": e.spec.gate.max_logprob_drift}


def _held(router: Router, e: Engine) -> Optional[float]:
    held = router.holds.remaining(e.name)
    return None if held is None else round(held, 1)
