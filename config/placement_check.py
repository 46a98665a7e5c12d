"""Placements no scheduling can satisfy, found in the roster as written (defaults merged), each
reported where the operator wrote the value to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from config.merge import Path_, as_argv, blame, format_field, merge_defaults
from config.argv import GPU_SHARE_FLAG, VLLM_DEFAULT_GPU_SHARE, flag_name, flag_value

Report = Callable[[Path_, str], None]


def check_placement(report: Report, entries: list[Any], defaults: dict[str, Any], known_gpus: Optional[list[int]]) -> None:
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
                    report(p.blame(("devices", j)), f"GPU {device} is not in gpus: (known: {known})")

    pinned = [p for p in placed if p.pin and p.share is not None]
    # Pinned models are always awake: on each device their shares must add up to at most 1.0.
    held: dict[int, float] = {}
    for p in pinned:
        for device in dict.fromkeys(p.devices):  # a device listed twice is the schema's error, counted once here
            before = held.get(device, 0.0)
            held[device] = before + p.share
            if _over(held[device]) and not _over(before):
                on_device = [q for q in pinned if device in q.devices]
                report(p.blame(("pin",)), (
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
            report(p.blame(("group",)), (
                f"'{p.name}' and '{first.name}' ({format_field(first.path)}) are both pinned in group '{p.group}'; "
                "a group keeps one model awake at a time and a pinned model is always awake: "
                "unpin one or move it to another group"))
        else:
            pinned_in[p.group] = p
    for p in placed:
        first = pinned_in.get(p.group) if p.group is not None and not p.pin else None
        if first is not None:
            report(p.blame(("group",)), (
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
            report(p.blame((p.argv_key, p.share_at)) if p.share_at is not None else p.path, (
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
    share_at: Optional[int]  # index in the merged argv of the item holding the value; None: vLLM's default
    argv_key: str  # where the engine's flags are: `command` for a command engine (its args are not used), else `args`
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
        argv_key = "command" if merged.get("command") is not None else "args"
        args = [a if isinstance(a, str) else str(a) for a in as_argv(merged.get(argv_key, []))]
        share, share_at = _share(args)
        group = merged.get("group")
        name = merged.get("name")
        return cls(("models", index), name if isinstance(name, str) else f"models[{index}]", devices,
                   merged.get("pin") is True, group if isinstance(group, str) else None, share, share_at, argv_key, entry,
                   defaults)

    def blame(self, loc: Path_) -> Path_:
        return blame(self.entry, self.defaults, self.path[1], loc)

    @property
    def share_words(self) -> str:
        if self.share_at is None:
            return f"sets no {GPU_SHARE_FLAG} in {self.argv_key}, so vLLM takes its default {_num(VLLM_DEFAULT_GPU_SHARE)}"
        return f"takes {_num(self.share)} ({GPU_SHARE_FLAG})"


def _share(args: list[str]) -> tuple[Optional[float], Optional[int]]:
    """The model's GPU share from its argv and the index of the item holding it (None: the default)."""
    text = flag_value(args, GPU_SHARE_FLAG)
    if text is None:
        return VLLM_DEFAULT_GPU_SHARE, None
    at = None
    for i, arg in enumerate(args):  # the item flag_value took its value from: the last one, as in argparse
        if flag_name(arg) == GPU_SHARE_FLAG and ("=" in arg or i + 1 < len(args)):
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
