"""`vllm serve`'s argv as the roster writes it: the flags the router owns, how a flag is spelled and
read, and what vLLM does with the few flags the router must understand (the GPU share, the load
format). The schema's validators and the engines' argv composition both use these."""

from __future__ import annotations

import shlex
from typing import Any, Optional

# Flags the router composes itself, in the order it emits them; an operator setting them in
# `args` would fight it. `engines.process.compose_argv` emits router-owned flags only by
# walking this tuple (each with its value rule), so the two cannot drift apart.
ROUTER_OWNED_FLAGS = (
    "--host",
    "--port",
    "--served-model-name",
    "--enable-sleep-mode",
    "--speculative-config",
    "--worker-extension-cls",
    "--sleep-preserve-parameter-names",
    "--per-request-spec-decode-metrics",
)

DEFAULT_LAUNCHER = ("vllm", "serve")


def split_argv(value: Any) -> Any:
    # Operators write `args: "--max-model-len 4096"` as often as a list; split like a shell.
    if isinstance(value, str):
        return shlex.split(value)
    return value


def arg_text(value: Any) -> Any:
    """One argv item: a number or boolean is taken as its text (`0.85`, `4096`, `true`).

    `config.loader` already replaces such items with their spelling in the file (so `1e-3`
    stays `1e-3`); this covers rosters built in Python, where a float becomes `str(value)`
    and a boolean `true`/`false`, as YAML and JSON spell them.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value
    kind = {list: "a list", dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)
    raise ValueError(f"each item is one argument: a string, number or boolean (found {kind})")


def flag_name(arg: str) -> str:
    # vLLM's parser reads `--foo_bar` as `--foo-bar`, so compare in that spelling.
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def no_router_owned_flags(args: list[str]) -> list[str]:
    for arg in args:
        if flag_name(arg) in ROUTER_OWNED_FLAGS:
            raise ValueError(
                f"{flag_name(arg)} is set by the router; remove it from args "
                f"(router-owned flags: {', '.join(ROUTER_OWNED_FLAGS)})"
            )
    return args


GPU_SHARE_FLAG = "--gpu-memory-utilization"
LOAD_FORMAT_FLAG = "--load-format"
# The --load-format values whose loader cannot reload weights in place, read in the vLLM 0.32
# source: model_executor/model_loader/__init__.py:51-65 maps each format to its loader, and
# reload/inplace.py:75 raises NotImplementedError for a loader without `get_all_weights`, which
# `reload_weights` (a Level-2 wake's step, and the draft's reload) needs. auto, hf, safetensors, pt,
# npcache, fastsafetensors, instanttensor, mistral and runai_streamer have it.
NO_RELOAD_VLLM = "0.32"
NO_RELOAD_FORMATS = frozenset({"dummy", "ipc_cache", "modelexpress", "sharded_state", "runai_streamer_sharded", "tensorizer"})
VLLM_DEFAULT_GPU_SHARE = 0.9  # vLLM's own default for --gpu-memory-utilization
ROUTER_OWNED_ENV = ("CUDA_VISIBLE_DEVICES",)  # set from `devices`


def flag_value(args: list[str], flag: str) -> Optional[str]:
    """The value of `flag` in argv (`--flag=V` or `--flag V`), the last one winning as in argparse."""
    found = None
    for i, arg in enumerate(args):
        name = flag_name(arg)
        if name == flag:
            if "=" in arg:
                found = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                found = args[i + 1]
    return found


def gpu_share_in(args: list[str]) -> list[str]:
    text = flag_value(args, GPU_SHARE_FLAG)
    if text is not None:
        try:
            share = float(text)
        except ValueError:
            raise ValueError(f"{GPU_SHARE_FLAG} must be a number in (0, 1] (found {text!r})") from None
        if not 0 < share <= 1:
            raise ValueError(f"{GPU_SHARE_FLAG} must be in (0, 1]: the fraction of each of the model's devices it uses when awake (found {text})")
    return args
