"""/ui's pictures, as server-rendered SVG strings drawn from /admin/timeline's data (router.admin.timeline):
the engines' states over time (a lane per engine, grouped by the GPUs it uses, with swap, refusal and
restart markers), each recent swap's phases beside its prediction, and host RAM and GPU shares over
time. Every name is escaped; every element a test or a reader looks for has a class or an id."""

from __future__ import annotations

import time
from html import escape
from typing import Any, Iterable, Optional

WIDTH = 1100
LABEL_W = 150  # the lanes' names
LANE_H = 22
FONT = "font-family='system-ui, sans-serif' font-size='12'"
HALO = "stroke='#fff' stroke-width='3' paint-order='stroke'"  # a label drawn over a chart stays legible

STATE_COLOURS = {  # booting is amber and awake green: a booting engine does not serve
    "awake": "#1a7f37", "booting": "#bf8700", "waking": "#0969da", "verifying": "#8250df", "draining": "#e16f24",
    "sleeping L0": "#afb8c1", "sleeping L1": "#8c959f", "sleeping L2": "#57606a", "cold": "#d0d7de", "failed": "#cf222e"}
ASLEEP = "#afb8c1"  # a sleeper's residual in the GPU chart
PHASE_COLOURS = {
    "drain": "#e16f24", "sleep": "#57606a", "release_kv_cache": "#8c959f", "stage": "#4ac26b", "wake_weights": "#0969da", "reload_draft": "#54aeff",
    "reload_weights": "#218bff", "wake_kv_cache": "#0550ae", "reset_prefix_cache": "#80ccff", "gate": "#8250df",
    "restart": "#cf222e", "boot": "#bf8700"}
OTHER_PHASE = "#d0d7de"
TICKS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800)


def lane_state(interval: dict[str, Any]) -> str:
    return f"sleeping L{interval['level']}" if interval["state"] == "sleeping" and interval.get("level") is not None else interval["state"]


def story(gates: Iterable[str]) -> Optional[str]:
    """What the gate said during a swap, when it is worth telling: "refused → restarted → passed"."""
    gates = list(gates)
    return " → ".join(gates) if any(g in ("refused", "allowed") for g in gates) else None


def timeline(data: dict[str, Any], devices: dict[str, list[int]]) -> str:
    """A lane per engine over the window (from the router's start when it is younger), grouped by the
    GPUs each uses; `devices`: engine -> its GPUs (an engine no longer in the roster: its last lane)."""
    t0, t1 = max(data["since"], data["started"]), data["now"]
    x = _scale(t0, t1, LABEL_W + 10, WIDTH - 10)
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in [*devices, *(n for n in data["engines"] if n not in devices)]:
        groups.setdefault(tuple(devices.get(name, [])), []).append(name)
    rows, y = [], 22
    for gpus, names in sorted(groups.items()):
        title = f"GPU {gpus[0]}" if len(gpus) == 1 else (f"GPUs {', '.join(map(str, gpus))}" if gpus else "not in the roster")
        rows.append(f"<text class='gpu-group' x='4' y='{y + 12}' font-weight='600'>{escape(title)}</text>")
        y += 18
        for name in names:
            rows.append(_lane(name, data, x, t0, t1, y))
            y += LANE_H + 4
        y += 6
    axis = _axis(x, t0, t1, y)
    return (f"<svg id='timeline' class='picture' xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {WIDTH} {y + 24}' "
            f"width='{WIDTH}' height='{y + 24}' {FONT}>"
            f"<text x='4' y='12' class='muted'>engine states since {_hms(t0)} (the last {data['minutes']:g} min, or since the "
            f"router started)</text>{''.join(rows)}{axis}</svg>")


