"""What an unknown roster key most likely meant: a known key spelled nearly so, or a `vllm serve` flag written as a
model key. vLLM's flags reach an engine through `args` only, so `gpu_memory_utilization: 0.85` is answered with the
line to write instead: `args: [--gpu-memory-utilization, 0.85]`."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Iterable, Optional

from config.argv import ROUTER_OWNED_FLAGS
from config.vllm_flags import VLLM_SERVE_FLAGS

NOTHING = object()  # no value to show (a key of a section that is not a model's)
_PLAIN = re.compile(r"[\w./:@+-]+")  # an argv item YAML reads back as written, unquoted


def unknown_key(key: Any, known: Iterable[str], value: Any = NOTHING) -> str:
    """The message for `key`, not one of `known`. `value`: what was written under it, for a model's key (a model
    entry's or `defaults`'), where a vLLM flag gets the `args` line to write instead."""
    known = list(known)
    pointer = as_vllm_flag(key, value) if value is not NOTHING else None
    if pointer:
        return f"unknown key '{key}': {pointer}"
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key '{key}'{hint}"


def as_vllm_flag(key: Any, value: Any) -> Optional[str]:
    """Where a `vllm serve` flag written as a model key goes instead (None: `key` is no such flag, or one the
    router sets itself: those have roster keys of their own, which the close-spelling hint finds)."""
    if not isinstance(key, str) or not key.strip("-_"):
        return None
    flag = "--" + key.strip("-").replace("_", "-")
    if flag not in VLLM_SERVE_FLAGS or flag in ROUTER_OWNED_FLAGS:
        return None
    items = [flag] if value is True else [flag, _item(value)]
    return f"`{flag}` is a vLLM flag, and vLLM's flags go in args: write `args: [{', '.join(items)}]`"


def _item(value: Any) -> str:
    """`value` as one argv item in a YAML flow list; `X` where it has none to show."""
    if isinstance(value, bool) or value is None or isinstance(value, list):
        return "X"
    if isinstance(value, dict):
        return "'" + json.dumps(value).replace("'", "''") + "'"  # vLLM reads a config flag's value as JSON
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)
