"""`python -m engines.sim serve MODEL [vllm serve flags] [--sim-* knobs]`

Started exactly like `vllm serve`, so a router launches it with the argv it would give
vLLM. vLLM flags the simulator does not model are accepted and ignored; `--sim-*`
flags shape the simulated engine (timing, faults, metric lag).
"""
# This docstring is the --help text (build_parser); engines/sim/__main__.py serves what this parses.

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from engines.memory.weights import folder_weights_gb

from .control import DELAY_VARIANTS, FAULT_KINDS, STEPS, Fault
from .host_memory import HostModel
from .memory import DEFAULT_RESIDUAL_GB, DEFAULT_SHARE, EngineMemory, Ledger, parse_devices
from .page_cache import DEFAULT_PAGE_CACHE_GB_S, DiskModel


def _json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def _step_pair(kind_check: bool):
    def parse(text: str) -> tuple[str, str]:
        step, sep, value = text.partition("=")
        steps = STEPS if kind_check else STEPS + DELAY_VARIANTS
        if not sep or step not in steps:
            raise argparse.ArgumentTypeError(f"expected STEP=VALUE with STEP in {', '.join(steps)}: {text!r}")
        if kind_check:
            try:
                Fault(step, value)
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{e}: {text!r}") from None
        else:
            try:
                if float(value) < 0:
                    raise ValueError
            except ValueError:
                raise argparse.ArgumentTypeError(f"delay must be a non-negative number of seconds: {text!r}") from None
        return step, value

    return parse


