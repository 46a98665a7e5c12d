"""/ui's "recent requests": the activity log's newest records as a table, filtered by model
(`/ui?model=NAME`, links above the table), server-side."""

from __future__ import annotations

import time
from html import escape
from typing import Optional
from urllib.parse import quote

from router.admin.activity import Record, held_parts

ROWS = 50  # records the page shows


def recent_requests(records: list[Record], models: list[str], selected: Optional[str], enabled: bool) -> str:
    if not enabled:
        return "<h2>recent requests</h2><p class='muted'>the activity log is off (activity.ring: 0)</p>"
    links = [f"<a href='/ui'>{'<b>all</b>' if selected is None else 'all'}</a>"]
    for name in sorted({*models, *([selected] if selected else [])}):
        label = f"<b>{escape(name)}</b>" if name == selected else escape(name)
        links.append(f"<a href='/ui?model={escape(quote(name, safe=''))}'>{label}</a>")
    rows = [f"<h2>recent requests</h2><p class='filter'>model: {' · '.join(links)}</p>"]
    if not records:
        return "".join(rows) + "<p class='muted recent'>no requests yet</p>"
    rows.append("<table class='recent'><tr><th>at</th><th>key</th><th>model</th><th>engine</th><th>endpoint</th><th>status</th>"
                "<th>lease</th><th>queue wait</th><th>first byte</th><th>total</th><th>tokens in / out</th><th>MAL</th></tr>")
    for r in records:
        lease = ("—" if r.found_awake is None else "awake" if r.found_awake
                 else f"<a href='#swap-{r.swap_id}'>swap {r.swap_id}</a>" if r.swap_id is not None else "waited")
        rows.append(
            f"<tr class='activity'><td>{time.strftime('%H:%M:%S', time.localtime(r.at))}</td><td>{escape(r.key_name or '—')}</td>"
            f"<td>{escape(r.model or '—')}</td><td>{escape(r.engine or (f'peer {r.peer}' if r.peer else '—'))}</td><td>{escape(r.endpoint)}</td>"
            f"<td class='{'ok' if r.status < 400 else 'bad'}'>{r.status}{_paused_or_cut(r)}</td><td>{lease}</td><td>{_s(r.queue_wait_s)}{_held(r)}</td>"
            f"<td>{_s(r.ttfb_s)}</td><td>{_s(r.duration_s)}</td><td>{_n(r.prompt_tokens)} / {_n(r.completion_tokens)}</td>"
            f"<td>{'—' if r.mean_acceptance_length is None else f'{r.mean_acceptance_length:.2f}'}</td></tr>")
    return "".join(rows) + "</table>"


def _paused_or_cut(r: Record) -> str:
    """Beside the status, which for a stream stays the 200 it was sent with: a mark on an answer that was
    paused and resumed (its reasons and seconds paused in the title) or cut for good (its reason)."""
    marks = ""
    if r.resumed:
        reasons = r.resumed.split(",")
        paused = "" if r.paused_s is None else f", paused {r.paused_s:.1f} s"
        marks += (f" <span class='resumed warn' title='paused and resumed: {escape(', '.join(reasons))}{paused}'>"
                  f"resumed ×{len(reasons)}</span>")
    if r.cut:
        marks += f" <span class='cut bad' title='its answer was cut for good: {escape(r.cut)}'>cut: {escape(r.cut)}</span>"
    return marks


def _held(r: Record) -> str:
    """Beside the queue wait, what held it (router.scheduling.history.WaitParts): each reason with its
    seconds, and the swap's own part in the title, so a long wait behind a short swap says why."""
    parts = held_parts(r.held)
    if not parts:
        return ""
    reasons = ", ".join(f"{reason} {seconds:.2f} s" for reason, seconds in parts.items())
    swap = "" if r.swap_s is None else f"; its swap took {r.swap_s:.2f} s"
    return (f" <span class='held warn' title='held by {escape(reasons)}{swap}'>held {r.held_s or 0:.2f} s: "
            f"{escape(', '.join(parts))}</span>")


def _s(seconds: Optional[float]) -> str:
    return "—" if seconds is None else f"{seconds:.3f} s"


def _n(count: Optional[int]) -> str:
    return "—" if count is None else str(count)
