"""What a client may put in `model`: one word. Model names, aliases and virtual model names share it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field


def _one_word(name: str) -> str:
    # The agent protocol (`<key> <model> backup`) and the front's routing rule carry a name as one word.
    bad = next((c for c in name if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"{name!r} has {'a space' if bad == ' ' else repr(bad)} at position {name.index(bad)}: names and "
                         "aliases are one word, without whitespace or control characters (HAProxy's agent-send line and "
                         "the front's routing rule cannot carry them)")
    return name


ModelName = Annotated[str, Field(min_length=1), AfterValidator(_one_word)]
