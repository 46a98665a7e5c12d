"""`hotswap check`: what `serve` will do with a roster, told before it runs.

Errors as `file:line:col: field: message` (exit 2). Else, on stdout, the resolved roster as YAML (defaults
applied, secrets masked: the contract scripts read, DESIGN.md), ending in YAML comments that tell the operator
the placement per GPU (who can be awake together, who takes turns) and the level each model would sleep at
under the host-RAM budget, from the scheduler's own code (`router.scheduling.sizing.preview`). On stderr, every
warning `serve` would give, from the same code that gives it there (a checkpoint it cannot size: `router.scheduling.sizing.level1_weights`),
and what will not run here (an engine program not on PATH).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import yaml

from config import Issue, Roster
from config.virtual import scope_warnings
from engines.process import compose_argv
from router.scheduling import Preview, Sleep, capacity, level1_weights, preview

EXIT_OK = 0


def cmd_check(args: argparse.Namespace, roster: Roster) -> int:
    warnings = check_warnings(roster)
    weights = level1_weights(roster.models, warn=lambda spec, message: warnings.append(_at_model(roster, spec.name, message)))
    yaml.safe_dump(roster.redacted(), sys.stdout, sort_keys=False)
    # As YAML comments: stdout stays the roster a script reads (DESIGN.md), and ends with what an operator asks.
    print("\n".join(f"# {line}".rstrip() for line in render(roster, preview(roster, weights, capacity(roster))).splitlines()))
    sys.stdout.flush()  # the output, then the warnings, also when both go to one file
    warnings.sort()
    for warning in warnings:
        print(warning, file=sys.stderr)
    if warnings:
        noun = "warning" if len(warnings) == 1 else "warnings"
        print(f"{args.config}: {len(warnings)} {noun}; the roster is valid", file=sys.stderr)
    return EXIT_OK


def _at_model(roster: Roster, name: str, message: str) -> Issue:
    """A warning about model `name`'s weights, placed where `weights_gb` would be written (at the model when unset)."""
    i = next(i for i, m in enumerate(roster.models) if m.name == name)
    field, line, col = roster.locate(("models", i, "weights_gb")) or (f"models[{i}].weights_gb", 1, 1)
    return Issue(roster.source, line, col, field, message)


def check_warnings(roster: Roster) -> list[Issue]:
    """What is valid but will not work here, or not as written: a managed engine's program (launcher[0] or
    command[0]) that is not on PATH; a key's glob that matches a virtual model but not all its members
    (`config.virtual.scope_warnings`). One warning per place in the file, so a launcher set in
    `defaults` is reported once."""
    found: dict[tuple[str, int, int], Issue] = {}
    for i, model in enumerate(roster.models):
        if not model.managed:
            continue
        key = "command" if model.command is not None else "launcher"
        program = compose_argv(model, 0)[0]  # placeholders filled; python/python3 are the router's own
        if shutil.which(program) is not None:
            continue
        written = (model.command or model.launcher)[0]
        field, _, _ = roster.locate(("models", i, key)) or (f"models[{i}].{key}", 1, 1)
        _, line, col = roster.locate(("models", i, key, 0)) or ("", 1, 1)
        if os.sep in program:
            message = f"{written!r} is not an executable file"
        else:
            what = "vLLM" if program == "vllm" else "it"
            message = f"{written!r} is not on PATH (install {what} in this environment, or set {key} to its full path)"
        found.setdefault((field, line, col), Issue(roster.source, line, col, field, message))
    issues = list(found.values())
    names_of = {name: m.names for m in roster.models for name in m.names}
    for path, message in scope_warnings(roster.auth.keys, roster.virtual_models, names_of):
        field, line, col = roster.locate(path) or (".".join(map(str, path)), 1, 1)
        issues.append(Issue(roster.source, line, col, field, message))
    return sorted(issues)


def render(roster: Roster, seen: Preview) -> str:
    """The placement as `serve` will see it, per GPU, then the level each model sleeps at."""
    gpus = "gpus:" if roster.gpus else "NVML, on this machine" if seen.capacity.nvml else None
    lines = []
    for view in seen.devices:
        size = f"{view.memory_gb:g} GB, from {gpus}" if view.memory_gb and gpus else \
            "size unknown, so a sleeper's residual is not counted: set gpus:"
        shares = ", ".join(f"{name} {view.shares[name]:g}" for name in view.models)
        lines.append(f"GPU {view.index} ({size}): {shares} (--gpu-memory-utilization); at most {view.most_awake} awake at once")
        if not view.listed:
            lines.append(f"  ({len(view.models)} models: too many to list who can be awake together)")
        if view.together:
            lines.append("  awake together: " + "; ".join(" + ".join(names) for names in view.together))
        elif view.listed and len(view.models) > 1:
            lines.append("  awake together: none, one at a time")
        for a, b, why in view.turns:
            lines.append(f"  take turns: {a} / {b} ({why})")
        for name, why in view.alone_only.items():
            lines.append(f"  {name}: {why}")
    budget = roster.host.ram_budget_gb
    origin = "host.ram_budget_gb" if budget is not None else "host.ram_budget_gb unset: half of this machine's RAM"
    lines.append(f"When parked (host RAM for level-1 sleepers: {seen.capacity.ram_budget_gb:.2f} GB, {origin}):")
    width = max(len(name) for name in seen.sleep)
    for name, sleep in seen.sleep.items():
        lines.append(f"  {name:<{width}}  {_level(sleep)}: {sleep.why}")
        if sleep.crowded_why:
            lines.append(f"  {'':<{width}}  or {_level(Sleep(sleep.crowded, ''))} {sleep.crowded_why}")
    return "\n".join(lines)


def _level(sleep: Sleep) -> str:
    if sleep.level == "pin":
        return "never parked"
    if sleep.level is None:
        return "stopped, not parked"
    return f"level {sleep.level}"
