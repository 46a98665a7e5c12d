"""`/ui`: one server-rendered status page an operator keeps open. It renders /admin/status and, as pictures
(`router.admin.pictures`), /admin/timeline's last 30 minutes; nothing more."""

from __future__ import annotations

import time
from html import escape
from typing import Any, Optional

from router.admin import pictures

REFRESH_S = 2
STATE_COLOURS = {**pictures.STATE_COLOURS, "sleeping": pictures.STATE_COLOURS["sleeping L2"], "cold": "#8c959f"}
BOOT_REASONS = {"first": "first boot", "stopped": "cold start (it had been stopped)", "roster": "its roster entry changed",
                "gate": "restart: the gate refused a wake", "failed": "restart after a failure or crash",
                "midlife": "restart: acceptance collapsed while serving", "admin": "restart asked by an operator"}
RESIDUAL_MIN_PX = 12  # a sleeper's residual (about 1 % of a GPU) stays visible and can carry its label
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: .4em 0 1em; } td, th { padding: .25em .7em; border-bottom: 1px solid #d0d7de; text-align: left; }
th { background: #f6f8fa; } .state { color: #fff; border-radius: 4px; padding: .1em .5em; }
.bad { color: #cf222e; } .ok { color: #1a7f37; } pre { background: #f6f8fa; padding: .6em; overflow-x: auto; font-size: 12px; }
.muted { color: #57606a; } .warn { color: #9a6700; }
.legend { margin: .3em 0 .6em; font-size: 12px; } .legend div { margin: .15em 0; }
.key { display: inline-block; margin-right: .9em; white-space: nowrap; } .key svg { vertical-align: middle; margin-right: .25em; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: .3em; vertical-align: middle; border: 1px solid #d0d7de; }
.picture { display: block; max-width: 100%; height: auto; margin: .3em 0 1em; }
.bar { display: flex; width: 24em; height: 1.3em; background: #eaeef2; }
.bar span { color: #fff; font-size: 11px; overflow: hidden; white-space: nowrap; border-right: 1px solid #fff; text-align: center; }
"""


def render(status: dict[str, Any], timeline: Optional[dict[str, Any]] = None, recent_requests: str = "") -> str:
    """The page; `timeline`: /admin/timeline's window (router.admin.timeline.window) for the pictures;
    `recent_requests`: the activity log's table (router.admin.ui_activity)."""
    # The page refreshes itself by script (a <meta> refresh without it), so following a log can pause it.
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><noscript><meta http-equiv='refresh' content='{REFRESH_S}'></noscript>",
             f"<title>hotswap</title><style>{STYLE}</style></head><body>",
             f"<h1>hotswap <span class='muted'>— {'simulated (--simulate), ' if status.get('simulated') else ''}"
             f"{'ready' if status['ready'] else 'not ready'}, "
             f"{time.strftime('%H:%M:%S')}</span></h1>"]
    parts.append(_placement(status["placement"], status["booted"]))
    parts.append(_engines(status["engines"]))
    parts.append(_swaps(status["swaps"]))
    if timeline is not None:
        parts.append(_pictures(timeline, status["engines"]))
    parts.append(recent_requests)
    for engine in status["engines"]:
        parts.append(_engine_details(engine))
    parts.append(f"<script>{FOLLOW_SCRIPT % (REFRESH_S * 1000, LOG_LINES)}</script></body></html>")
    return "".join(parts)


def _placement(place: dict[str, Any], booted: bool) -> str:
    """One bar per GPU: each engine's slice in its state's colour (sleepers' residuals pale, at least a few
    pixels wide, labelled), then what is free; a legend under the table."""
    rows = [f"<h2>placement{'' if booted else ' (booting)'}</h2><table class='placement'>"
            "<tr><th>GPU</th><th>awake (share)</th><th>residual (share)</th><th>free (share)</th><th>engines</th></tr>"]
    for d in place["devices"]:
        bar = "".join(
            f"<span class='slice' title='{escape(name)}: {escape(what)}' style='flex:0 0 max({_pct(what)}%, {RESIDUAL_MIN_PX}px);"
            f"background:{pictures.ASLEEP if what.startswith('sleeping') else STATE_COLOURS.get(what.split(' ')[0], '#8c959f')};"
            f"{'color:#1f2328' if what.startswith('sleeping') else ''}'>{escape(name)}</span>"
            for name, what in d["engines"].items())
        size = f" ({d['memory_gb']:g} GB)" if d["memory_gb"] else ""
        held = ", ".join(f"{escape(name)} {escape(what)}" for name, what in d["engines"].items()) or "—"
        rows.append(f"<tr id='gpu-{d['index']}'><td>{d['index']}{size}</td><td>{d['planned']:.2f}</td><td>{d['residual']:.2f}</td>"
                    f"<td>{d['free']:.2f}</td><td><div class='bar'>{bar}</div>{held}</td></tr>")
    rows.append("</table><div class='legend placement-legend'>" + "".join(
        f"<span class='key'><span class='swatch' style='background:{c}'></span>{s}</span>"
        for s, c in (("awake", STATE_COLOURS["awake"]), ("booting", STATE_COLOURS["booting"]), ("waking", STATE_COLOURS["waking"]),
                     ("verifying", STATE_COLOURS["verifying"]), ("draining", STATE_COLOURS["draining"]),
                     ("sleeping: its residual (CUDA context, pools)", pictures.ASLEEP), ("free", "#eaeef2"))) + "</div>")
    host = place["host"]
    rows.append(f"<p class='muted'>host RAM held for sleep: {host['level1_gb']:.2f} of "
                f"{host['ram_budget_gb']:g} GB</p>")
    return "".join(rows)


def _pct(what: str) -> float:
    return round(100 * float(what.rsplit(" ", 1)[1]), 2)


def _engines(engines: list[dict[str, Any]]) -> str:
    rows = ["<table class='engines'><tr><th>model</th><th>state</th><th>for</th><th>sleep level</th><th>GPU: share</th>"
            "<th>wake estimate</th><th>in flight</th>"
            "<th>queued</th><th>acceptance baseline / observed</th><th>restarts</th><th>last gate verdict</th></tr>"]
    for e in engines:
        colour = STATE_COLOURS.get(e["state"], "#57606a")
        verdict = e["last_verdict"] or {}
        aliases = f" <span class='muted'>({escape(', '.join(e['aliases']))})</span>" if e["aliases"] else ""
        booting = _booting(e)
        restarts = ", ".join(f"{k} {v}" for k, v in e["restarts_by_reason"].items()) or "0"
        told = pictures.story(e.get("gate_story", []))  # a refusal a restart repaired stays visible
        shares = ", ".join(f"{d}: {e['gpu_share']:.2f}" for d in e["devices"])  # GPU 0 at share 0.30 reads "0: 0.30"
        rows.append(
            f"<tr id='engine-{escape(e['name'])}'><td>{escape(e['name'])}{aliases}</td>"
            f"<td><span class='state' style='background:{colour}'>{escape(e['state'])}</span>{booting}</td>"
            f"<td>{e['for_s']:.0f} s</td><td>{_level(e['sleep_level'])}</td>"
            f"<td>{escape(shares)}{' (pinned)' if e['pin'] else ''}</td>"
            f"<td>{e['wake_estimate_s']:.1f} s</td><td>{e['in_flight']}</td><td>{_queued(e)}</td>"
            f"<td>{_mal(e['baseline_mal'])} / {_mal(e['observed_mal'])}</td><td>{escape(restarts)}</td>"
            f"<td class='{_verdict_class(verdict, told)}'>{escape(told or verdict.get('result', '—'))}"
            f"<br><span class='muted'>{escape(verdict.get('reason', ''))}</span></td></tr>")
    return "".join(rows) + "</table>"


def _queued(e: dict[str, Any]) -> str:
    """The queue; its batch part (served after interactive) and why that waits for room, when it does."""
    batch = (e.get("queued_by_class") or {}).get("batch", 0)
    if not batch:
        return str(e["queued"])
    why = f"<br><span class='muted'>{escape(e['batch_held_by'])}</span>" if e.get("batch_held_by") else ""
    return f"{e['queued']} ({batch} batch){why}"


def _swaps(swaps: list[dict[str, Any]]) -> str:
    if not swaps:
        return "<p class='muted swaps'>no swaps yet</p>"
    rows = ["<h3>last swaps</h3><table class='swaps'><tr><th>swap</th><th>at</th><th>parked → woken</th><th>result</th><th>seconds</th>"
            "<th>phases</th></tr>"]
    for s in swaps:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
        # the id the activity log's rows link to ("swap N": the swap a request waited for)
        rows.append(f"<tr id='swap-{s['id']}'><td>{s['id']}</td><td>{time.strftime('%H:%M:%S', time.localtime(s['at']))}</td>"
                    f"<td>{escape(', '.join(s['from']) or '—')} → {escape(s['to'])}</td>"
                    f"<td class='{_swap_class(s)}'>{escape(pictures.story(s.get('gates', [])) or s['result'])}</td><td>{s['seconds']:.2f}</td>"
                    f"<td>{escape(phases)}{'<br><span class=bad>' + escape(s['error']) + '</span>' if s['error'] else ''}</td></tr>")
    return "".join(rows) + "</table>"


def _booting(e: dict[str, Any]) -> str:
    """Why a booting engine boots and the step it is in (start, load, gate), beside its deadline."""
    if e["state"] != "booting":
        return f" <span class='muted'>({escape(e['step'])})</span>" if e.get("step") else ""
    why = BOOT_REASONS.get(e.get("boot_reason") or "", e.get("boot_reason") or "")
    step = f", step: {escape(e['step'])}" if e.get("step") else ""
    deadline = f", deadline in {e['boot_deadline_in_s']:.0f} s" if e["boot_deadline_in_s"] else ""
    return f"<br><span class='boot-why muted'>{escape(why)}{step}{deadline}</span>"


def _verdict_class(verdict: dict[str, Any], told: Optional[str]) -> str:
    if verdict.get("result") in ("refused", "allowed"):
        return "bad"
    return "warn" if told else "ok"


def _swap_class(s: dict[str, Any]) -> str:
    if s["result"] != "ok":
        return "bad"
    return "warn" if pictures.story(s.get("gates", [])) else "ok"


def _pictures(timeline: dict[str, Any], engines: list[dict[str, Any]]) -> str:
    devices = {e["name"]: e["devices"] for e in engines}
    return (f"<h2>the last {timeline['minutes']:g} minutes</h2>{pictures.legend()}{pictures.timeline(timeline, devices)}"
            f"<h3>recent swaps, phase by phase</h3>{pictures.phases(timeline['swaps'])}"
            f"<h3>host RAM and GPU shares</h3>{pictures.memory(timeline)}")


def _engine_details(e: dict[str, Any]) -> str:
    verdicts = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(v['at']))}</td><td>{escape(v['result'])}</td>"
        f"<td>{_mal(v['baseline_mal'])}</td><td>{_mal(v['observed_mal'])}</td><td>{escape(v['reason'])}</td></tr>"
        for v in e["verdicts"])
    failure = f"<p class='bad'>{escape(e['failure'])}</p>" if e["failure"] else ""
    lines = escape("\n".join(e["last_log_lines"][-LOG_LINES:])) or "(no output yet)"
    attention = e["failure"] or any(v["result"] in ("refused", "allowed") for v in e["verdicts"])
    return (f"<details {'open' if attention else ''}><summary>{escape(e['name'])}: gate verdicts and last log lines"
            f"{' — ' + escape(e['log_file']) if e['log_file'] else ''}</summary>{failure}"
            f"<table><tr><th>at</th><th>verdict</th><th>baseline MAL</th><th>observed MAL</th><th>reason</th></tr>{verdicts}</table>"
            f"<pre id='log-{escape(e['name'])}' style='max-height:30em;overflow-y:auto'>{lines}</pre>{_follow_button(e)}</details>")


def _follow_button(e: dict[str, Any]) -> str:
    if not e["log_file"]:
        return ""
    return (f"<button type='button' data-model='{escape(e['name'])}' data-log='log-{escape(e['name'])}' "
            "onclick='followLog(this)'>follow</button>")


LOG_LINES = 15
# Refresh every REFRESH_S, except while a log is followed: each "follow" button streams its engine's
# log (GET /admin/logs/M?follow=1, server-sent events) into the <pre> above it, and a refresh would cut it.
FOLLOW_SCRIPT = """
var refreshMs = %d, refresh = setTimeout(function () { location.reload(); }, refreshMs), following = 0;
function followLog(button) {
  var pre = document.getElementById(button.dataset.log);
  if (button.source) {
    button.source.close(); button.source = null; button.textContent = 'follow';
    if (--following === 0) refresh = setTimeout(function () { location.reload(); }, refreshMs);
    return;
  }
  clearTimeout(refresh); following++;
  pre.textContent = ''; button.textContent = 'stop following (the page does not refresh meanwhile)';
  button.source = new EventSource('/admin/logs/' + encodeURIComponent(button.dataset.model) + '?follow=1&lines=%d');
  button.source.onmessage = function (event) {
    var lines = (pre.textContent + event.data + '\\n').split('\\n');
    pre.textContent = lines.slice(-500).join('\\n');
    pre.scrollTop = pre.scrollHeight;
  };
}
// /ui#follow=M opens M's details and follows its log at once (a link that stays on it).
var wanted = decodeURIComponent(location.hash.replace(/^#follow=/, ''));
document.querySelectorAll('button[data-model]').forEach(function (button) {
  if (location.hash.indexOf('#follow=') === 0 && button.dataset.model === wanted) {
    button.closest('details').open = true; followLog(button);
  }
});
"""


def _mal(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}"


def _level(level: object) -> str:
    """A parked engine's rung: level 0 is KV-parked (engines/waking/ladder.py), not "not asleep"."""
    return "—" if level is None else "0 (KV)" if level == 0 else str(level)
