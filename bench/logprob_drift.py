"""How far the gate's canary logprobs drift on a healthy engine, and how far a perturbed one moves them
(issue 23, item 3: the numbers behind `gate.max_logprob_drift`).

    .venv/bin/python bench/logprob_drift.py            # ~7 min: 5 engine boots, one at a time

Real `vllm serve` CPU engines (the integration tier's venv, tiny models and `cpu_launcher`, started
through tests/integration/harness.VllmServer, one at a time). The canary is the gate's: the default
prompt, 64 tokens, temperature 0, ignore_eos, `"logprobs": 0`. drift(a, b) = mean over token positions
where a's and b's tokens are identical of |logprob_a - logprob_b|; the tables give it with its max, the
positions compared and whether all tokens were identical. The reference is always the engine's first
canary after its cold boot (what the gate records as its baseline).

  a  one engine, 20 repeated canaries vs the first; once as they come (the prompt's KV blocks then hit
     the prefix cache), once with POST /reset_prefix_cache before each (what a canary after a wake
     sees: the router resets the prefix cache on wake); then 5 canaries each after a Level-1
     sleep/wake and after a staged Level-2 wake with the real reloads (sleep is bookkeeping on CPU)
  b  3 cold boots of the same engine, canary 1 of each vs boot 1's
  c  the canary alone vs sent while 1, 3, 7 other requests (other prompts, 400 tokens, streaming) decode
     on the same engine; `overlapped` = every other request had started and none had finished when the
     canary's answer came back (retried up to 5 times; on 2 shared cores the API server, busy streaming,
     sometimes hands the canary over so late that the others finish first; such a canary still counts)
  d  a and c with --dtype bfloat16
  e  a and c with speculative decoding (the target as its own draft, k=2)
  f  hotswap_perturb_target(scale) for scale in 1.01 ... 2.0 vs the baseline, tokens and (spec) acceptance

A measurement, not a test: it prints markdown tables and asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
from http.client import HTTPConnection
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import harness as bench  # noqa: E402  (bench/harness.py, the sibling module)
from config.schema import DEFAULT_GATE_PROMPT  # noqa: E402
from tests.integration.harness import EXTENSION, VllmServer, http, poll, spec_counters  # noqa: E402

MAX_TOKENS = 64  # the gate's default canary length
SCALES = (1.01, 1.05, 1.1, 1.5, 2.0)
OTHERS = (0, 1, 3, 7)
OTHER_TOKENS = 400  # with max-model-len 512: long enough to outlast the canary


def tiny_models() -> Path:
    script = REPO / "tests" / "integration" / "tiny_models.py"
    key = hashlib.sha256(script.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("HOTSWAP_TINY_MODELS_CACHE") or Path.home() / ".cache" / "hotswap" / "tiny-models")
    root = cache / key
    if not (root / "DONE").exists():
        raise SystemExit(f"bench: no tiny models at {root}: run `.venv/bin/pytest tests/integration -m vllm` once to build them")
    return root


# --- the canary and the drift ------------------------------------------------------------------


@dataclass
class Canary:
    ids: list[int]
    logprobs: list[float]
    mal: Optional[float] = None  # mean acceptance length from the counters (spec engines, nothing else running)


@dataclass
class Drift:
    identical: bool
    positions: int
    mean: float
    max: float

    @staticmethod
    def of(a: Canary, b: Canary) -> "Drift":
        diffs = [abs(la - lb) for ia, ib, la, lb in zip(a.ids, b.ids, a.logprobs, b.logprobs) if ia == ib]
        return Drift(a.ids == b.ids, len(diffs), sum(diffs) / len(diffs) if diffs else float("nan"), max(diffs, default=float("nan")))


def canary(engine: VllmServer, reset: bool = True, acceptance: bool = False) -> Canary:
    if reset:
        poll(lambda: (http("POST", engine.url + "/reset_prefix_cache")[1] or {}).get("success"), 30, "reset_prefix_cache")
    before = spec_counters(engine.url) if acceptance else None
    status, body = http("POST", engine.url + "/v1/completions", {
        "model": engine.name, "prompt": DEFAULT_GATE_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_token_ids": True})
    assert status == 200, f"canary -> {status} {body}"
    choice = body["choices"][0]
    out = Canary(choice["token_ids"], choice["logprobs"]["token_logprobs"])
    if before is not None:  # as harness.VllmServer.canary: the counters can lag the answer
        def moved() -> Optional[dict[str, float]]:
            now = spec_counters(engine.url)
            d = {k: now[k] - before[k] for k in now}
            return d if d["drafts"] + d["accepted"] >= MAX_TOKENS - 1 else None
        d = poll(moved, 30, "spec-decode counters to take in the canary")
        out.mal = 1 + d["accepted"] / d["drafts"]
    return out


class Decoding:
    """One long streaming completion on its own thread: `started` at its first token, `finished` at [DONE]."""

    def __init__(self, engine: VllmServer, prompt: str):
        self.started, self.finished = threading.Event(), threading.Event()
        self.error: Optional[BaseException] = None
        self.chunks = 0
        body = {"model": engine.name, "prompt": prompt, "max_tokens": OTHER_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(engine.port, body), daemon=True)
        self.thread.start()

    def _run(self, port: int, body: dict[str, Any]) -> None:
        try:
            conn = HTTPConnection("127.0.0.1", port, timeout=300)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    break
                if line.startswith(b"data: "):
                    self.chunks += 1
                    self.started.set()
            conn.close()
        except BaseException as exc:  # reported in the table as not overlapped
            self.error = exc
        finally:
            self.finished.set()


def under_load(engine: VllmServer, others: int, rep: int, attempts: int = 5) -> tuple[Canary, bool]:
    """The canary while `others` requests decode; retried when one of them finished before the canary did.

    On 2 shared cores the API server sometimes admits the other requests a second apart, and a
    400-token request can finish before the last one starts.
    """
    for attempt in range(attempts):
        poll(lambda: (http("POST", engine.url + "/reset_prefix_cache")[1] or {}).get("success"), 30, "reset_prefix_cache")
        load = [Decoding(engine, f"Request {rep}-{i}: tell a long story about the number {i * 7 + rep}.") for i in range(others)]
        for d in load:
            if not d.started.wait(60) or d.error:
                raise SystemExit(f"bench: a background request did not start: {d.error}")
        c = canary(engine, reset=False)
        overlapped = all(d.started.is_set() and not d.finished.is_set() and not d.error for d in load)
        if not overlapped:
            print(f"bench: not overlapped ({others} others, attempt {attempt + 1}): chunks at the canary's answer "
                  f"{[(d.chunks, d.finished.is_set(), repr(d.error)) for d in load]}", file=sys.stderr, flush=True)
        for d in load:
            d.thread.join(300)
        if overlapped:
            break
    return c, overlapped


# --- engines -------------------------------------------------------------------------------------


def boot(name: str, models: Path, logs: Path, dtype: str = "float32", spec: bool = False) -> VllmServer:
    target = models / "target"
    args = ["--worker-extension-cls", EXTENSION, "--dtype", dtype, "--max-model-len", "512", "--enforce-eager"]
    if spec:
        args = ["--speculative-config", json.dumps({"model": str(target), "num_speculative_tokens": 2}), *args]
    engine = VllmServer(name, target, args, env={}, log_dir=logs)
    print(f"bench: booting {name} ({dtype}{', spec k=2' if spec else ''})", file=sys.stderr, flush=True)
    return engine.start()


def fmt(x: float) -> str:
    return "nan" if x != x else "0" if x == 0 else f"{x:.2e}" if 0 < abs(x) < 1e-3 else f"{x:.4f}"


def row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# --- the measurements ----------------------------------------------------------------------------


def wake_cycle(engine: VllmServer, level: int, spec: bool) -> None:
    """The router's wake, as far as CPU vLLM has it (sleep is bookkeeping there; the reloads are real)."""
    def call(method: str, path: str, body: Any = None) -> None:
        status, answer = http(method, engine.url + path, body)
        assert status == 200, f"{method} {path} -> {status} {answer}"

    call("POST", f"/sleep?level={level}&mode=wait")
    if level == 1:
        call("POST", "/wake_up")
    else:
        call("POST", "/wake_up?tags=weights")
        if spec:
            engine.rpc("hotswap_reload_draft")
        engine.rpc("reload_weights")
        call("POST", "/wake_up?tags=kv_cache")


