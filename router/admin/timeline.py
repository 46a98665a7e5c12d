"""GET /admin/timeline?minutes=N: the router's recent history (router.scheduling.History) as JSON, for
other tools and for /ui's pictures. Times are epoch seconds; an interval still running has `to: null`."""

from __future__ import annotations

from typing import Any

from router.scheduling import HISTORY_KEEP_S, History

MAX_MINUTES = HISTORY_KEEP_S / 60
UI_MINUTES = 30.0  # what /ui draws


def window(history: History, minutes: float) -> dict[str, Any]:
    data = history.window(minutes)
    swaps = [{**r.as_dict(), "started": round(r.at - r.seconds, 3)} for r in data["swaps"]]
    return {**data, "minutes": minutes, "swaps": swaps}
