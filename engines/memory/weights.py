"""How much host RAM an engine's weights take when it sleeps at Level 1 (the router's choice of level).

At Level 1 vLLM copies the weights to host RAM; their size is that of the checkpoint files
vLLM loads. `weights_gb(spec)` answers, in order:

1. `weights_gb` from the roster, when set;
2. the weight files of `model` when it is a local directory, or of its snapshot in the
   Hugging Face cache when it is a hub id (where `vllm serve` would find it: `--download-dir`,
   else HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub, the engine's own `env`
   winning over the router's environment; the snapshot `--revision` or `refs/main` names,
   else the newest);
3. plus the draft's (`speculative.model`) when that is a local directory.

The files are chosen as vLLM's default loader chooses them: top level only; the first of
`*.safetensors`, `*.bin`, `*.pt` that matches (a repo shipping both safetensors and .bin
loads only the safetensors); safetensors narrowed to `model.safetensors.index.json`'s files
when it exists (Mistral repos carry both shards and a consolidated file); training-only
files (`optimizer.pt`, ...) left out. Sizes are apparent sizes (st_size, links followed), in
GB of 1e9 bytes.

Unknown (a `command` or `url` engine, nothing found): None, with the reason to log. A hub
model is in the cache only once an engine has downloaded it, so ask again after a boot.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping, Optional

from config.argv import flag_value
from config.schema import ModelSpec

GB = 1e9
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")  # in vLLM's order of preference
NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class _Unknown(Exception):
    """Why a checkpoint's size cannot be told (the message is the reason)."""


def weights_gb(spec: ModelSpec) -> tuple[Optional[float], str]:
    """The engine's weights in GB and where that number comes from, or None and why it is unknown: its
    paths as the log and status may show them (a path the roster gave as ${ENV} masked, as in its argv)."""
    size, reason = _weights_gb(spec)
    return size, spec.masked([reason])[0]


def _weights_gb(spec: ModelSpec) -> tuple[Optional[float], str]:
    if spec.weights_gb is not None:
        return spec.weights_gb, f"weights_gb: {spec.weights_gb:g} in the roster"
    if spec.model is None:
        how = "runs a `command`" if spec.command is not None else f"is attached by url ({spec.shown_url})"
        return None, f"model '{spec.name}' {how}, so the router cannot see its checkpoint; set weights_gb"
    env = {**os.environ, **spec.env}
    try:
        folder, where = _checkpoint_dir(spec.model, spec, env)
        size, what = _weight_size(folder)
    except _Unknown as exc:
        return None, str(exc)
    reason = f"{what} in {where}"
    draft = spec.speculative.get("model") if spec.speculative else None
    if isinstance(draft, str) and draft:
        if Path(draft).is_dir():
            try:
                draft_size, draft_what = _weight_size(Path(draft))
            except _Unknown as exc:
                return None, f"{reason}; draft: {exc}"
            size += draft_size
            reason += f"; draft: {draft_what} in {draft}"
        else:
            reason += f"; draft '{draft}' not counted (not a local directory)"
    return size, reason


def folder_weights_gb(folder: Path) -> Optional[float]:
    """GB of the weight files vLLM would load from the local checkpoint `folder`; None when it has none."""
    try:
        return _weight_size(folder)[0]
    except _Unknown:
        return None


def _checkpoint_dir(model: str, spec: ModelSpec, env: Mapping[str, str]) -> tuple[Path, str]:
    """The directory holding the files of `model` (the spec's), and how to name it in a reason."""
    if Path(model).is_dir():
        return Path(model), model
    if not _HUB_ID.fullmatch(model):
        raise _Unknown(f"model '{model}' is not a local directory (nor a Hugging Face id); set weights_gb")
    cache = _hub_cache(spec, env)
    repo = cache / f"models--{model.replace('/', '--')}"
    revision = flag_value(spec.args, "--revision")
    snapshot = _snapshot(repo, revision)
    if snapshot is None:
        at = f"revision '{revision}' " if revision else ""
        raise _Unknown(f"model '{model}' is neither a local directory nor {at}in the Hugging Face cache at {cache}; set weights_gb")
    return snapshot, f"the Hugging Face cache ({snapshot})"


def _hub_cache(spec: ModelSpec, env: Mapping[str, str]) -> Path:
    """Where `vllm serve` with this engine's args and environment looks for hub downloads
    (huggingface_hub's own order of variables)."""
    download_dir = flag_value(spec.args, "--download-dir")
    if download_dir:
        return _expand(download_dir, env)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second is the older spelling, still honoured
        if env.get(name):
            return _expand(env[name], env)
    if env.get("HF_HOME"):
        return _expand(env["HF_HOME"], env) / "hub"
    if env.get("XDG_CACHE_HOME"):
        return _expand(env["XDG_CACHE_HOME"], env) / "huggingface" / "hub"
    return _expand("~/.cache/huggingface/hub", env)


def _expand(path: str, env: Mapping[str, str]) -> Path:
    # `~` is the engine's home: its env may set HOME.
    if path == "~" or path.startswith("~/"):
        home = env.get("HOME") or os.path.expanduser("~")
        path = home + path[1:]
    return Path(path)


def _snapshot(repo: Path, revision: Optional[str]) -> Optional[Path]:
    """The snapshot `revision` names (a branch or tag under refs/, or a commit), else the one
    refs/main points to, else the newest; None when the cache holds none."""
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    name = revision or "main"
    try:
        commit = (repo / "refs" / name).read_text().strip()
    except (OSError, ValueError):
        commit = name  # a commit hash given as --revision
    if commit and (snapshots / commit).is_dir():
        return snapshots / commit
    if revision:
        return None  # the engine would load that revision, not another one
    found = [p for p in snapshots.iterdir() if p.is_dir()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _weight_size(folder: Path) -> tuple[float, str]:
    """GB of the weight files vLLM would load from `folder`, and a few words saying which."""
    files, pattern = _weight_files(folder)
    if not files:
        raise _Unknown(f"no weight files ({', '.join(WEIGHT_PATTERNS)}) in {folder}; set weights_gb")
    total = 0
    for path in files:
        try:
            total += path.stat().st_size  # follows the cache's links to blobs
        except OSError:
            raise _Unknown(f"{path} cannot be read (a broken link: an interrupted download?); set weights_gb") from None
    plural = "" if len(files) == 1 else "s"
    return total / GB, f"{total / GB:.2f} GB in {len(files)} {pattern} file{plural}"


def _weight_files(folder: Path) -> tuple[list[Path], str]:
    """The files vLLM's default loader (load format auto) reads from `folder`, and their pattern."""
    consolidated = sorted(folder.glob("consolidated*.safetensors"))
    if consolidated:  # vLLM picks the Mistral format when these exist
        return _in_index(consolidated, folder / "consolidated.safetensors.index.json"), "consolidated*.safetensors"
    for pattern in WEIGHT_PATTERNS:
        files = sorted(folder.glob(pattern))
        if not files:
            continue
        if pattern == "*.safetensors":
            return _in_index(files, folder / "model.safetensors.index.json"), pattern
        return [f for f in files if f.name not in NOT_FOR_INFERENCE], pattern
    return [], ""


def _in_index(files: list[Path], index: Path) -> list[Path]:
    """Only the files the safetensors index maps weights to, when there is a readable index."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        named = {str(name) for name in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return files
    return [f for f in files if f.name in named] if named else files