def repeated(engine: VllmServer, label: str, base: Canary, n: int, spec: bool, out: list[str]) -> None:
    modes = {
        "hits": lambda: canary(engine, reset=False),
        "reset before each": lambda: canary(engine),
        "after a L1 sleep/wake, reset": lambda: (wake_cycle(engine, 1, spec), canary(engine))[1],
        "after a L2 wake (reload_weights), reset": lambda: (wake_cycle(engine, 2, spec), canary(engine))[1],
    }
    for mode, run in modes.items():
        count = n if mode in ("hits", "reset before each") else max(1, n // 4)
        drifts = [Drift.of(base, run()) for _ in range(count)]
        same = sum(d.identical for d in drifts)
        nonzero = sum(d.mean > 0 for d in drifts)
        out.append(row(label, mode, count, f"{same}/{count}", f"{nonzero}/{count}",
                       fmt(sum(d.mean for d in drifts) / count), fmt(max(d.mean for d in drifts)), fmt(max(d.max for d in drifts))))


def batched(engine: VllmServer, label: str, base: Canary, reps: int, out: list[str]) -> None:
    for others in OTHERS:
        results = [under_load(engine, others, rep) for rep in range(reps)]
        drifts = [Drift.of(base, c) for c, _ in results]
        out.append(row(label, others, f"{sum(ok for _, ok in results)}/{reps}", f"{sum(d.identical for d in drifts)}/{reps}",
                       min(d.positions for d in drifts), fmt(sum(d.mean for d in drifts) / reps),
                       fmt(max(d.mean for d in drifts)), fmt(max(d.max for d in drifts))))


def perturbed(engine: VllmServer, label: str, base: Canary, spec: bool, out: list[str]) -> None:
    (digest0,), _ = engine.rpc("hotswap_target_digest")
    for scale in SCALES:
        (res,), _ = engine.rpc("hotswap_perturb_target", str(scale))
        c = canary(engine, acceptance=spec)
        d = Drift.of(base, c)
        mal = f"{base.mal:.2f} -> {c.mal:.2f}" if spec else "-"
        out.append(row(label, scale, "yes" if d.identical else "NO", d.positions, fmt(d.mean), fmt(d.max), mal,
                       "yes" if res["digest_after"] != digest0 else "no"))
    (res,), _ = engine.rpc("hotswap_perturb_target", "1.0")
    d = Drift.of(base, canary(engine, acceptance=spec))
    out.append(row(label, "1.0 (restore)", "yes" if d.identical else "NO", d.positions, fmt(d.mean), fmt(d.max), "-",
                   "back to the checkpoint's" if res["digest_after"] == digest0 else "STILL CHANGED"))


def measure(plans: list[tuple[str, bool]], args: argparse.Namespace, models: Path, logs: Path, a_rows: list[str],
            b_rows: list[str], c_rows: list[str], f_rows: list[str], notes: list[str], bases: dict[str, Canary]) -> None:
    """Boot each engine in turn (one at a time: 2 cores) and fill the rows."""
    for dtype, spec in plans:
        label = f"{dtype}{' + spec k=2' if spec else ''}"
        try:
            engine = boot(label.replace(" + spec k=2", "-spec"), models, logs, dtype, spec)
        except AssertionError as exc:
            notes.append(f"- {label}: the engine did not boot: {str(exc).splitlines()[0]}")
            continue
        try:
            bases[label] = base = canary(engine, acceptance=spec)
            b_rows.append(row(label, 1, f"{engine.boot_s:.0f}", "reference", MAX_TOKENS, "0", "0"))
            repeated(engine, label, base, args.repeats, spec, a_rows)
            batched(engine, label, base, args.reps, c_rows)
            if dtype == "float32":
                perturbed(engine, label, base, spec, f_rows)
        finally:
            engine.stop()
        if dtype == "float32" and not spec:
            for n in range(2, args.boots + 1):
                again = boot(f"float32-boot{n}", models, logs)
                try:
                    d = Drift.of(base, canary(again))
                finally:
                    again.stop()
                b_rows.append(row(label, n, f"{again.boot_s:.0f}", "yes" if d.identical else "NO", d.positions, fmt(d.mean), fmt(d.max)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20, help="a: canaries after the first (default %(default)s)")
    p.add_argument("--boots", type=int, default=3, help="b: cold boots (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="c: canaries per batch size (default %(default)s)")
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--keep-logs", action="store_true", help="keep the scratch dir with the engine logs")
    args = p.parse_args()

    models = tiny_models()
    scratch = Path(tempfile.mkdtemp(prefix="hotswap-drift-", dir="/tmp"))
    os.environ.setdefault("HOTSWAP_VLLM_SCRATCH", str(scratch))
    logs = scratch / "logs"
    logs.mkdir()
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    a_rows: list[str] = []
    b_rows: list[str] = []
    c_rows: list[str] = []
    f_rows: list[str] = []
    notes: list[str] = []
    bases: dict[str, Canary] = {}

    plans = [("float32", False), ("bfloat16", False), ("float32", True)]
    if args.skip_bf16:
        plans.remove(("bfloat16", False))
    try:
        measure(plans, args, models, logs, a_rows, b_rows, c_rows, f_rows, notes, bases)
    finally:
        if args.keep_logs:
            print(f"bench: logs kept in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if "float32" in bases and "float32 + spec k=2" in bases:
        d = Drift.of(bases["float32"], bases["float32 + spec k=2"])
        b_rows.append(row("spec k=2 boot 1 vs plain boot 1", "-", "-", "yes" if d.identical else "NO", d.positions, fmt(d.mean), fmt(d.max)))
    if "float32" in bases and "bfloat16" in bases:
        d = Drift.of(bases["float32"], bases["bfloat16"])
        b_rows.append(row("bfloat16 boot 1 vs float32 boot 1", "-", "-", "yes" if d.identical else "NO", d.positions, fmt(d.mean), fmt(d.max)))

    minutes = (time.monotonic() - t0) / 60
    print(f"\n{bench.host(started)}; vLLM 0.32 CPU, tiny Llama (hidden 128, 2 layers, vocab 512), canary {MAX_TOKENS} tokens, "
          f"`--max-model-len 512 --enforce-eager`; {minutes:.1f} min; `{bench.command_line()}` at {bench.git_rev()}\n")
    print("drift = mean |Δ logprob| over positions with identical tokens, vs the engine's first canary after its cold boot\n")
    print("### a/d/e. Same engine, repeated canaries\n")
    print(row("engine", "canary", "canaries", "tokens identical", "drift > 0", "mean drift (avg)", "mean drift (worst)", "max |Δ| (worst)"))
    print(row(*["---"] * 8))
    print("\n".join(a_rows))
    print("\n### b. Across cold boots (canary 1 of each boot)\n")
    print(row("engine", "boot", "boot s", "tokens identical", "positions", "mean drift", "max |Δ|"))
    print(row(*["---"] * 7))
    print("\n".join(b_rows))
    print(f"\n### c/d/e. The canary while other requests decode ({args.reps} canaries per row, reset prefix cache before each)\n")
    print(row("engine", "other requests", "overlapped", "tokens identical", "positions (min)", "mean drift (avg)", "mean drift (worst)", "max |Δ| (worst)"))
    print(row(*["---"] * 8))
    print("\n".join(c_rows))
    print("\n### f. hotswap_perturb_target(scale) vs the baseline\n")
    print(row("engine", "scale", "tokens identical", "positions", "mean drift", "max |Δ|", "MAL baseline -> perturbed", "target digest changed"))
    print(row(*["---"] * 8))
    print("\n".join(f_rows))
    if notes:
        print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
