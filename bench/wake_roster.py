"""The wake-latency trace bench's roster (bench/wake_trace.py): ten models on two GPUs of 141 GB and
what each step costs on an H200 host, and the trace they serve.

The trace is ServeGen-derived (bench/traces/README.md): bursty per-application arrivals, ten models.
The roster (`MODELS`) puts them on two GPUs of 141 GB, their `--gpu-memory-utilization` shares
summing to about 2.9 GPUs, from a 70B (fp8) down to an embedder. Every step the router drives
costs what it costs on an H200 host, per GPU (an engine on two GPUs moves half its weights on
each, in parallel), times `--time-scale`:

  Level-1 sleep   weights out to pinned host RAM at 25 GB/s     (sim step sleep_level1; the copy is
                  counted against --ram-budget-gb at its modelled size: engines/sim/host_memory.py,
                  1e6 real bytes per GB)
  Level-1 wake    weights back at 50 GB/s                       (wake)
  Level-2 sleep   0.3 s: the weights are only dropped           (sleep_level2)
  Level-2 wake    the reload reads the page cache at 6 GB/s when the checkpoint is resident there,
                  else the disk at --disk-gb-per-s (the sims' disk model, engines/sim/page_cache.py:
                  one page cache for the host, LRU within --page-cache-gb; a stage makes a checkpoint
                  resident; reads from the disk at once share it); the draft's reload 6 GB/s
  cold boot       20 s (process, CUDA graphs) + the weights from disk at --disk-gb-per-s
  decode          each model's tokens/s (`MODELS`), with a draft accepting 2.6 tokens a step
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import harness as h  # bench/harness.py: the repository's root

GPU_GB = 141.0
TRACE = h.REPO / "bench" / "traces" / "servegen-d1-7.jsonl"

# An H200 host, in real seconds (issue 32).
L1_OUT_GB_S, L1_BACK_GB_S, PAGE_CACHE_GB_S = 25.0, 50.0, 6.0
LEVEL2_SLEEP_S, BOOT_FIXED_S = 0.3, 20.0
DRAFT_SHARE = 0.02  # a draft (EAGLE head or small model) as a share of its target's weights
ACCEPTANCE = 2.6
# The roster's time constants (real seconds), scaled like the trace.
MIN_ACTIVE_S, MAX_WAIT_S = 5.0, 300.0


@dataclass(frozen=True)
class Model:
    name: str
    devices: tuple[int, ...]
    share: float  # --gpu-memory-utilization, on each of its devices
    weights_gb: float  # the whole checkpoint (spread over its devices)
    tok_s: float  # decode tokens/s of one request
    kind: str = "chat"

    @property
    def per_gpu_gb(self) -> float:
        return self.weights_gb / len(self.devices)

    def steps(self) -> dict[str, float]:
        """Real seconds of each sim step."""
        w = self.per_gpu_gb
        return {"sleep_level1": w / L1_OUT_GB_S, "sleep_level2": LEVEL2_SLEEP_S, "wake": w / L1_BACK_GB_S,
                "wake_weights": 0.05, "reload_draft": w * DRAFT_SHARE / PAGE_CACHE_GB_S, "wake_kv_cache": 0.1}

    def reload_s(self, gb_s: float) -> float:
        """reload_weights of the whole checkpoint (the sims' disk model: engines/sim/page_cache.py)."""
        return self.weights_gb / gb_s

    def boot_s(self, disk_gb_s: float) -> float:
        """A boot: its fixed part (`--sim-boot-s`), then the sims' disk model reads the checkpoint, here cold."""
        return BOOT_FIXED_S + self.weights_gb / disk_gb_s


# Shares sum to 2.8 GPUs over two, laid out as an operator would by the trace's popularity: GPU 0
# holds the hot set awake together (the 70B, the two most asked-for small models llama-8b and
# qwen-7b, the embedder, and phi-3-mini in the 0.08 left), GPU 1 the long tail, 1.8 GPUs' worth
# taking turns. Of all 512 one-GPU layouts (the 70B on GPU 0) this one leaves the fewest requests
# blocked whatever the policy (bench/contention.py: 71, against 151 with mistral-7b and qwen-7b
# swapped, as until 35c777c). The 70B and the Mixtral in fp8, the rest bf16.
MODELS = {m.name: m for m in (
    Model("llama-70b", (0,), 0.60, 70, 35),
    Model("qwen-32b", (1,), 0.55, 64, 60),
    Model("mixtral-8x7b", (1,), 0.40, 47, 70),
    Model("gemma-27b", (1,), 0.45, 54, 65),
    Model("llama-13b", (1,), 0.25, 26, 90),
    Model("mistral-7b", (1,), 0.15, 14.5, 120),
    Model("llama-8b", (0,), 0.15, 16, 115),
    Model("qwen-7b", (0,), 0.15, 15, 120),
    Model("phi-3-mini", (0,), 0.08, 7.6, 160),
    Model("bge-large", (0,), 0.02, 0.7, 1000, kind="embeddings"),
)}


@dataclass(frozen=True)
class Req:
    i: int
    t: float
    model: str
    kind: str
    tokens: int
    batch: bool = False  # sent as `X-Hotswap-Class: batch` (the batch client, not the trace's)


def batch_flood(trace: list[Req], model: str, count: int, at_s: float, tokens: int) -> list[Req]:
    """A batch job (a nightly evaluation, say) added to `trace`: `count` requests for `model` all sent
    at `at_s` real seconds into it, numbered after the trace's own."""
    return [Req(len(trace) + k, trace[0].t + at_s, model, MODELS[model].kind, tokens, batch=True) for k in range(count)]


def load_trace(path: Path, minutes: Optional[float]) -> tuple[dict, list[Req]]:
    with path.open() as f:
        header = json.loads(f.readline())["header"]
        rows = [json.loads(line) for line in f if line.strip()]
    unknown = sorted({r["model"] for r in rows} - set(MODELS))
    if unknown:
        raise SystemExit(f"{path}: models not in this bench's roster: {', '.join(unknown)}")
    cut = math.inf if minutes is None else minutes * 60
    reqs = [Req(i, r["t"], r["model"], r["kind"], max(1, r["output_tokens"])) for i, r in enumerate(x for x in rows if x["t"] < cut)]
    return header, reqs


def policy_keys(scale: float) -> str:
    """The scheduler's own time constants as roster keys, scaled, where the tree running has them (a tree
    from before they were keys gets them set on its instance instead: `older_tree`)."""
    from config.schema import Swap

    fields = Swap.model_fields
    return "".join(f", {key}: {fields[key].default * scale:g}" for key in ("demand_tau_s", "reuse_horizon_s", "interactive_hold_s")
                   if key in fields)


def batch_max_wait_s() -> Optional[float]:
    """queue.batch_max_wait_s's default, real seconds, where the tree running has the key."""
    from config.schema import Queue

    field = Queue.model_fields.get("batch_max_wait_s")
    return None if field is None else field.default


def queue_keys(scale: float) -> str:
    """queue: its waits, scaled (the batch one where the tree running has it)."""
    batch = "" if batch_max_wait_s() is None else f", batch_max_wait_s: {batch_max_wait_s() * scale:g}"
    return f"queue: {{max_wait_s: {MAX_WAIT_S * scale:g}, max_waiting: 4096{batch}}}"


def older_tree(scheduler: Any, scale: float) -> None:
    """A tree from before the policy's time constants were roster keys: scale them on the instance."""
    old = importlib.import_module("router.scheduling")  # that tree's names, which this one no longer exports
    scheduler.demand = old.Demand(old.DEMAND_TAU_S * scale)
    scheduler.reuse_horizon_s *= scale


def host_keys(args: argparse.Namespace) -> str:
    """host: the RAM budget, and the page cache staging may fill where the tree running has the key."""
    from config.sections import Host

    staged = f", page_cache_budget_gb: {args.page_cache_budget_gb:g}" if "page_cache_budget_gb" in Host.model_fields else ""
    return f"host: {{ram_budget_gb: {args.ram_budget_gb:g}{staged}}}"


def roster(port: int, args: argparse.Namespace, tmp: Path, arm: str = "hotswap") -> str:
    scale = args.time_scale
    env = {"HOTSWAP_SIM_GPU_LEDGER": str(tmp / f"ledger-{arm}.json"), "HOTSWAP_SIM_GPU_MEMORY_GB": f"0={GPU_GB:g},1={GPU_GB:g}",
           "HOTSWAP_SIM_PAGE_CACHE": str(tmp / f"page-cache-{arm}.json"), "HOTSWAP_SIM_PAGE_CACHE_GB": f"{args.page_cache_gb:g}",
           "PYTHONPATH": str(h.REPO)}  # every arm meets this tree's simulator
    lines = [
        "# written by bench/wake_trace.py",
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        f"swap: {{min_active_s: {MIN_ACTIVE_S * scale:g}, max_hold_s: {args.max_hold_s * scale:g}, "
        f"drain_timeout_s: {args.drain_timeout_s * scale:g}{policy_keys(scale)}{', wake_ahead: false' if arm == 'no-ahead' else ''}}}",
        queue_keys(scale),
        f"gpus: [{{index: 0, memory_gb: {GPU_GB:g}}}, {{index: 1, memory_gb: {GPU_GB:g}}}]",
        host_keys(args),
        "defaults:",
        f"  launcher: [{json.dumps(sys.executable)}, -m, engines.sim, serve]",
        f"  env: {json.dumps(env)}",
        "models:",
    ]
    for m in MODELS.values():
        flags = ["--gpu-memory-utilization", f"{m.share:g}", "--sim-boot-s", f"{BOOT_FIXED_S * scale:.4f}",
                 "--sim-token-rate", f"{m.tok_s / scale:g}", "--sim-acceptance", f"{ACCEPTANCE:g}",
                 "--max-model-len", "131072", "--sim-weights-gb", f"{m.weights_gb:g}", "--sim-host-bytes-per-gb", "1e6",
                 "--sim-disk-gb-per-s", f"{args.disk_gb_per_s / scale:g}", "--sim-page-cache-gb-per-s", f"{PAGE_CACHE_GB_S / scale:g}"]
        for step, s in m.steps().items():
            flags += ["--sim-step-delay", f"{step}={s * scale:.4f}"]
        lines += [f"  - name: {m.name}", f"    model: bench/{m.name}", f"    weights_gb: {m.weights_gb:g}",
                  f"    devices: {list(m.devices)}", f"    args: {json.dumps(flags)}"]
        if m.kind == "chat":
            lines.append(f"    speculative: {{method: draft_model, model: bench/{m.name}-draft, num_speculative_tokens: 3}}")
        else:  # the canary is a generation; an embedder's check would be a pooling request
            lines.append("    gate: {enabled: false}")
        if m.name == "llama-8b":
            lines.append("    default: true")
    return "\n".join(lines) + "\n"
