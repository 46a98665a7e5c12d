"""Load roster.yaml into a `Roster`, or report every problem as `file:line:col: field: message`.

The YAML is composed once into a node tree: the tree gives each key and value its line and
column, and the same nodes are constructed into plain data. pydantic validates the data;
its error locations (`('models', 1, 'sleep_level')`) are mapped back to node marks.

In argv lists (`args`, `launcher`, `command`) a number, boolean or date is taken as the text
written in the file: `[--gpu-memory-utilization, 0.85]` needs no quotes, and `0.10` stays
`0.10` (YAML would make it the float 0.1).
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import yaml
from pydantic import BaseModel, ValidationError

from config.schema import (
    GPU_SHARE_FLAG,
    IDENTITY_KEYS,
    VLLM_DEFAULT_GPU_SHARE,
    Auth,
    Gpu,
    Host,
    Listen,
    ModelDefaults,
    ModelSpec,
    Node,
    Queue,
    Roster,
    Swap,
    _flag_name,
    _flag_value,
)

Path_ = tuple[Any, ...]
SECTIONS: dict[str, type[BaseModel]] = {"listen": Listen, "auth": Auth, "queue": Queue, "swap": Swap, "host": Host, "node": Node}
TOP_LEVEL_KEYS = (*SECTIONS, "gpus", "defaults", "models")
SECRET_PATHS = (("auth", "admin_key"), ("auth", "api_keys"))
ARGV_KEYS = ("args", "launcher", "command")
# Scalars YAML would turn into something else than a string; in an argv list they keep their spelling.
_TEXT_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("int", "float", "bool", "timestamp"))
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True, order=True)
class Issue:
    source: str
    line: int
    col: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}:{self.col}: {self.field}: {self.message}"


class RosterError(Exception):
    """Every problem found in a roster, in file order."""

    def __init__(self, issues: Iterable[Issue]):
        self.issues = sorted(set(issues))
        super().__init__("\n".join(map(str, self.issues)))


def load_roster(path: str | os.PathLike[str], environ: Optional[Mapping[str, str]] = None) -> Roster:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RosterError([Issue(source, 1, 1, "roster", f"cannot read file: {exc}")]) from None
    return parse_roster(text, source, environ)


def parse_roster(text: str, source: str = "<roster>", environ: Optional[Mapping[str, str]] = None) -> Roster:
    return _Loader(source, os.environ if environ is None else environ).load(text)


def format_field(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "roster"


class _Loader:
    def __init__(self, source: str, environ: Mapping[str, str]):
        self.source = source
        self.environ = environ
        self.issues: list[Issue] = []
        self.value_marks: dict[Path_, tuple[int, int]] = {}
        self.key_marks: dict[Path_, tuple[int, int]] = {}
        self.scalar_text: dict[Path_, str] = {}  # non-string scalars as written, e.g. '0.10'

    # -- reporting -------------------------------------------------------------------

    def report(self, path: Path_, message: str, *, at_key: bool = False) -> None:
        field = format_field(path)
        if any(issue.field == field for issue in self.issues):
            return  # one problem per field: the first is the cause (an unset ${VAR} makes an empty string)
        line, col = self.mark(path, at_key=at_key)
        self.issues.append(Issue(self.source, line, col, field, message))

    def mark(self, path: Path_, *, at_key: bool = False) -> tuple[int, int]:
        if at_key and path in self.key_marks:
            return self.key_marks[path]
        return _mark(self.value_marks, path)

    # -- stages ----------------------------------------------------------------------

    def load(self, text: str) -> Roster:
        data = self.parse_yaml(text)
        if not self.issues:
            data = self.resolve_env(self.keep_argv_spelling(data), ())
            roster = self.validate(data)
            if not self.issues and roster is not None:
                return roster
        raise RosterError(self.issues)

    def parse_yaml(self, text: str) -> Any:
        loader = None
        try:
            loader = yaml.SafeLoader(text)
            node = loader.get_single_node()
            if node is None:
                self.issues.append(Issue(self.source, 1, 1, "roster", "file is empty; a roster needs at least `models:`"))
                return None
            self.index(node, ())
            data = loader.construct_document(node)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            what = " ".join(filter(None, [exc.context, exc.problem]))
            self.issues.append(Issue(self.source, line, col, "yaml", f"syntax error: {what}"))
            return None
        except yaml.reader.ReaderError as exc:
            line, col = _line_col(text, exc.position)
            self.issues.append(Issue(self.source, line, col, "yaml", f"character {exc.character!r} is not allowed in YAML"))
            return None
        finally:
            if loader is not None:
                loader.dispose()
        if not isinstance(data, dict):
            kind = type(data).__name__ if data is not None else "null"
            self.report((), f"must be a mapping with `models:` (and optionally {', '.join(SECTIONS)}, defaults); found a {kind}")
        return data

    def index(self, node: yaml.Node, path: Path_) -> None:
        self.value_marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                key = key_node.value
                child = (*path, key)
                self.key_marks[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                if key in seen:
                    # PyYAML keeps the last duplicate silently; an operator's edit would vanish.
                    self.report(child, "duplicate key (the later one would silently win)", at_key=True)
                seen.add(key)
                self.index(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.index(item, (*path, i))
        elif node.tag in _TEXT_TAGS:
            self.scalar_text[path] = node.value

    def keep_argv_spelling(self, data: dict[str, Any]) -> dict[str, Any]:
        """Numbers, booleans and dates in argv lists become the text the operator wrote."""
        models = data.get("models")
        holders: list[Path_] = [("defaults",), *(("models", i) for i in range(len(models) if isinstance(models, list) else 0))]
        for base in holders:
            holder = data.get(base[0]) if len(base) == 1 else models[base[1]]
            if not isinstance(holder, dict):
                continue
            for key in ARGV_KEYS:
                items = holder.get(key)
                if isinstance(items, list):
                    holder[key] = [self.scalar_text.get((*base, key, j), item) for j, item in enumerate(items)]
        return data

    def resolve_env(self, value: Any, path: Path_) -> Any:
        if isinstance(value, dict):
            return {k: self.resolve_env(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve_env(v, (*path, i)) for i, v in enumerate(value)]
        if not isinstance(value, str):
            return value
        if path[:2] in SECRET_PATHS and not _ENV_REF.search(value):
            self.report(path, "write secrets as ${ENV_VAR} and set them in the environment, never in the file")
            return value

        def substitute(match: re.Match[str]) -> str:
            name, fallback = match.group(1), match.group(2)
            if name in self.environ:
                return self.environ[name]
            if fallback is not None:
                return fallback
            self.report(path, f"environment variable {name} is not set (referenced as ${{{name}}})")
            return ""

        return _ENV_REF.sub(substitute, value)

    def validate(self, data: dict[str, Any]) -> Optional[Roster]:
        for key in data:
            if key not in TOP_LEVEL_KEYS:
                self.report((key,), _unknown_key(key, TOP_LEVEL_KEYS), at_key=True)
        sections = {name: self.validate_model(cls, data.get(name) or {}, (name,)) for name, cls in SECTIONS.items()}
        gpus = self.validate_gpus(data.get("gpus"))
        defaults = self.check_defaults(data.get("defaults") or {})
        raw_models = data.get("models")
        if not isinstance(raw_models, list) or not raw_models:
            self.report(("models",), "needs at least one model (a list of mappings with `name:`)", at_key="models" in data)
            return None
        models = [self.validate_entry(entry, defaults, i) for i, entry in enumerate(raw_models)]
        self.check_across(raw_models, defaults, sections["listen"])
        whole_gpus = gpus is not None and len(gpus) == len(data["gpus"])  # a broken entry would make indexes look unknown
        self.check_placement(raw_models, defaults, sorted({g.index for g in gpus}) if whole_gpus else None)
        if self.issues:
            return None
        roster = Roster(source=self.source, models=models, gpus=gpus, **sections)
        roster._located = Locations(self.value_marks, defaults, raw_models)
        return roster

    def validate_model(self, cls: type[BaseModel], value: Any, path: Path_, blame=None) -> Any:
        if not isinstance(value, dict):
            self.report(path, f"must be a mapping (found {type(value).__name__})")
            return None
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            for err in exc.errors():
                where = (blame or (lambda loc: (*path, *loc)))(err["loc"])
                self.report(where, _message(err, cls, err["loc"]), at_key=err["type"] == "extra_forbidden")
            return None

    def validate_gpus(self, value: Any) -> Optional[list[Gpu]]:
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            self.report(("gpus",), "must be a list of {index: N, memory_gb: GB}, one per GPU (or leave it out to discover them)")
            return None
        gpus = []
        for i, entry in enumerate(value):
            gpu = self.validate_model(Gpu, entry, ("gpus", i))
            if gpu is None:
                continue
            if any(g.index == gpu.index for g in gpus):
                self.report(("gpus", i, "index"), f"GPU {gpu.index} is listed twice")
            gpus.append(gpu)
        return gpus

    def check_defaults(self, defaults: Any) -> dict[str, Any]:
        if not isinstance(defaults, dict):
            self.report(("defaults",), "must be a mapping of model keys")
            return {}
        kept = {}
        for key, value in defaults.items():
            if key in IDENTITY_KEYS:
                self.report(("defaults", key), f"'{key}' identifies one engine; set it on each model, not in defaults", at_key=True)
            elif key not in ModelDefaults.model_fields:
                self.report(("defaults", key), _unknown_key(key, ModelDefaults.model_fields), at_key=True)
            else:
                kept[key] = value
        return kept

    def validate_entry(self, entry: Any, defaults: dict[str, Any], index: int) -> Optional[ModelSpec]:
        path = ("models", index)
        if not isinstance(entry, dict):
            self.report(path, "must be a mapping with at least `name:` and one of model, command, url")
            return None

        return self.validate_model(ModelSpec, merge_defaults(defaults, entry), path, lambda loc: _blame(entry, defaults, index, loc))

    def check_across(self, entries: list[Any], defaults: dict[str, Any], listen: Optional[Listen]) -> None:
        """Names, ports and group defaults must be unique across models.

        Runs on the raw entries, so a clash is reported even beside a model's other errors.
        """
        owners: dict[str, Path_] = {}
        ports: dict[int, Path_] = {listen.port: ("listen", "port")} if listen else {}
        group_default: dict[str, Path_] = {}

        def claim(table: dict[Any, Path_], key: Any, where: Path_, message: str) -> None:
            if key in table:
                self.report(where, message.format(key=key, other=format_field(table[key])))
            else:
                table[key] = where

        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                continue
            merged = merge_defaults(defaults, entry)
            base: Path_ = ("models", i)
            aliases = merged.get("aliases") if isinstance(merged.get("aliases"), list) else []
            for where, name in [((*base, "name"), merged.get("name")), *(((*base, "aliases", j), a) for j, a in enumerate(aliases))]:
                if isinstance(name, str):
                    claim(owners, name, where, "'{key}' is already used by {other}; names and aliases must be unique")
            if isinstance(merged.get("port"), int):
                claim(ports, merged["port"], (*base, "port"), "port {key} is already taken by {other}")
            group = merged.get("group")
            if merged.get("default") is True and isinstance(group, str):
                claim(group_default, group, (*base, "default"), "group '{key}' already has its default model at {other}")

    def check_placement(self, entries: list[Any], defaults: dict[str, Any], known_gpus: Optional[list[int]]) -> None:
        """Placements no scheduling can satisfy: a device `gpus:` does not list, pinned models
        (always awake) that overcommit a device or share a group, and a model whose share never
        fits beside the pinned ones on its devices.

        Runs on the raw entries (defaults merged); a value the schema refuses is left to the
        schema's message.
        """
        placed = [p for i, entry in enumerate(entries) if (p := _Placed.of(entry, defaults, i)) is not None]

        if known_gpus is not None:
            known = ", ".join(map(str, known_gpus))
            for p in placed:
                for j, device in enumerate(p.devices):
                    if device not in known_gpus:
                        self.report(p.blame(("devices", j)), f"GPU {device} is not in gpus: (known: {known})")

        pinned = [p for p in placed if p.pin and p.share is not None]
        # Pinned models are always awake: on each device their shares must add up to at most 1.0.
        held: dict[int, float] = {}
        for p in pinned:
            for device in dict.fromkeys(p.devices):  # a device listed twice is the schema's error, counted once here
                before = held.get(device, 0.0)
                held[device] = before + p.share
                if _over(held[device]) and not _over(before):
                    on_device = [q for q in pinned if device in q.devices]
                    self.report(p.blame(("pin",)), (
                        f"pinned models need {_num(sum(q.share for q in on_device))} of GPU {device} ({_shares(on_device)}), "
                        "more than 1.0; pinned models are always awake, so their --gpu-memory-utilization "
                        "on one GPU must add up to at most 1.0"))
        # A group keeps one model awake at a time; a pinned model is always awake.
        pinned_in: dict[str, _Placed] = {}
        for p in placed:
            if not p.pin or p.group is None:
                continue
            if p.group in pinned_in:
                first = pinned_in[p.group]
                self.report(p.blame(("group",)), (
                    f"'{p.name}' and '{first.name}' ({format_field(first.path)}) are both pinned in group '{p.group}'; "
                    "a group keeps one model awake at a time and a pinned model is always awake: "
                    "unpin one or move it to another group"))
            else:
                pinned_in[p.group] = p
        for p in placed:
            first = pinned_in.get(p.group) if p.group is not None and not p.pin else None
            if first is not None:
                self.report(p.blame(("group",)), (
                    f"'{p.name}' shares group '{p.group}' with '{first.name}' ({format_field(first.path)}), which is pinned: "
                    "a group keeps one model awake at a time and a pinned model is always awake, so it could never wake; "
                    "move it to another group or unpin that one"))
        # A model that is not pinned must fit beside every pinned model on each of its devices.
        for p in placed:
            if p.pin or p.share is None:
                continue
            for device in p.devices:
                others = [q for q in pinned if device in q.devices]
                taken = sum(q.share for q in others)
                if not _over(taken + p.share):
                    continue
                room = 1.0 - taken
                fix = (f"lower its --gpu-memory-utilization to at most {_num(room)}" if room > 1e-9
                       else "move it to another GPU")
                self.report(p.blame(("args", p.share_at)) if p.share_at is not None else p.path, (
                    f"'{p.name}' {p.share_words} of GPU {device} when awake, but the pinned models there always "
                    f"hold {_num(taken)} ({_shares(others)}): {_num(taken + p.share)} > 1.0, so it could never wake; "
                    f"{fix}, or unpin one of them"))
                break


@dataclass(frozen=True, eq=False)
class _Placed:
    """What placement needs of one raw model entry (defaults merged), and where it was written."""

    path: Path_
    name: str
    devices: list[int]
    pin: bool
    group: Optional[str]
    share: Optional[float]  # None: the schema refuses the value
    share_at: Optional[int]  # index in the merged args of the item holding the value; None: vLLM's default
    entry: dict[str, Any]
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, entry: Any, defaults: dict[str, Any], index: int) -> Optional["_Placed"]:
        if not isinstance(entry, dict):
            return None
        merged = merge_defaults(defaults, entry)
        devices = merged.get("devices", [0])
        if not isinstance(devices, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            devices = []
        args = [a if isinstance(a, str) else str(a) for a in _as_argv(merged.get("args", []))]
        share, share_at = _share(args)
        group = merged.get("group")
        name = merged.get("name")
        return cls(("models", index), name if isinstance(name, str) else f"models[{index}]", devices,
                   merged.get("pin") is True, group if isinstance(group, str) else None, share, share_at, entry, defaults)

    def blame(self, loc: Path_) -> Path_:
        return _blame(self.entry, self.defaults, self.path[1], loc)

    @property
    def share_words(self) -> str:
        if self.share_at is None:
            return f"sets no {GPU_SHARE_FLAG} in args, so vLLM takes its default {_num(VLLM_DEFAULT_GPU_SHARE)}"
        return f"takes {_num(self.share)} ({GPU_SHARE_FLAG})"


def _share(args: list[str]) -> tuple[Optional[float], Optional[int]]:
    """The model's GPU share from its args and the index of the item holding it (None: the default)."""
    text = _flag_value(args, GPU_SHARE_FLAG)
    if text is None:
        return VLLM_DEFAULT_GPU_SHARE, None
    at = None
    for i, arg in enumerate(args):  # the item _flag_value took its value from: the last one, as in argparse
        if _flag_name(arg) == GPU_SHARE_FLAG and ("=" in arg or i + 1 < len(args)):
            at = i if "=" in arg else i + 1
    try:
        share = float(text)
    except ValueError:
        return None, at
    return (share, at) if 0 < share <= 1 else (None, at)


