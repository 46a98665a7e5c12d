"""Load roster.yaml into a `Roster`, or report every problem as `file:line:col: field: message`.

The YAML is composed once into a node tree: the tree gives each key and value its line and
column, and the same nodes are constructed into plain data. pydantic validates the data;
its error locations (`('models', 1, 'sleep_level')`) are mapped back to node marks.

In argv lists (`args`, `launcher`, `command`) a number, boolean or date is taken as the text
written in the file: `[--gpu-memory-utilization, 0.85]` needs no quotes, and `0.10` stays
`0.10` (YAML would make it the float 0.1).
"""

from __future__ import annotations

import ipaddress
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import yaml
from pydantic import BaseModel, ValidationError

from config.hints import NOTHING, unknown_key
from config.merge import Path_, blame, format_field, merge_defaults
from config.placement_check import check_placement
from config.virtual import VirtualModel, check_virtual_models
from config.schema import IDENTITY_KEYS, Activity, Auth, Gpu, Host, Listen, ModelDefaults, ModelSpec, Node, Queue, Roster, Swap
SECTIONS: dict[str, type[BaseModel]] = {"listen": Listen, "auth": Auth, "queue": Queue, "swap": Swap, "host": Host, "node": Node, "activity": Activity}
TOP_LEVEL_KEYS = (*SECTIONS, "gpus", "defaults", "models", "virtual_models")
SECRET_PATHS = (("auth", "admin_key"), ("auth", "api_keys"), ("auth", "keys", int, "key"), ("node", "agent_key"))
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


def _is_secret(path: Path_) -> bool:
    """`path` holds a key (`int` in SECRET_PATHS stands for any list index)."""
    return any(len(path) >= len(secret) and all(p is int and isinstance(v, int) or p == v for p, v in zip(secret, path))
               for secret in SECRET_PATHS)


class _Loader:
    def __init__(self, source: str, environ: Mapping[str, str]):
        self.source = source
        self.environ = environ
        self.issues: list[Issue] = []
        self.value_marks: dict[Path_, tuple[int, int]] = {}
        self.key_marks: dict[Path_, tuple[int, int]] = {}
        self.scalar_text: dict[Path_, str] = {}  # non-string scalars as written, e.g. '0.10'
        self.from_env: set[str] = set()  # values substituted for ${ENV} in models and defaults: masked when shown

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
        if _is_secret(path) and not _ENV_REF.search(value):
            self.report(path, "write secrets as ${ENV_VAR} and set them in the environment, never in the file")
            return value

        def substitute(match: re.Match[str]) -> str:
            name, fallback = match.group(1), match.group(2)
            if name in self.environ:
                if path[:1] in (("models",), ("defaults",)):  # what ends up in an engine's argv or env
                    self.from_env.add(self.environ[name])
                return self.environ[name]
            if fallback is not None:
                return fallback  # written in the file: no secret
            self.report(path, f"environment variable {name} is not set (referenced as ${{{name}}})")
            return ""

        return _ENV_REF.sub(substitute, value)

    def validate(self, data: dict[str, Any]) -> Optional[Roster]:
        for key in data:
            if key not in TOP_LEVEL_KEYS:
                self.report((key,), unknown_key(key, TOP_LEVEL_KEYS), at_key=True)
        sections = {name: self.validate_model(cls, data.get(name) or {}, (name,)) for name, cls in SECTIONS.items()}
        gpus = self.validate_gpus(data.get("gpus"))
        defaults = self.check_defaults(data.get("defaults") or {})
        raw_models = data.get("models")
        if not isinstance(raw_models, list) or not raw_models:
            self.report(("models",), "needs at least one model (a list of mappings with `name:`)", at_key="models" in data)
            return None
        models = [self.validate_entry(entry, defaults, i) for i, entry in enumerate(raw_models)]
        owners = self.check_across(raw_models, defaults, sections["listen"])
        virtual = self.validate_virtual(data.get("virtual_models"))
        members = {n: m.name for m in models if m is not None for n in m.names}
        check_virtual_models(self.report, data.get("virtual_models"), owners, members)
        self.check_agent(sections["listen"], sections["node"])
        whole_gpus = gpus is not None and len(gpus) == len(data["gpus"])  # a broken entry would make indexes look unknown
        check_placement(self.report, raw_models, defaults, sorted({g.index for g in gpus}) if whole_gpus else None)
        if self.issues:
            return None
        roster = Roster(source=self.source, models=models, virtual_models=virtual, gpus=gpus, **sections)
        for model in roster.models:
            model._from_env = frozenset(self.from_env)
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
                self.report(("defaults", key), unknown_key(key, ModelDefaults.model_fields, value), at_key=True)
            else:
                kept[key] = value
        return kept

    def validate_entry(self, entry: Any, defaults: dict[str, Any], index: int) -> Optional[ModelSpec]:
        path = ("models", index)
        if not isinstance(entry, dict):
            self.report(path, "must be a mapping with at least `name:` and one of model, command, url")
            return None

        return self.validate_model(ModelSpec, merge_defaults(defaults, entry), path, lambda loc: blame(entry, defaults, index, loc))

    def check_across(self, entries: list[Any], defaults: dict[str, Any], listen: Optional[Listen]) -> dict[str, Path_]:
        """Names, ports and group defaults must be unique across models; returns where each name and alias was written.

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
        return owners

    def validate_virtual(self, value: Any) -> list[VirtualModel]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.report(("virtual_models",), "must be a list of {name: N, models: [...], pick: awake | first | balance}")
            return []
        return [v for i, entry in enumerate(value) if (v := self.validate_model(VirtualModel, entry, ("virtual_models", i)))]

    def check_agent(self, listen: Optional[Listen], node: Optional[Node]) -> None:
        if listen is not None and node is not None and (problem := exposed_agent(listen.host, node)):
            self.report(("node", "agent_port"), problem)


def exposed_agent(host: str, node: Node) -> Optional[str]:
    """Why an agent on `host` (listen.host, or `hotswap serve --host`) may not run as `node` says, if it may not:
    it answers which models are served here to whoever reaches it, so beyond loopback only to the front, which
    proves itself with `node.agent_key`."""
    if node.agent_port is None or node.agent_key is not None or is_loopback(host):
        return None
    return (f"an agent on {host} would tell anyone who reaches it which models this node serves: set node.agent_key: "
            "${ENV_VAR} (HAProxy sends it on its agent-send line, docs/multi-node.md), or listen on loopback")


def is_loopback(host: str) -> bool:
    """`host` (an address or a name) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
            path = blame(self.entries[path[1]], self.defaults, path[1], path[2:])
        return format_field(path), *_mark(self.marks, path)


def _mark(marks: Mapping[Path_, tuple[int, int]], path: Path_) -> tuple[int, int]:
    """The line and column of `path`, or of the nearest enclosing value that has one."""
    while path not in marks and path:
        path = path[:-1]
    return marks.get(path, (1, 1))


def _line_col(text: str, position: int) -> tuple[int, int]:
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def _section_class(cls: type[BaseModel], loc: Path_) -> type[BaseModel]:
    """The pydantic model that owns the last element of `loc` (for 'did you mean')."""
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field else None
        if typing.get_origin(annotation) is list:  # e.g. auth.keys: list[ApiKey]; the index comes next
            annotation = typing.get_args(annotation)[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            cls = annotation
    return cls


def _message(err: dict[str, Any], cls: type[BaseModel], loc: Path_) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _section_class(cls, loc)
        return unknown_key(loc[-1], owner.model_fields, err["input"] if owner is ModelSpec and len(loc) == 1 else NOTHING)
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
