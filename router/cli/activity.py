"""`hotswap activity`: a running router's recent requests (GET /admin/activity) as a table;
`--follow` keeps printing new ones until Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.error
from typing import Any, Optional
from urllib.parse import urlencode

from router.cli.admin_api import NotARouter, fetch_json

FOLLOW_POLL_S = 1.0  # how often --follow asks for new records
CALL_S = 10.0  # each call's timeout
FOLLOW_LIMIT = 10_000  # records one --follow poll may bring (the route's maximum)
COLUMNS = ("TIME", "KEY", "MODEL", "ENGINE", "ENDPOINT", "STATUS", "LEASE", "WAIT s", "TTFB s", "TOTAL s", "TOKENS in/out",
           "MAL", "WAIT PARTS s", "RESUMED/CUT")  # the times in seconds, as the columns say
WIDTHS = (8, 10, 16, 16, 16, 6, 10, 7, 7, 7, 13, 5, 12, 11)


def cells(r: dict[str, Any]) -> tuple[str, ...]:
    lease = ("-" if r["found_awake"] is None else "awake" if r["found_awake"]
             else f"swap {r['swap_id']}" if r["swap_id"] is not None else "waited")
    tokens = "-" if r["prompt_tokens"] is None and r["completion_tokens"] is None else \
        f"{_or_dash(r['prompt_tokens'])}/{_or_dash(r['completion_tokens'])}"
    engine = r["engine"] or (f"peer {r['peer']}" if r.get("peer") else "-")  # a request passed on to another node
    return (time.strftime("%H:%M:%S", time.localtime(r["at"])), r["key_name"] or "-", r["model"] or "-", engine,
            r["endpoint"], str(r["status"]), lease, _seconds(r["queue_wait_s"]), _seconds(r["ttfb_s"]),
            _seconds(r["duration_s"]), tokens, "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
            wait_parts(r), paused_or_cut(r))


def wait_parts(r: dict[str, Any]) -> str:
    """A wait's parts: its swap's seconds and what held it, each reason with its seconds ("swap 0.06 +
    min_active 1.78"), so a wait much longer than its swap says why. `.get`: a router of before has neither."""
    parts = [f"swap {r['swap_s']:.2f}"] if r.get("swap_s") else []
    parts += [f"{reason} {seconds:.2f}" for reason, seconds in (r.get("held") or {}).items()]
    return " + ".join(parts) or "-"


def paused_or_cut(r: dict[str, Any]) -> str:
    """A stream's status stays the 200 it was sent with: this says it was paused and resumed ("resumed ×2
    (drain_deadline, preempted) paused 3.1 s") or cut for good ("cut: tools"), or both. `.get`: a router
    of before has neither key."""
    marks = []
    if r.get("resumed"):
        reasons = r["resumed"].split(",")
        paused = "" if r.get("paused_s") is None else f" paused {r['paused_s']:.1f} s"
        marks.append(f"resumed ×{len(reasons)} ({', '.join(reasons)}){paused}")
    if r.get("cut"):
        marks.append(f"cut: {r['cut']}")
    return "; ".join(marks) or "-"


def widths(rows: list[tuple[str, ...]]) -> tuple[int, ...]:
    """Each column as wide as its longest cell (a long key name, a peer's name), at least its usual width."""
    return tuple(max([w, *(len(r[i]) for r in rows)]) for i, w in enumerate(WIDTHS))


def line(cells: tuple[str, ...], fit: tuple[int, ...] = WIDTHS) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, fit)).rstrip()


def header(fit: tuple[int, ...] = WIDTHS) -> str:
    return line(COLUMNS, fit)


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _or_dash(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _records(url: str, admin_key: Optional[str], **query: Any) -> list[dict[str, Any]]:
    path = "/admin/activity?" + urlencode({k: v for k, v in query.items() if v is not None})
    records = fetch_json(url, path, admin_key, CALL_S, ("enabled", "records"))["records"]
    if not isinstance(records, list):
        raise NotARouter(f"{url.rstrip('/')}/admin/activity: not a hotswap router: `records` is a {type(records).__name__}")
    return records


def _stop_on_ctrl_c_and_sigterm() -> None:
    """--follow ends on Ctrl-C and on SIGTERM, however it was started: a background job of a
    non-interactive shell (`nohup ... &`, a CI runner's script) inherits SIGINT ignored, and Python
    then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def show(url: str, admin_key: Optional[str], model: Optional[str], limit: int, follow: bool) -> int:
    admin_key = admin_key or os.environ.get("HOTSWAP_ADMIN_KEY")
    try:
        records = _records(url, admin_key, model=model, limit=limit)[::-1]  # oldest first, as a log reads
        rows = [cells(r) for r in records]
        fit = widths(rows)  # --follow keeps them: a later, longer cell only pushes its own line
        print(header(fit))
        for r in rows:
            print(line(r, fit))
        since = records[-1]["at"] if records else time.time()
        if follow:
            _stop_on_ctrl_c_and_sigterm()
        while follow:
            sys.stdout.flush()
            time.sleep(FOLLOW_POLL_S)
            records = _records(url, admin_key, model=model, since=repr(since), limit=FOLLOW_LIMIT)[::-1]
            for r in records:
                print(line(cells(r), fit))
            since = records[-1]["at"] if records else since
    except KeyboardInterrupt:
        return 0
    except urllib.error.HTTPError as exc:
        print(f"hotswap activity: {url} answered {exc.code}: {exc.read().decode(errors='replace')[:300]}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        from router.cli.where import unreachable  # only this path needs it

        print(unreachable("activity", url, getattr(exc, "reason", exc)), file=sys.stderr)
        return 1
    except NotARouter as exc:
        print(f"hotswap activity: {exc}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # records of another shape
        print(f"hotswap activity: {url.rstrip('/')}/admin/activity: not a hotswap router's records "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    return 0
