"""`hotswap status`: a running router's groups and engines as a table."""

from __future__ import annotations

import sys
import time
import urllib.error
from typing import Any, Optional

from router.cli.admin_api import NotARouter, fetch_json, refusal
from router.cli.where import unreachable

STATUS_KEYS = ("ready", "booted", "placement", "engines", "last_swap")


def fetch(url: str, admin_key: Optional[str], timeout: float = 10) -> dict[str, Any]:
    return fetch_json(url, "/admin/status", admin_key, timeout, STATUS_KEYS)


def render(status: dict[str, Any]) -> str:
    lines = [f"ready: {'yes' if status['ready'] else 'no'}{'' if status['booted'] else ' (booting)'}"]
    place = status["placement"]
    for d in place["devices"]:  # shares of the device, as --gpu-memory-utilization writes them; its size in GB
        size = f" ({d['memory_gb']:g} GB)" if d["memory_gb"] else ""
        held = ", ".join(f"{name} {what}" for name, what in d["engines"].items()) or "-"
        lines.append(f"GPU {d['index']}{size}, shares of it: awake {d['planned']:.2f}, residual {d['residual']:.2f}, "
                     f"free {d['free']:.2f}  ({held})")
    host = place["host"]
    lines.append(f"host RAM held for sleep: {host['level1_gb']:.2f} of {host['ram_budget_gb']:.2f} GB (host.ram_budget_gb)")
    if host.get("page_cache_budget_gb"):
        lines.append(f"page cache staged ahead: {host['staged_gb']:.2f} of {host['page_cache_budget_gb']:.2f} GB "
                     "(host.page_cache_budget_gb)")
    rows = [("MODEL", "STATE", "FOR", "LEVEL", "GPUS", "SHARE", "WAKE~", "IN-FLIGHT", "QUEUED", "MAL base/obs", "DRIFT last/limit",
             "RESTARTS", "LAST VERDICT")]
    for e in status["engines"]:
        verdict = e["last_verdict"] or {}
        mal = "-" if e["baseline_mal"] is None else f"{e['baseline_mal']:.2f}/{e['observed_mal'] or 0:.2f}"
        state = e["state"] + (f" ({e['action']})" if e["action"] else "")
        state += " (leaving the roster)" if e.get("retiring") else " (restart pending: roster)" if e.get("roster_change_pending") else ""
        state += " (woken ahead)" if e.get("woken_ahead") else ""
        rows.append((e["name"] + (" [pin]" if e["pin"] else ""), state, f"{e['for_s']:.0f}s", _level(e),
                     ",".join(map(str, e["devices"])), f"{e['gpu_share']:g}", f"{e['wake_estimate_s']:.1f}s",
                     str(e["in_flight"]), queued(e), mal, _drift(e.get("logprob_drift") or {}), str(e["restarts"]),
                     verdict.get("result", "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    swap = status["last_swap"]
    if swap:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in swap["phases"].items())
        moved = f" (parked {', '.join(swap['from'])})" if swap["from"] else ""
        # a wake the gate refused and a restart repaired is "ok" in `result`: tell the refusal
        gates = swap.get("gates") or []
        result = " → ".join(gates) if swap["result"] == "ok" and {"refused", "allowed"} & set(gates) else swap["result"]
        lines.append(f"  last wake: {swap['to']} {result} in {swap['seconds']:.2f} s, predicted "
                     f"{swap['predicted_s']:.2f} s{moved} ({phases})")
    reload = (status.get("roster") or {}).get("last_reload")
    if reload:
        at = time.strftime("%H:%M:%S", time.localtime(reload["at"]))
        what = (f"{len(reload['errors'])} error(s), nothing changed; first: {reload['errors'][0]}" if reload["result"] == "refused"
                else ", ".join(f"{k} {v if isinstance(v, list) else sorted(v)}" for k, v in reload["changes"].items()
                               if v and k != "unchanged") or "no changes")
        lines.append(f"  last reload ({reload['trigger']}) at {at}: {reload['result']}: {what}")
    lines += host_memory_lines(status["engines"])
    ahead = place.get("wake_ahead") or []
    if ahead:  # newest first
        lines.append("  woken ahead: " + ", ".join(f"{w['engine']} from level {w['from_level']} {w['ago_s']:.0f}s ago: {w['outcome']}"
                                                   for w in ahead[:5]))
    for e in status["engines"]:
        if e.get("batch_held_by"):
            lines.append(f"  {e['name']}: {_batch(e)} batch request(s) wait for room: {e['batch_held_by']}")
        if e["failure"]:
            lines.append(f"  {e['name']} failed: {e['failure']}")
        collapse = e.get("last_collapse")
        if collapse:
            at = time.strftime("%H:%M:%S", time.localtime(collapse["at"]))
            lines.append(f"  {e['name']} last acceptance collapse at {at}: MAL {collapse['observed_mal']:.2f} "
                         f"({collapse['reason']})")
    return "\n".join(lines)


def queued(e: dict[str, Any]) -> str:
    """The queue, and how much of it is batch work (served after interactive)."""
    batch = _batch(e)
    return f"{e['queued']} ({batch} batch)" if batch else str(e["queued"])


def _batch(e: dict[str, Any]) -> int:
    return (e.get("queued_by_class") or {}).get("batch", 0)


def host_memory_lines(engines: list[dict[str, Any]]) -> list[str]:
    """Per engine, what it holds in host RAM for sleep: measured (and from where) against the estimate."""
    lines = []
    for e in engines:
        host = e.get("host_memory")
        if not host or (host["measured_gb"] is None and not host["counted_gb"] and host["estimated_gb"] is None):
            continue
        measured = ("not measured yet" if host["measured_gb"] is None
                    else f"measured {host['measured_gb']:.2f} GB ({host['source']}, after {host['after']})")
        estimated = "no estimate (checkpoint size unknown)" if host["estimated_gb"] is None else f"estimated {host['estimated_gb']:.2f} GB"
        line = f"  {e['name']} host RAM: {measured}, {estimated}, counted {host['counted_gb']:.2f} GB"
        if host.get("released_gb") is not None:
            line += f", last release gave back {host['released_gb']:.2f} GB"
        if host.get("not_level1_because"):
            line += f"; not at level 1: {host['not_level1_because']}"
        lines.append(line)
    return lines


def _level(e: dict[str, Any]) -> str:
    """`2 (staged)`: its sleep level, and whether its checkpoint is in the page cache for its next reload."""
    level = e["sleep_level"]
    if level is None:
        return "-"
    staging = e.get("staging") or {}
    note = " (KV)" if level == 0 else " (staging)" if level == 2 and staging.get("running") else \
        " (staged)" if level == 2 and staging.get("staged") else ""
    return f"{level}{note}"


def _drift(drift: dict[str, Any]) -> str:
    """`0.0012/0.05`: the last judged canary's logprob drift and its limit, gate.max_logprob_drift (`-` where unmeasured)."""
    if drift.get("max") is None:  # /admin/status's `max` is that limit
        return "off"
    last = "-" if drift.get("last") is None else f"{drift['last']:.2g}"
    return f"{last}/{drift['max']:g}"


def show(url: str, admin_key: Optional[str]) -> int:
    try:
        status = fetch(url, admin_key)
    except urllib.error.HTTPError as exc:
        print(refusal("status", url, exc.code, admin_key) or f"hotswap status: {url} answered {exc.code}: "
              f"{exc.read().decode(errors='replace')[:300]}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(unreachable("status", url, getattr(exc, "reason", exc)), file=sys.stderr)
        return 1
    except NotARouter as exc:
        print(f"hotswap status: {exc}", file=sys.stderr)
        return 1
    try:
        text = render(status)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # the right keys, with the wrong things in them
        print(f"hotswap status: {url}/admin/status: not a hotswap router's status ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 1
    print(text)
    return 0
