"""What a roster reload changes: which models are new, gone, to be restarted, or changed in place,
and which router-wide keys changed (in place, or not until a restart: RESTART_KEYS).

Pure: two rosters in, a `RosterDiff` out. A model's settings are of two kinds. Those the engine
process was started with (ENGINE_KEYS, and the canary's own keys, since a baseline recorded with
another prompt proves nothing) need a cold restart and a new baseline; every other key is read
by the router only and changes in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Mapping, Optional

from config.schema import ModelSpec, Roster, Section

ENGINE_KEYS = ("model", "url", "tls_ca_file", "port", "command", "launcher", "args", "env", "speculative", "devices", "draft_restore")
CANARY_KEYS = ("enabled", "prompt", "max_tokens", "wake_max_tokens", "lora_canary")  # gate keys that make the canary another one
SECTIONS = ("auth", "queue", "swap", "gpus", "host", "node", "listen", "activity", "virtual_models")  # router-wide
# Keys bound or opened once at start (None: the whole section): a change needs a router restart. Every
# other key of a section is read where it is used, so it changes in place.
RESTART_KEYS: dict[str, Optional[tuple[str, ...]]] = {"listen": None, "activity": None, "node": ("agent_port",)}
WHAT_RESTARTS = {"listen": "the listener", "activity": "the activity log", "node": "the agent's port"}


@dataclass(frozen=True)
class ModelChange:
    spec: ModelSpec  # the new entry
    fields: tuple[str, ...]  # what changed, as dotted keys (`args`, `gate.prompt`)
    restart: bool  # an engine-side key changed: cold restart (at the engine's next idle moment)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class RosterDiff:
    added: tuple[ModelSpec, ...] = ()
    removed: tuple[str, ...] = ()
    revived: tuple[str, ...] = ()  # removed by an earlier reload, back before its engine stopped: it keeps that engine
    changed: tuple[ModelChange, ...] = ()
    unchanged: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()  # router-wide sections with a key changed in place
    needs_restart: tuple[str, ...] = ()  # dotted keys of RESTART_KEYS: not applied

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.revived or self.changed or self.sections or self.needs_restart)

    @property
    def to_size(self) -> tuple[ModelSpec, ...]:
        """The entries whose Level-1 weights the scheduler does not know yet (new, or changed)."""
        return (*self.added, *(c.spec for c in self.changed))

    def as_dict(self) -> dict[str, Any]:
        return {
            "added": [m.name for m in self.added],
            "removed": list(self.removed),
            "revived": list(self.revived),
            "restarting": {c.name: list(c.fields) for c in self.changed if c.restart},
            "changed_in_place": {c.name: list(c.fields) for c in self.changed if not c.restart},
            "unchanged": list(self.unchanged),
            "sections": list(self.sections),
            "needs_restart": list(self.needs_restart),
        }

    def summary(self) -> list[str]:
        """One line per change, as `hotswap reload` prints them and the router logs them."""
        out = [f"+ {m.name}: new; boots in the background" for m in self.added]
        out += [f"- {name}: removed; takes no new requests, stops once its requests are done" for name in self.removed]
        out += [f"+ {name}: revived (was being removed); it serves on" for name in self.revived]
        for c in self.changed:
            what = "restarts at its next idle moment" if c.restart else "changed in place"
            out.append(f"~ {c.name}: {what} ({', '.join(c.fields)})")
        out += [f"~ {section}: changed in place" for section in self.sections]
        out += [f"! {key}: NOT applied: {WHAT_RESTARTS[key.partition('.')[0]]} needs a router restart (still on the old one)"
                for key in self.needs_restart]
        return out or ["no changes"]


def diff(old: Roster, current: Mapping[str, ModelSpec], new: Roster, retiring: AbstractSet[str] = frozenset()) -> RosterDiff:
    """From `old` (the router-wide sections in force) and `current` (each engine's spec as it runs,
    models still draining included) to `new`. `retiring`: the names in `current` an earlier reload
    removed whose engines have not stopped yet; they are not removed again, and one `new` lists is revived."""
    new_names = {m.name for m in new.models}
    added = tuple(m for m in new.models if m.name not in current)
    removed = tuple(name for name in current if name not in new_names and name not in retiring)
    revived = tuple(m.name for m in new.models if m.name in retiring and m.name in current)
    changed, unchanged = [], []
    for spec in new.models:
        if spec.name not in current:
            continue
        change = model_change(current[spec.name], spec)
        if change is not None:
            changed.append(change)
        elif spec.name not in revived:  # bringing a model back is a change, even with the same entry
            unchanged.append(spec.name)
    sections, needs_restart = _section_changes(old, new)
    return RosterDiff(added, removed, revived, tuple(changed), tuple(unchanged), sections, needs_restart)


def _section_changes(old: Roster, new: Roster) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sections with a key that changes in place, the dotted keys that need a restart), key by key."""
    in_place, restart = [], []
    for section in SECTIONS:
        a, b = getattr(old, section), getattr(new, section)
        if a == b:
            continue
        if not isinstance(b, Section):  # gpus: a list (or none), read as a whole
            in_place.append(section)
            continue
        bound = RESTART_KEYS.get(section, ())
        keys = [k for k in type(b).model_fields if getattr(a, k) != getattr(b, k)]
        restart += [f"{section}.{k}" for k in keys if bound is None or k in bound]
        if any(bound is not None and k not in bound for k in keys):
            in_place.append(section)
    return tuple(in_place), tuple(restart)


def model_change(running: ModelSpec, new: ModelSpec) -> Optional[ModelChange]:
    """What going from `running` to `new` changes (None: nothing), and whether it needs a cold restart."""
    fields = _changed_fields(running, new)
    return ModelChange(new, fields, _engine_side(fields)) if fields else None


def _engine_side(fields: tuple[str, ...]) -> bool:
    return any(f in ENGINE_KEYS or (f.startswith("gate.") and f[len("gate."):] in CANARY_KEYS) for f in fields)


def router_side(running: ModelSpec, new: ModelSpec) -> ModelSpec:
    """`running` with the keys of `new` that the router alone reads (aliases, group, pin, ...):
    what an engine waiting for its restart is placed and judged by meanwhile."""
    keep = set(ENGINE_KEYS)
    if any(getattr(running.gate, k) != getattr(new.gate, k) for k in CANARY_KEYS):
        keep.add("gate")  # the running engine's baseline was recorded with its own canary
    return running.model_copy(update={k: getattr(new, k) for k in ModelSpec.model_fields if k not in keep})


def _changed_fields(old: ModelSpec, new: ModelSpec) -> tuple[str, ...]:
    out = []
    for key in ModelSpec.model_fields:
        a, b = getattr(old, key), getattr(new, key)
        if a == b:
            continue
        if key == "gate":
            out += [f"gate.{k}" for k in type(a).model_fields if getattr(a, k) != getattr(b, k)]
        else:
            out.append(key)
    return tuple(out)
