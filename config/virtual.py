"""Virtual models: one name clients use for several equivalent models, and how a request picks
among them (`router.virtuals`)."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Literal

from pydantic import Field, field_validator

from config.merge import Path_, format_field
from config.names import ModelName
from config.sections import Section


class VirtualModel(Section):
    """A name that stands for any of `models`: a request for it is served by one of them."""

    name: ModelName = Field(description="What clients put in `model`; it shares one namespace with models' names and aliases.")
    models: list[ModelName] = Field(
        min_length=1, description="Its members: roster model names (or aliases), in the order `first` tries them and "
        "/v1/models lists them.")
    pick: Literal["awake", "first", "balance"] = Field(
        "awake", description="`awake`: the least loaded awake member, else the one with the shortest predicted wait "
        "(`wake_estimate_s`), else the first that can be placed. `first`: the first awake member, else wake the first. "
        "`balance`: spread over the awake members by requests in flight; wake one more only when the queue on the "
        "awake ones (past their `--max-num-seqs`) predicts a longer wait than its wake.")

    @field_validator("models")
    @classmethod
    def _once_each(cls, models: list[str]) -> list[str]:
        twice = sorted({m for m in models if models.count(m) > 1})
        if twice:
            raise ValueError(f"lists {', '.join(twice)} more than once")
        return models


def check_virtual_models(report: Callable[..., None], entries: Any, owners: dict[str, Path_],
                         members: dict[str, str]) -> None:
    """Each virtual model's name is free (not a model's name or alias, not another virtual model's) and
    each member is a model of this roster. `owners`: where each model name and alias was written;
    `members`: every model name and alias, to the model's name."""
    if not isinstance(entries, list):
        return
    names = dict(owners)
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        base: Path_ = ("virtual_models", i)
        name = entry.get("name")
        if isinstance(name, str):
            if name in names:
                report((*base, "name"), f"'{name}' is already used by {format_field(names[name])}; names, aliases and virtual "
                                        "model names share one namespace")
            else:
                names[name] = (*base, "name")
        listed = entry.get("models") if isinstance(entry.get("models"), list) else []
        seen: dict[str, str] = {}
        for j, member in enumerate(listed):
            if not isinstance(member, str):
                continue
            model = members.get(member)
            if model is None:
                known = ", ".join(sorted(set(members.values()))) or "none"
                report((*base, "models", j), f"'{member}' is not a model of this roster (models: {known}); a virtual "
                                             "model's members are models, not other virtual models")
            elif model in seen and seen[model] != member:
                report((*base, "models", j), f"'{member}' is model '{model}' again (listed as '{seen[model]}')")
            else:
                seen[model] = member


def scope_warnings(keys: list[Any], virtual_models: list[VirtualModel], names_of: dict[str, list[str]]) -> list[tuple[Path_, str]]:
    """Where a key's glob matches a virtual model's name but not all its members (`auth.keys[].models`):
    through that name the key reaches only the members its globs match (`router.virtuals`), which is
    valid and safe, but rarely what was meant. `names_of`: each model name and alias, to all the names
    of its model. A warning, not an error: the router keeps the key in its scope either way, and a
    virtual model added later must not make a roster that loads today refuse to reload."""
    found = []
    for i, key in enumerate(keys):
        globs = list(key.models)
        for virtual in virtual_models:
            matching = [j for j, glob in enumerate(globs) if fnmatch.fnmatchcase(virtual.name, glob)]
            if not matching or virtual.name in globs:  # written as it is: the whole virtual model is given
                continue
            inside = [m for m in virtual.models if any(fnmatch.fnmatchcase(n, g) for n in names_of[m] for g in globs)]
            outside = [m for m in virtual.models if m not in inside]
            if not outside:
                continue
            reach = (f"through it this key reaches only {', '.join(inside)}" if inside else
                     f"this key cannot use '{virtual.name}' at all (404)")
            found.append((("auth", "keys", i, "models", matching[0]),
                          f"'{globs[matching[0]]}' matches virtual model '{virtual.name}' but not its member(s) "
                          f"{', '.join(outside)}: {reach}; to give the key the whole virtual model, "
                          f"add '{virtual.name}' to its models"))
    return found
