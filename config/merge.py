"""How a model entry and `defaults` combine, and where a merged value was written (for messages)."""

from __future__ import annotations

import shlex
from typing import Any, Mapping

Path_ = tuple[Any, ...]


def format_field(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "roster"


def merge_defaults(defaults: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The model's own value wins; env and gate merge key by key; args append."""
    merged = dict(defaults)
    for key, value in entry.items():
        base = merged.get(key)
        if key in ("env", "gate") and isinstance(base, dict) and isinstance(value, dict):
            merged[key] = {**base, **value}
        elif key == "args" and base is not None:
            merged[key] = as_argv(base) + as_argv(value)
        else:
            merged[key] = value
    return merged


def blame(entry: Any, defaults: Mapping[str, Any], index: int, loc: Path_) -> Path_:
    """Where a value of model `index` (at `loc` in the merged model) was written."""
    here: Path_ = ("models", index, *loc)
    if not isinstance(entry, dict):
        return here
    if loc[:1] == ("args",) and len(loc) > 1 and isinstance(loc[1], int) and "args" in defaults and "args" in entry:
        # args append: the first items of the merged list are the defaults'.
        n = len(as_argv(defaults["args"]))
        return ("defaults", *loc) if loc[1] < n else ("models", index, "args", loc[1] - n, *loc[2:])
    if has_path(entry, loc) or not has_path(defaults, loc):
        return here
    return ("defaults", *loc)


def as_argv(value: Any) -> list[Any]:
    if isinstance(value, str):
        return shlex.split(value)
    return list(value) if isinstance(value, list) else [value]


def has_path(data: Any, loc: Path_) -> bool:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return False
    return True