def _over(total: float) -> bool:
    return total > 1.0 + 1e-9  # 0.1 + 0.2 + 0.7 is 1.0000000000000002 in floats, and fits


def _num(value: float) -> str:
    return f"{round(value, 6):g}"


def _shares(placed: list[_Placed]) -> str:
    return ", ".join(f"{p.name}: {_num(p.share)}" for p in placed)


@dataclass(frozen=True)
class Locations:
    """Where the parts of a loaded roster were written; `Roster.locate` asks it."""

    marks: Mapping[Path_, tuple[int, int]]
    defaults: Mapping[str, Any]
    entries: list[Any]

    def __call__(self, path: Path_) -> tuple[str, int, int]:
        """(field, line, col) of `path` in the resolved roster: a model's key may have been written
        in `defaults`; one nobody wrote (a schema default) is placed at its model."""
        if len(path) > 2 and path[0] == "models" and isinstance(path[1], int) and path[1] < len(self.entries):
            path = _blame(self.entries[path[1]], self.defaults, path[1], path[2:])
        return format_field(path), *_mark(self.marks, path)


def _blame(entry: Any, defaults: Mapping[str, Any], index: int, loc: Path_) -> Path_:
    """Where a value of model `index` (at `loc` in the merged model) was written."""
    here: Path_ = ("models", index, *loc)
    if not isinstance(entry, dict):
        return here
    if loc[:1] == ("args",) and len(loc) > 1 and isinstance(loc[1], int) and "args" in defaults and "args" in entry:
        # args append: the first items of the merged list are the defaults'.
        n = len(_as_argv(defaults["args"]))
        return ("defaults", *loc) if loc[1] < n else ("models", index, "args", loc[1] - n, *loc[2:])
    if _has_path(entry, loc) or not _has_path(defaults, loc):
        return here
    return ("defaults", *loc)