def _lane(name: str, data: dict[str, Any], x: Any, t0: float, t1: float, y: float) -> str:
    n = escape(name)
    parts = [f"<g class='lane' id='lane-{n}' data-engine='{n}'>",
             f"<text x='4' y='{y + 15}'>{n}</text>",
             f"<rect x='{x(t0):.1f}' y='{y}' width='{x(t1) - x(t0):.1f}' height='{LANE_H}' fill='#fff' stroke='#d0d7de'/>"]
    for interval in data["engines"].get(name, []):
        start, end = max(interval["from"], t0), min(interval["to"] or t1, t1)
        if end < t0 or start > t1:
            continue
        if interval["state"] == "removed":  # the lane ends here: the engine left the roster
            parts.append(f"<text class='lane-removed' x='{x(start) + 3:.1f}' y='{y + 15}' font-size='11' fill='#57606a'>"
                         f"removed<title>{n}: removed from the roster at {_hms(interval['from'])}</title></text>")
            continue
        state = lane_state(interval)
        until = _hms(interval["to"]) if interval["to"] else "now"
        parts.append(f"<rect class='interval state-{escape(state.replace(' ', '-'))}' x='{x(start):.1f}' y='{y}' "
                     f"width='{max(x(end) - x(start), 1):.1f}' height='{LANE_H}' fill='{STATE_COLOURS.get(state, OTHER_PHASE)}'>"
                     f"<title>{n}: {escape(state)} {_hms(interval['from'])}–{until}</title></rect>")
    for swap in data["swaps"]:
        if swap["to"] == name and t0 <= swap["at"] <= t1:
            told = story(swap.get("gates", [])) or swap["result"]
            cx = x(swap["at"])
            parts.append(f"<path class='swap-marker' d='M{cx - 6:.1f},{y - 3} h12 l-6,8 z' fill='#1f2328'>"
                         f"<title>swap {escape(', '.join(swap['from']) or '—')} → {n}: {escape(told)}, "
                         f"{swap['seconds']:.2f} s</title></path>")
    marks = [m for m in data["marks"] if m["engine"] == name and t0 <= m["at"] <= t1]
    for mark in sorted(marks, key=lambda m: m["kind"] != "restart"):  # a refusal is drawn over its restart
        parts.append(_marker(mark, x(mark["at"]), y + (LANE_H if mark["kind"] == "restart" else LANE_H / 2), n))
    parts.append("</g>")
    return "".join(parts)


def _marker(mark: dict[str, Any], cx: float, cy: float, name: str) -> str:
    title = f"<title>{name}: {escape(mark['kind'])}{': ' + escape(mark['detail']) if mark['detail'] else ''} at {_hms(mark['at'])}</title>"
    if mark["kind"] == "restart":
        return (f"<circle class='restart-marker' cx='{cx:.1f}' cy='{cy:.1f}' r='5' fill='#fff' stroke='#cf222e' "
                f"stroke-width='2.5'>{title}</circle>")
    if mark["kind"] == "ahead":  # a wake ahead of demand (woken), then its outcome (used, unused, failed)
        return (f"<polygon class='ahead-marker' points='{cx - 5:.1f},{cy - 6:.1f} {cx + 6:.1f},{cy:.1f} {cx - 5:.1f},{cy + 6:.1f}' "
                f"fill='{'#1a7f37' if mark['detail'] == 'used' else '#8c959f'}'>{title}</polygon>")
    if mark["kind"] == "preempt":  # a pause sign: its batch streams were paused, to be resumed
        return (f"<g class='preempt-marker'>{title}<rect x='{cx - 6:.1f}' y='{cy - 7:.1f}' width='12' height='14' fill='#fff'/>"
                f"<path d='M{cx - 3:.1f},{cy - 6:.1f} v12 M{cx + 3:.1f},{cy - 6:.1f} v12' stroke='#9a6700' stroke-width='3'/></g>")
    colour, css = ("#cf222e", "refusal-marker") if mark["kind"] == "refused" else ("#e16f24", "allowed-marker")
    return (f"<g class='{css}'>{title}<circle cx='{cx:.1f}' cy='{cy:.1f}' r='8' fill='#fff'/>"
            f"<path d='M{cx - 5:.1f},{cy - 5:.1f} l10,10 M{cx + 5:.1f},{cy - 5:.1f} l-10,10' stroke='{colour}' "
            f"stroke-width='3'/></g>")


