"""`/ui`: one server-rendered status page an operator keeps open. It renders /admin/status, nothing more."""

from __future__ import annotations

import time
from html import escape
from typing import Any

REFRESH_S = 2
STATE_COLOURS = {"awake": "#1a7f37", "sleeping": "#57606a", "failed": "#cf222e", "booting": "#9a6700",
                 "waking": "#9a6700", "verifying": "#8250df", "draining": "#9a6700", "cold": "#57606a"}
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: .4em 0 1em; } td, th { padding: .25em .7em; border-bottom: 1px solid #d0d7de; text-align: left; }
th { background: #f6f8fa; } .state { color: #fff; border-radius: 4px; padding: .1em .5em; }
.bad { color: #cf222e; } .ok { color: #1a7f37; } pre { background: #f6f8fa; padding: .6em; overflow-x: auto; font-size: 12px; }
.muted { color: #57606a; }
"""


def render(status: dict[str, Any], recent_requests: str = "") -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{REFRESH_S}'>",
             f"<title>hotswap</title><style>{STYLE}</style></head><body>",
             f"<h1>hotswap <span class='muted'>— {'ready' if status['ready'] else 'not ready'}, "
             f"{time.strftime('%H:%M:%S')}</span></h1>"]
    parts.append(_placement(status["placement"], status["booted"]))
    parts.append(_engines(status["engines"]))
    parts.append(_swaps(status["swaps"]))
    parts.append(recent_requests)  # router.admin.ui_activity
    for engine in status["engines"]:
        parts.append(_engine_details(engine))
    parts.append("</body></html>")
    return "".join(parts)


def _placement(place: dict[str, Any], booted: bool) -> str:
    """One bar per GPU: each engine's slice (awake shares solid, sleepers' residuals pale), then what is free."""
    rows = [f"<h2>placement{'' if booted else ' (booting)'}</h2><table class='placement'>"
            "<tr><th>GPU</th><th>awake</th><th>residual</th><th>free</th><th>engines</th></tr>"]
    for d in place["devices"]:
        bar = "".join(
            f"<span title='{escape(name)}: {escape(what)}' style='display:inline-block;height:1em;width:{_pct(what)}%;"
            f"background:{'#1a7f37' if not what.startswith('asleep') else '#8c959f'};border-right:1px solid #fff'></span>"
            for name, what in d["engines"].items())
        size = f" ({d['memory_gb']:g} GB)" if d["memory_gb"] else ""
        held = ", ".join(f"{escape(name)} {escape(what)}" for name, what in d["engines"].items()) or "—"
        rows.append(f"<tr id='gpu-{d['index']}'><td>{d['index']}{size}</td><td>{d['planned']:.2f}</td><td>{d['residual']:.2f}</td>"
                    f"<td>{d['free']:.2f}</td><td><div style='width:20em;background:#eaeef2'>{bar}</div>{held}</td></tr>")
    host = place["host"]
    rows.append(f"</table><p class='muted'>host RAM held for sleep: {host['level1_gb']:.2f} of "
                f"{host['ram_budget_gb']:.1f} GB</p>")
    return "".join(rows)


def _pct(what: str) -> float:
    return round(100 * float(what.rsplit(" ", 1)[1]), 2)


def _engines(engines: list[dict[str, Any]]) -> str:
    rows = ["<table class='engines'><tr><th>model</th><th>state</th><th>for</th><th>sleep level</th><th>GPUs × share</th>"
            "<th>wake estimate</th><th>in flight</th>"
            "<th>queued</th><th>acceptance baseline / observed</th><th>restarts</th><th>last gate verdict</th></tr>"]
    for e in engines:
        colour = STATE_COLOURS.get(e["state"], "#57606a")
        verdict = e["last_verdict"] or {}
        aliases = f" <span class='muted'>({escape(', '.join(e['aliases']))})</span>" if e["aliases"] else ""
        booting = f" (deadline in {e['boot_deadline_in_s']:.0f} s)" if e["boot_deadline_in_s"] else ""
        restarts = ", ".join(f"{k} {v}" for k, v in e["restarts_by_reason"].items()) or "0"
        rows.append(
            f"<tr id='engine-{escape(e['name'])}'><td>{escape(e['name'])}{aliases}</td>"
            f"<td><span class='state' style='background:{colour}'>{escape(e['state'])}</span>{booting}</td>"
            f"<td>{e['for_s']:.0f} s</td><td>{e['sleep_level'] or '—'}</td>"
            f"<td>{escape(','.join(map(str, e['devices'])))} × {e['gpu_share']:g}{' (pinned)' if e['pin'] else ''}</td>"
            f"<td>{e['wake_estimate_s']:.1f} s</td><td>{e['in_flight']}</td><td>{e['queued']}</td>"
            f"<td>{_mal(e['baseline_mal'])} / {_mal(e['observed_mal'])}</td><td>{escape(restarts)}</td>"
            f"<td class='{'bad' if verdict.get('result') in ('refused', 'allowed') else 'ok'}'>{escape(verdict.get('result', '—'))}"
            f"<br><span class='muted'>{escape(verdict.get('reason', ''))}</span></td></tr>")
    return "".join(rows) + "</table>"


def _swaps(swaps: list[dict[str, Any]]) -> str:
    if not swaps:
        return "<p class='muted swaps'>no swaps yet</p>"
    rows = ["<h3>last swaps</h3><table class='swaps'><tr><th>at</th><th>parked → woken</th><th>result</th><th>seconds</th><th>phases</th></tr>"]
    for s in swaps:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
        rows.append(f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(s['at']))}</td><td>{escape(', '.join(s['from']) or '—')} → {escape(s['to'])}</td>"
                    f"<td class='{'ok' if s['result'] == 'ok' else 'bad'}'>{escape(s['result'])}</td><td>{s['seconds']:.2f}</td>"
                    f"<td>{escape(phases)}{'<br><span class=bad>' + escape(s['error']) + '</span>' if s['error'] else ''}</td></tr>")
    return "".join(rows) + "</table>"


def _engine_details(e: dict[str, Any]) -> str:
    verdicts = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(v['at']))}</td><td>{escape(v['result'])}</td>"
        f"<td>{_mal(v['baseline_mal'])}</td><td>{_mal(v['observed_mal'])}</td><td>{escape(v['reason'])}</td></tr>"
        for v in e["verdicts"])
    failure = f"<p class='bad'>{escape(e['failure'])}</p>" if e["failure"] else ""
    lines = escape("\n".join(e["last_log_lines"][-15:])) or "(no output yet)"
    attention = e["failure"] or any(v["result"] in ("refused", "allowed") for v in e["verdicts"])
    return (f"<details {'open' if attention else ''}><summary>{escape(e['name'])}: gate verdicts and last log lines"
            f"{' — ' + escape(e['log_file']) if e['log_file'] else ''}</summary>{failure}"
            f"<table><tr><th>at</th><th>verdict</th><th>baseline MAL</th><th>observed MAL</th><th>reason</th></tr>{verdicts}</table>"
            f"<pre>{lines}</pre></details>")


def _mal(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}"