def _prompt_acceptance(text: str) -> tuple[str, float]:
    needle, sep, value = text.rpartition("=")
    try:
        if not sep or not needle:
            raise ValueError
        return needle, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TEXT=MAL (a prompt substring and a mean acceptance length): {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown vLLM flag must never be taken for a prefix of ours.
    p = argparse.ArgumentParser(prog="python -m engines.sim serve", allow_abbrev=False, description=__doc__)
    v = p.add_argument_group("vllm serve flags the simulator models")
    v.add_argument("--model", help="model path or id (also accepted positionally)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", nargs="+", default=None)
    v.add_argument("--max-model-len", type=int, default=4096)
    v.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded at once; the rest queue (unset: no limit)")
    v.add_argument("--enable-sleep-mode", action="store_true")
    v.add_argument("--speculative-config", type=_json_object, default=None)
    v.add_argument("--worker-extension-cls", default=None)
    v.add_argument("--sleep-preserve-parameter-names", nargs="+", default=[])
    v.add_argument("--api-key", default=None)
    v.add_argument("--disable-log-stats", action="store_true")
    v.add_argument("--load-format", default="auto", help="reload_weights (and the draft's reload) fail for the formats vLLM cannot reload")
    v.add_argument("--per-request-spec-decode-metrics", choices=("none", "summary", "detailed"), default="none")
    v.add_argument("--enable-lora", action="store_true")
    v.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH")
    s = p.add_argument_group("simulator knobs")
    s.add_argument("--sim-boot-s", type=float, default=0.2,
                   help="seconds before the port is bound (with --sim-disk-gb-per-s, before the weights are read)")
    s.add_argument("--sim-fail-boot", action="store_true", help="fail the boot with a CUDA OOM and exit 1")
    s.add_argument("--sim-separate-env", action="store_true",
                   help="model vLLM in an environment of its own, where hotswap is not installed: the "
                   "--worker-extension-cls module is looked up on PYTHONPATH alone, and a boot that cannot find it "
                   "fails as vLLM's worker does (ModuleNotFoundError); where it was found is in /sim/state")
    s.add_argument("--sim-token-rate", type=float, default=2000.0, help="decode tokens/s (halved with a discarded draft)")
    s.add_argument("--sim-prefill-rate", type=float, default=20000.0, metavar="TOKENS_S",
                   help="prompt tokens/s before a request's first token (a 7-8B model on one A100 prefills about this); "
                   "what a resumed answer pays again for its prompt and the text so far")
    s.add_argument("--sim-acceptance", type=float, default=2.6, help="mean acceptance length of a healthy draft")
    s.add_argument(
        "--sim-prompt-acceptance", type=_prompt_acceptance, action="append", default=[], metavar="TEXT=MAL",
        help="a request whose prompt contains TEXT decodes at mean acceptance length MAL (repeatable; first match wins)",
    )  # fmt: skip
    s.add_argument("--sim-step-delay", type=_step_pair(False), action="append", default=[], metavar="STEP=SECONDS",
                   help="every call of STEP takes SECONDS longer (repeatable; the STEPs of --sim-fault, and "
                   f"{', '.join(DELAY_VARIANTS)}: a sleep at that level, instead of sleep's delay)")
    s.add_argument(
        "--sim-fault", type=_step_pair(True), action="append", default=[], metavar="STEP=KIND",
        help=f"fail every call of STEP (repeatable; at runtime: POST /sim/faults). STEP: {', '.join(STEPS)}. "
        f"KIND: {', '.join(FAULT_KINDS)} (see engines/sim/control.py)",
    )  # fmt: skip
    s.add_argument("--sim-crash-mid-stream", type=int, default=None, metavar="N",
                   help="the process dies after the Nth chunk of a stream (N >= 1), as a crashed vLLM does")
    s.add_argument("--sim-metrics-lag-s", type=float, default=0.0,
                   help="a finished request's counters reach /metrics this many seconds later (vLLM's stats loop)")
    s.add_argument("--sim-lora-lost-on-level2", action="store_true",
                   help="after a Level-2 sleep, adapters answer like the base model (silently wrong)")
    s.add_argument("--sim-reset-prefix-false", type=int, default=0, metavar="N",
                   help="after each wake, the first N POST /reset_prefix_cache answer success: false (blocks still held)")
    s.add_argument("--sim-host-bytes-per-gb", type=float, default=None, metavar="N",
                   help="model vLLM's Level-1 backup in pinned host RAM: a Level-1 sleep really allocates and touches "
                   "N bytes per GB of weights, each tensor rounded up to a power of two, kept after the wake until "
                   "hotswap_empty_host_cache (engines/sim/host_memory.py); 1e9 is real size. Unset: not modelled")
    s.add_argument("--sim-weights-gb", type=float, default=None, metavar="GB",
                   help="the weights' size for --sim-host-bytes-per-gb and --sim-disk-gb-per-s, and what a KV release keeps mapped in the memory "
                   "oracle; unset: the weight files in MODEL, a local directory")
    s.add_argument("--sim-disk-gb-per-s", type=float, default=None, metavar="GB_S",
                   help="model the disk and the page cache a Level-2 reload and the boot's load read: a cold read of the weights "
                   "(--sim-weights-gb) at GB_S, a resident one at --sim-page-cache-gb-per-s; hotswap_stage_weights "
                   "makes them resident (engines/sim/page_cache.py; the host's page cache: HOTSWAP_SIM_PAGE_CACHE, "
                   "HOTSWAP_SIM_PAGE_CACHE_GB). Unset: reload_weights takes only its --sim-step-delay")
    s.add_argument("--sim-page-cache-gb-per-s", type=float, default=DEFAULT_PAGE_CACHE_GB_S, metavar="GB_S",
                   help="a reload's speed from resident pages, with --sim-disk-gb-per-s (default %(default)s: an H200 host)")
    s.add_argument("--sim-sleep-residual-gb", type=float, default=DEFAULT_RESIDUAL_GB,
                   help="GB a sleeping engine still holds per device; with --gpu-memory-utilization, modelled "
                   "only when HOTSWAP_SIM_GPU_LEDGER names a ledger (engines/sim/memory.py)")
    n = p.add_argument_group("numbers a GPU host gets wrong (per-token logprobs; tokens unchanged: engines/sim/numerics.py)")
    n.add_argument("--sim-logprob-jitter", type=_non_negative, default=0.0, metavar="NATS",
                   help="healthy batch-shape noise: while other requests run alongside, each logprob moves by up to NATS")
    n.add_argument("--sim-wake-logprob-shift", type=float, default=0.0, metavar="NATS",
                   help="after every wake from sleep, every logprob is off by NATS (FP8 KV scales reset: vLLM #45617)")
    n.add_argument("--sim-wake-logprob-noise", type=_non_negative, default=0.0, metavar="NATS",
                   help="after every wake, each logprob is off by a random amount up to NATS (undefined KV pages: vLLM #44972)")
    return p


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_share_parser() -> argparse.ArgumentParser:
    """`--gpu-memory-utilization`, taken from the flags the main parser leaves: without the
    memory oracle the simulator does not model it, and says so with the other ignored flags."""
    p = argparse.ArgumentParser(prog="python -m engines.sim serve", allow_abbrev=False, add_help=False)
    p.add_argument("--gpu-memory-utilization", default=str(DEFAULT_SHARE))
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    if argv and argv[0] == "serve":
        argv = argv[1:]
    # vLLM's positional MODEL comes first; taking it up front keeps the value of an
    # unknown flag (`--dtype float32`) from being mistaken for the model.
    positional = None
    if argv and not argv[0].startswith("-"):
        positional, argv = argv[0], argv[1:]
    args, unknown = parser.parse_known_args(argv)
    share, rest = build_share_parser().parse_known_args(unknown)
    args.model = positional or args.model
    if not args.model:
        parser.error("the model is required: serve MODEL or --model MODEL")
    spec = args.speculative_config
    if spec is not None:
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            parser.error("--speculative-config needs an integer num_speculative_tokens >= 1")
        for flag, mal in [("--sim-acceptance", args.sim_acceptance), *(("--sim-prompt-acceptance", m) for _, m in args.sim_prompt_acceptance)]:
            if not 1.0 <= mal <= 1.0 + k:
                parser.error(f"{flag} must be between 1 and 1+num_speculative_tokens ({1 + k})")
    elif args.per_request_spec_decode_metrics != "none":
        # vLLM 0.32 refuses it the same way (vllm/config/vllm.py:1660).
        parser.error("--per-request-spec-decode-metrics requires speculative decoding to be enabled (via --speculative-config).")
    if args.sim_token_rate <= 0:
        parser.error("--sim-token-rate must be positive")
    if args.sim_prefill_rate <= 0:
        parser.error("--sim-prefill-rate must be positive")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be at least 1")
    if args.sim_crash_mid_stream is not None and args.sim_crash_mid_stream < 1:
        parser.error("--sim-crash-mid-stream must be >= 1")
    if args.sim_sleep_residual_gb < 0:
        parser.error("--sim-sleep-residual-gb must be >= 0")
    try:
        args.gpu_memory = gpu_memory(args, share.gpu_memory_utilization)
    except ValueError as e:
        parser.error(str(e))
    if args.gpu_memory is not None:
        unknown = rest  # modelled, so no longer ignored
    args.host_model = host_model(args, parser)
    args.disk_model = disk_model(args, parser)
    # `--sleep-preserve-parameter-names a,b` and `... a b` both select several globs.
    args.sleep_preserve_parameter_names = [
        pat for item in args.sleep_preserve_parameter_names for pat in item.split(",") if pat
    ]
    return args, unknown


def host_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> HostModel | None:
    """The Level-1 host-memory model (host_memory.py), when --sim-host-bytes-per-gb asks for it."""
    if args.sim_host_bytes_per_gb is None:
        return None
    if not args.sim_host_bytes_per_gb > 0:
        parser.error("--sim-host-bytes-per-gb must be a positive number of bytes per GB of weights")
    weights = _weights_gb(args)
    if weights is None or weights < 0:
        parser.error("--sim-host-bytes-per-gb needs the weights' size: --sim-weights-gb GB (>= 0), or MODEL a local "
                     "directory with weight files")
    return HostModel(weights, args.sim_host_bytes_per_gb)


def _weights_gb(args: argparse.Namespace) -> float | None:
    """--sim-weights-gb, else the weight files of MODEL when it is a local directory."""
    if args.sim_weights_gb is not None:
        return args.sim_weights_gb
    return folder_weights_gb(Path(args.model)) if os.path.isdir(args.model) else None


def disk_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DiskModel | None:
    """The disk and page cache of a Level-2 reload (page_cache.py), when --sim-disk-gb-per-s asks for it."""
    if args.sim_disk_gb_per_s is None:
        return None
    try:
        return DiskModel.from_flags(args.model, _weights_gb(args), args.sim_disk_gb_per_s, args.sim_page_cache_gb_per_s)
    except ValueError as e:
        parser.error(str(e))


def gpu_memory(args: argparse.Namespace, share_text: str) -> EngineMemory | None:
    """This engine's claim on the memory oracle; None (nothing read) when HOTSWAP_SIM_GPU_LEDGER is unset."""
    ledger = Ledger.from_env()
    if ledger is None:
        return None
    try:
        share = float(share_text)
    except ValueError:
        share = float("nan")
    if not 0 < share <= 1:  # vLLM's own bounds
        raise ValueError(f"--gpu-memory-utilization must be a number in (0, 1], got {share_text!r}")
    devices = parse_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return EngineMemory(ledger, devices, share, args.sim_sleep_residual_gb, args.model, weights_gb=_weights_gb(args))