def _axis(x: Any, t0: float, t1: float, y: float) -> str:
    span = max(t1 - t0, 1e-9)
    step = next((s for s in TICKS_S if span / s <= 8), TICKS_S[-1])
    ticks = [f"<line x1='{x(t0):.1f}' y1='{y}' x2='{x(t1):.1f}' y2='{y}' stroke='#8c959f'/>"]
    tick = (t0 // step + 1) * step
    while x(tick) < x(t1) - 60:  # no tick label under "now"
        ticks.append(f"<line x1='{x(tick):.1f}' y1='{y}' x2='{x(tick):.1f}' y2='{y + 4}' stroke='#8c959f'/>"
                     f"<text x='{x(tick):.1f}' y='{y + 16}' text-anchor='middle' fill='#57606a'>{_hms(tick)}</text>")
        tick += step
    ticks.append(f"<text x='{x(t1):.1f}' y='{y + 16}' text-anchor='end' fill='#57606a'>now</text>")
    return f"<g class='axis'>{''.join(ticks)}</g>"


def phases(swaps: list[dict[str, Any]], limit: int = 8) -> str:
    """The `limit` most recent swaps, newest first: a stacked bar of each one's phases, in the order they
    ran, and under it a thin bar of what was predicted, on one scale."""
    recent = sorted(swaps, key=lambda s: s["at"], reverse=True)[:limit]
    if not recent:
        return "<p class='muted no-swap-phases'>no swaps in the window</p>"
    label_w, right_w, row_h = 250, 190, 34
    longest = max(max(s["seconds"], sum(s["phases"].values()), s["predicted_s"]) for s in recent) or 1.0
    x = _scale(0, longest, label_w, WIDTH - right_w)
    rows = []
    for i, s in enumerate(recent):
        y = 8 + i * row_h
        told = story(s.get("gates", []))
        css = "bad" if s["result"] != "ok" else ("warn" if told else "ok")
        parts = [f"<g class='swap-phases {css}' data-to='{escape(s['to'])}'>",
                 f"<text x='4' y='{y + 12}'>{_hms(s['at'])} {escape(', '.join(s['from']) or '—')} → {escape(s['to'])}</text>",
                 f"<text x='4' y='{y + 26}' class='swap-story' fill='{_CSS_FILL[css]}'>{escape(told or s['result'])}</text>"]
        at = 0.0
        for phase, seconds in s["phases"].items():  # the order the record has is the order they ran
            parts.append(f"<rect class='phase phase-{escape(phase)}' x='{x(at):.1f}' y='{y}' width='{max(x(at + seconds) - x(at), 1):.1f}' "
                         f"height='16' fill='{PHASE_COLOURS.get(phase, OTHER_PHASE)}' stroke='#fff'>"
                         f"<title>{escape(phase)}: {seconds:.2f} s</title></rect>")
            if x(at + seconds) - x(at) > 7 * (len(phase) + 8):  # named inside when it fits
                parts.append(f"<text x='{(x(at) + x(at + seconds)) / 2:.1f}' y='{y + 12}' text-anchor='middle' fill='#fff' "
                             f"font-size='11'>{escape(phase)} {seconds:.2f} s</text>")
            at += seconds
        parts.append(f"<rect class='predicted' x='{x(0):.1f}' y='{y + 19}' width='{max(x(s['predicted_s']) - x(0), 1):.1f}' "
                     f"height='5' fill='#8c959f'><title>predicted {s['predicted_s']:.2f} s</title></rect>")
        parts.append(f"<text x='{WIDTH - right_w + 8}' y='{y + 12}'>{s['seconds']:.2f} s</text>"
                     f"<text x='{WIDTH - right_w + 8}' y='{y + 26}' fill='#57606a'>predicted {s['predicted_s']:.2f} s</text></g>")
        rows.append("".join(parts))
    height = 8 + len(recent) * row_h
    return (f"<svg id='swap-phases' class='picture' xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {WIDTH} {height}' "
            f"width='{WIDTH}' height='{height}' {FONT}>{''.join(rows)}</svg>")


_CSS_FILL = {"ok": "#1a7f37", "warn": "#9a6700", "bad": "#cf222e"}


def memory(data: dict[str, Any]) -> str:
    """Host RAM held for Level 1 against its budget, then each GPU's shares stacked per engine (awake and
    on the way in or out in the engine's state colour, sleepers' residuals pale), as step charts; each
    chart's values now are written above its right end."""
    samples = data["samples"]
    if not samples:
        return "<p class='muted'>no memory samples yet</p>"
    t0, t1 = max(data["since"], data["started"]), data["now"]
    x = _scale(t0, t1, LABEL_W + 10, WIDTH - 10)
    spans = [(max(s["at"], t0), nxt["at"] if nxt else t1, s) for s, nxt in zip(samples, [*samples[1:], None])]
    parts, y = [_host_chart(spans, x, t0, t1, 0)], CHART_H + 28
    for device in sorted({d for s in samples for d in s["gpus"]}, key=int):
        parts.append(_gpu_chart(device, spans, x, t0, t1, y))
        y += CHART_H + 28
    return (f"<svg id='memory' class='picture' xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {WIDTH} {y}' "
            f"width='{WIDTH}' height='{y}' {FONT}>{''.join(parts)}</svg>")


CHART_H = 60


def _chart(title: str, unit: str, now: str, x: Any, t0: float, t1: float, y: float) -> str:
    """A chart's frame: its title and unit on the left, its values now above its right end."""
    return (f"<text x='4' y='{y + 30}' font-weight='600'>{escape(title)}</text>"
            f"<text x='4' y='{y + 46}' fill='#57606a'>{escape(unit)}</text>"
            f"<text x='{x(t1):.1f}' y='{y + 12}' text-anchor='end' fill='#57606a'>now: {escape(now)}</text>"
            f"<rect x='{x(t0):.1f}' y='{y + 16}' width='{x(t1) - x(t0):.1f}' height='{CHART_H}' fill='#f6f8fa'/>")


def _host_chart(spans: list[tuple[float, float, dict[str, Any]]], x: Any, t0: float, t1: float, y: float) -> str:
    last = spans[-1][2]
    top = max(max(s["budget_gb"], s["host_gb"]) for _, _, s in spans) or 1.0
    base = y + 16 + CHART_H
    parts = [_chart("host RAM", "for Level 1 (GB)", f"{last['host_gb']:.3g} GB", x, t0, t1, y)]
    for a, b, s in spans:
        h = CHART_H * s["host_gb"] / top
        parts.append(f"<rect class='host-ram' x='{x(a):.1f}' y='{base - h:.1f}' width='{max(x(b) - x(a), 0.5):.1f}' "
                     f"height='{h:.1f}' fill='#8c959f'><title>{s['host_gb']:.3g} of {s['budget_gb']:.3g} GB</title></rect>")
    budget_y = base - CHART_H * last["budget_gb"] / top
    parts.append(f"<line class='host-budget' x1='{x(t0):.1f}' y1='{budget_y:.1f}' x2='{x(t1):.1f}' y2='{budget_y:.1f}' "
                 f"stroke='#cf222e' stroke-dasharray='4 3'/><text x='{x(t0) + 4:.1f}' y='{budget_y + 12:.1f}' fill='#cf222e' "
                 f"{HALO}>budget {last['budget_gb']:.3g} GB</text>")
    return "".join(parts)


def _gpu_chart(device: str, spans: list[tuple[float, float, dict[str, Any]]], x: Any, t0: float, t1: float, y: float) -> str:
    held_now = sorted(spans[-1][2]["gpus"].get(device, {}).items())
    now = ", ".join(f"{n} {h['share']:.2f}" for n, h in held_now) or "nothing"
    parts = [f"<g class='gpu-shares' id='gpu-shares-{escape(device)}'>", _chart(f"GPU {device}", "shares (0–1)", now, x, t0, t1, y)]
    base = y + 16 + CHART_H
    for a, b, s in spans:
        stacked = 0.0
        for name, held in sorted(s["gpus"].get(device, {}).items()):
            h = max(CHART_H * min(held["share"], 1.0), 2.0 if held["share"] > 0 else 0.0)  # a residual stays visible
            colour = ASLEEP if held["state"] in ("sleeping", "kv-parked") else STATE_COLOURS.get(held["state"], OTHER_PHASE)
            width = max(x(b) - x(a), 0.5)
            parts.append(f"<rect x='{x(a):.1f}' y='{base - stacked - h:.1f}' width='{width:.1f}' "
                         f"height='{h:.1f}' fill='{colour}' stroke='#fff' stroke-width='0.5'>"
                         f"<title>{escape(name)}: {escape(held['state'])} {held['share']:.3g}</title></rect>")
            if width > 8 * len(name) + 8 and h > 13:  # colours tell states apart, not engines: name the engine
                parts.append(f"<text class='share-label' x='{x(a) + 4:.1f}' y='{base - stacked - h / 2 + 4:.1f}' "
                             f"font-size='11' fill='{'#1f2328' if colour in (ASLEEP, STATE_COLOURS['cold']) else '#fff'}'>{escape(name)}</text>")
            stacked += h
    return "".join(parts) + "</g>"


def legend() -> str:
    """The colours and markers, once for all three pictures (HTML, so it wraps)."""
    states = "".join(f"<span class='key'><span class='swatch' style='background:{c}'></span>{escape(s)}</span>"
                     for s, c in STATE_COLOURS.items())
    marks = ("<span class='key'><svg width='14' height='12'><path d='M1,1 h12 l-6,8 z' fill='#1f2328'/></svg>swap ended</span>"
             "<span class='key'><svg width='16' height='16'><path d='M3,3 l10,10 M13,3 l-10,10' stroke='#cf222e' stroke-width='3'/>"
             "</svg>gate refused</span><span class='key'><svg width='16' height='16'><path d='M3,3 l10,10 M13,3 l-10,10' "
             "stroke='#e16f24' stroke-width='3'/></svg>promoted despite a refusal</span><span class='key'><svg width='16' height='16'><circle cx='8' cy='8' r='5' fill='#fff' "
             "stroke='#cf222e' stroke-width='2.5'/></svg>cold restart</span>")
    phase_keys = "".join(f"<span class='key'><span class='swatch' style='background:{c}'></span>{escape(p)}</span>"
                         for p, c in PHASE_COLOURS.items())
    return (f"<div class='legend' id='legend'><div><b>states</b> {states}</div><div><b>markers</b> {marks}</div>"
            f"<div><b>swap phases</b> {phase_keys}<span class='key'><span class='swatch' style='background:#8c959f;"
            f"height:4px'></span>predicted</span></div></div>")


def _scale(lo: float, hi: float, left: float, right: float) -> Any:
    span = max(hi - lo, 1e-9)
    return lambda t: left + (t - lo) / span * (right - left)


def _hms(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))
