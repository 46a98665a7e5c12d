"""Time to the first answered request after `hotswap serve` starts: five simulated engines with
staggered boot times on one GPU, this tree beside an older one, in one run.

    .venv/bin/python bench/boot_serving.py [--before REV] [--boot-s 8,4,2,1,0.5] [--reps 2]

`--before` (default: the commit before boot-while-serving) is unpacked with `git archive` and run
from its own directory, the same roster, alternating with this tree each repetition. As soon as
the router listens, one client per model sends a completion (queue.max_wait_s is long, so an old
router that waits for the whole roster answers late rather than 503); each answer's time is
measured from the moment `serve` was started. A real engine boots in one to three minutes; the
boot times here are seconds, and the ratios are what carries over.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import harness as h

HEADING = "## Boot while serving: time to the first answer (issue 22)"
BEFORE = "6448d53^"  # the last commit whose scheduler booted the whole roster before serving


LAYOUTS = {"one-gpu": lambda i: 0, "gpu-each": lambda i: i}  # model index -> its device


def roster(port: int, boot_s: list[float], layout: str) -> str:
    device = LAYOUTS[layout]
    models = [{"name": f"m{i}", "model": f"sim/m{i}", "launcher": ["python", "-m", "engines.sim", "serve"],
               "args": ["--sim-boot-s", str(s), "--sim-token-rate", "5000", "--gpu-memory-utilization", "0.18"],
               "devices": [device(i - 1)], "gate": {"max_tokens": 8}} for i, s in enumerate(boot_s, 1)]
    gpus = sorted({device(i) for i in range(len(boot_s))})
    return json.dumps({"listen": {"port": port}, "queue": {"max_wait_s": 600}, "swap": {"boot_timeout_s": 600},
                       "gpus": [{"index": d, "memory_gb": 80} for d in gpus], "models": models})


def unpack(rev: str, into: Path) -> Path:
    into.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=h.REPO, capture_output=True, check=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def one_run(run: h.Session, src: Path, name: str, boot_s: list[float], layout: str) -> dict[str, float]:
    """Seconds from `serve` to each model's first answer."""
    port = h.free_port()
    path = run.tmp / f"roster-{name}.json"
    path.write_text(roster(port, boot_s, layout))
    log = run.tmp / f"{name}.log"
    procs = h.Processes()  # one router at a time: each run's are stopped before the next starts
    t0 = time.monotonic()
    proc = procs.start(name, [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", str(port),
                                  "--log-dir", str(run.tmp / f"engines-{name}")], log, cwd=src)
    answered: dict[str, float] = {}

    def ask(model: str) -> None:
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
        status, text = h.request("POST", f"http://127.0.0.1:{port}/v1/completions", body, timeout=600)
        if status != 200:
            raise SystemExit(f"bench: {name}: {model} answered {status}: {text[:300]!r}; log {log}")
        answered[model] = time.monotonic() - t0

    try:
        h.wait_until_ok(f"http://127.0.0.1:{port}/health", proc, log, deadline_s=60)
        clients = [threading.Thread(target=ask, args=(f"m{i}",)) for i in range(1, len(boot_s) + 1)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
    finally:
        procs.close()
    if len(answered) != len(boot_s):
        raise SystemExit(f"bench: {name}: only {sorted(answered)} answered; log {log}")
    return answered


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=BEFORE, help="the tree to compare with (default %(default)s)")
    p.add_argument("--boot-s", default="8,4,2,1,0.5", help="each engine's boot seconds, in roster order (default %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions (default %(default)s)")
    h.add_session_args(p)
    args = p.parse_args()
    boot_s = [float(x) for x in args.boot_s.split(",")]
    with h.session(args, "hotswap-boot-") as run:
        before = unpack(args.before, run.tmp / "before")
        tables = []
        for layout in LAYOUTS:
            results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for rep in range(args.reps):
                for name, src in (("before", before), ("after", h.REPO)):
                    got = one_run(run, src, f"{layout}-{name}-{rep}", boot_s, layout)
                    results[name].append(got)
                    print(f"  {layout} rep {rep} {name}: " + ", ".join(f"{m} {s:.1f} s" for m, s in sorted(got.items())), flush=True)
            tables += [f"**{layout}** ({'all five on GPU 0' if layout == 'one-gpu' else 'one GPU each'}):", "", *table(results, boot_s), ""]
        text = "\n".join([
            HEADING, "",
            f"{h.host(run.started)}; {h.git_rev()} against `{args.before}`; {args.reps} alternating repetitions (median).",
            f"Command: `{h.command_line()}`", "",
            f"Five simulated engines booting in {', '.join(f'{s:g}' for s in boot_s)} s (roster order), one request per "
            "model sent as soon as the router listens; seconds from `serve` to each answer.", "",
            *tables,
            "Before, every request waited for the whole roster's boot. After, each model answers once its own boot (and, "
            "on one GPU, the boots ahead of it: one at a time there) is done; on separate GPUs they boot at once.",
        ])
        run.publish(text, HEADING)
    return 0


def table(results: dict[str, list[dict[str, float]]], boot_s: list[float]) -> list[str]:
    def median(side: str, m: str) -> float:
        values = sorted(r[m] for r in results[side])
        return values[len(values) // 2]

    rows = ["| model | boot s | before: answer s | after: answer s | after / before |", "| --- | ---: | ---: | ---: | ---: |"]
    for i, s in enumerate(boot_s, 1):
        b, a = median("before", f"m{i}"), median("after", f"m{i}")
        rows.append(f"| m{i} | {s:g} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    first_b = sorted(min(r.values()) for r in results["before"])[len(results["before"]) // 2]
    first_a = sorted(min(r.values()) for r in results["after"])[len(results["after"]) // 2]
    last_b = sorted(max(r.values()) for r in results["before"])[len(results["before"]) // 2]
    last_a = sorted(max(r.values()) for r in results["after"])[len(results["after"]) // 2]
    rows += ["", f"First answer: {first_b:.1f} s before, {first_a:.1f} s after ({first_a / first_b:.2f}×); "
                 f"last: {last_b:.1f} s before, {last_a:.1f} s after ({last_a / last_b:.2f}×)."]
    return rows


if __name__ == "__main__":
    sys.exit(main())