def _mark(marks: Mapping[Path_, tuple[int, int]], path: Path_) -> tuple[int, int]:
    """The line and column of `path`, or of the nearest enclosing value that has one."""
    while path not in marks and path:
        path = path[:-1]
    return marks.get(path, (1, 1))


def merge_defaults(defaults: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The model's own value wins; env and gate merge key by key; args append."""
    merged = dict(defaults)
    for key, value in entry.items():
        base = merged.get(key)
        if key in ("env", "gate") and isinstance(base, dict) and isinstance(value, dict):
            merged[key] = {**base, **value}
        elif key == "args" and base is not None:
            merged[key] = _as_argv(base) + _as_argv(value)
        else:
            merged[key] = value
    return merged


def _line_col(text: str, position: int) -> tuple[int, int]:
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def _as_argv(value: Any) -> list[Any]:
    if isinstance(value, str):
        return shlex.split(value)
    return list(value) if isinstance(value, list) else [value]


def _has_path(data: Any, loc: Path_) -> bool:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return False
    return True


def _unknown_key(key: Any, known: Iterable[str]) -> str:
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key '{key}'{hint}"


def _section_class(cls: type[BaseModel], loc: Path_) -> type[BaseModel]:
    """The pydantic model that owns the last element of `loc` (for 'did you mean')."""
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            cls = annotation
    return cls


def _message(err: dict[str, Any], cls: type[BaseModel], loc: Path_) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key(loc[-1], _section_class(cls, loc).model_fields)
    if kind == "missing":
        return "is required"
    if kind == "literal_error":
        return f"must be {err['ctx']['expected']} (found {err['input']!r})"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    msg = re.sub(r"^(Input|Value|String|List|Dictionary) should", "must", err["msg"])
    if isinstance(err.get("input"), (str, int, float, bool)):
        msg += f" (found {err['input']!r})"
    return msg
