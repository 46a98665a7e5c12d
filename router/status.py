"""/admin/status as plain data: what `hotswap status`, /ui and operators' scripts read."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from engines.engine import Engine
from router.scheduler import SwapRecord

if TYPE_CHECKING:
    from router.app import Router


def router_status(router: "Router") -> dict[str, Any]:
    return {
        "ready": router.ready,
        "groups": {
            name: {
                "active": s.active.name if s.active else None,
                "booted": s.booted,
                "last_swap": _swap_dict(s.last_swap),
                "swaps": [_swap_dict(r) for r in reversed(s.history)],
                "engines": [engine_status(router, e) for e in s.engines],
            }
            for name, s in router.groups.items()
        },
    }


def engine_status(router: "Router", e: Engine) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "name": e.name,
        "aliases": e.spec.aliases,
        "state": e.state.value,
        "for_s": round(now - e.since, 3),
        "sleep_level": e.sleep_level,
        "in_flight": e.in_flight,
        "queued": router.scheduler(e).queued(e),
        "port": e.port,
        "pid": e.process.pid if e.process else None,
        "boot_deadline_in_s": round(e.boot_deadline - now, 1) if e.boot_deadline else None,
        "last_phases": {k: round(v, 4) for k, v in e.last_phases.items()},
        "last_verdict": e.last_verdict.as_dict() if e.last_verdict else None,
        "verdicts": [v.as_dict() for v in reversed(router.verdicts[e.name])],
        "failures": router.scheduler(e).backoff.failures[e.name],
        "restarts": sum(e.restarts.values()),
        "restarts_by_reason": dict(e.restarts),
        "baseline_mal": e.baseline.mal if e.baseline else None,
        "observed_mal": e.observed_mal,
        "collapsed": e.midlife.collapsed,
        "last_collapse": e.midlife.last_collapse,
        "restart_pending": e.needs_restart,
        "watch_error": e.watch_error,
        "failure": e.failure,
        "last_log_lines": e.last_log_lines(20),
        "log_file": str(e.process.log_path) if e.process else None,
    }


def _swap_dict(record: Optional[SwapRecord]) -> Optional[dict[str, Any]]:
    if record is None:
        return None
    return {"from": record.from_model, "to": record.to_model, "result": record.result, "seconds": round(record.seconds, 4),
            "phases": {k: round(v, 4) for k, v in record.phases.items()}, "error": record.error, "at": record.at}
