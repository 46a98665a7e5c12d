"""GET /admin/timeline?minutes=N: the router's recent history (router.scheduling.History) as JSON, for
other tools and for /ui's pictures. Times are epoch seconds; an interval still running has `to: null`."""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.admin.status import _swap_dict
from router.errors import APIError
from router.scheduling import HISTORY_KEEP_S, History

MAX_MINUTES = HISTORY_KEEP_S / 60
UI_MINUTES = 30.0  # what /ui draws


class TimelineQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    minutes: float = Field(UI_MINUTES, gt=0, le=MAX_MINUTES, allow_inf_nan=False)


def timeline(history: History, query: Mapping[str, str]) -> dict[str, Any]:
    """The last `minutes` (default 30, at most 60: what the history keeps); a 400 in OpenAI's shape for bad input."""
    try:
        minutes = TimelineQuery.model_validate(dict(query)).minutes
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"])) or "query"
        raise APIError(400, f"GET /admin/timeline: {where}: {error['msg']} (minutes: a number of minutes, "
                       f"more than 0 and at most {MAX_MINUTES:g}; default {UI_MINUTES:g})", "invalid_timeline_query",
                       param=where) from None
    return window(history, minutes)


def window(history: History, minutes: float) -> dict[str, Any]:
    data = history.window(minutes)
    swaps = [{**_swap_dict(r), "started": round(r.at - r.seconds, 3)} for r in data["swaps"]]
    return {**data, "minutes": minutes, "swaps": swaps}
