"""Proxy cost (issue 4): what does hotswap cost per request compared with a bare Python proxy?

    .venv/bin/python bench/proxy_cost.py [--requests N] [--stream-requests N] [--concurrency C] [--reps R]

One run, three targets, the same kind of upstream (the simulator, `engines.sim`, with no
boot delay and a 100k tokens/s decode rate, so the upstream is as cheap as it gets):

  direct   clients -> sim                         (baseline: the engine's own CPU and latency)
  bare     clients -> bench/bare_proxy.py -> sim  (the floor for an aiohttp+uvloop proxy)
  hotswap  clients -> `python -m router.cli serve` (client API keys on, metrics on) -> its own sim

For each target and mode (non-stream `/v1/completions` with max_tokens 16; a 64-chunk stream
with max_tokens 64) the load generator of bench/harness.py, in its own process (aiohttp, C
concurrent keep-alive connections, a fixed request count bounded by a deadline), measures per-request latency and
rps, while this process reads the proxy's and the engine's CPU time (utime+stime from
/proc/PID/stat) around the measured window. The targets run interleaved, `--reps` times
(direct, bare, hotswap, direct, bare, hotswap), so the spread between repetitions shows
the noise. The result is printed as markdown and written to docs/benchmarks.md under
"Proxy cost: the last generated run" (not with --no-docs).

This is a benchmark, not a test: it asserts nothing except that every request succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import harness as h  # bench/harness.py: targets, phases, load generator, processes, /proc, report helpers
from harness import MODEL, MODES, SIM_FLAGS

TARGET_CPU_RATIO = 1.2
SECTION = "## Proxy cost: the last generated run"


def start_targets(procs: h.Processes, args: argparse.Namespace, tmp: Path) -> list[h.Target]:
    # direct and bare share one sim, launched with the argv the router composes for its own.
    sim_port, sim_pid = h.start_sim(procs, tmp)
    bare = h.start_bare(procs, tmp, sim_port, sim_pid)

    router_port = h.free_port()
    roster = (
        "# written by bench/proxy_cost.py\n"
        f"listen: {{host: 127.0.0.1, port: {router_port}}}\n"
        "auth:\n"
        '  api_keys: ["${BENCH_KEY}"]\n'
        "models:\n"
        f"  - name: {MODEL}\n"
        f"    model: {MODEL}/sim\n"
        "    launcher: [python, -m, engines.sim, serve]\n"
        f"    args: [{', '.join(json.dumps(a) for a in SIM_FLAGS)}]\n")
    router, router_log = h.start_router(procs, tmp, "router", router_port, roster, env={"BENCH_KEY": args.key}, src=args.router_src)
    status = json.loads(h.wait_until_ok(f"http://127.0.0.1:{router_port}/admin/status", router, router_log))
    reaper = status["engines"][0]["pid"]
    procs.extra_groups.append(reaper)  # engines.process.reaper leads the engine's process group
    kids = h.children(reaper)
    if len(kids) != 1:
        raise SystemExit(f"bench: expected one sim below the router's reaper {reaper}, found {kids}")
    bare.key = args.key
    return [
        h.Target("direct", f"http://127.0.0.1:{sim_port}", None, sim_pid, key=args.key),
        bare,
        # The router process alone: its engine (under the reaper) is its child and is reported as upstream.
        h.Target("hotswap", f"http://127.0.0.1:{router_port}", router.pid, kids[0], key=args.key, tree=False),
    ]


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def report(phases: list[h.Phase], idle: dict[str, float], args: argparse.Namespace, command: str, started: str, elapsed: float) -> str:
    by = {(p.target, p.mode, p.rep): p for p in phases}
    reps = sorted({p.rep for p in phases})
    lines = [
        "| target | mode | rep | requests | errors | rps | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| proxy CPU µs/req | engine CPU µs/req | other procs' CPU |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for rep in reps:
            for target in ("direct", "bare", "hotswap"):
                p = by.get((target, mode, rep))
                if p is None:
                    continue
                d = by.get(("direct", mode, rep))
                added = f"{p.p50_ms - d.p50_ms:+.1f}" if d and target != "direct" else "-"
                added99 = f"{p.p99_ms - d.p99_ms:+.1f}" if d and target != "direct" else "-"
                proxy = f"{p.proxy_us:.0f}" if p.proxy_us is not None else "- (none)"
                lines.append(f"| {target} | {mode} | {rep} | {p.ok} | {p.errors} | {p.rps:.0f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} "
                             f"| {added} | {added99} | {proxy} | {p.upstream_us:.0f} | {p.other_pct:.0f}% |")

    summary = ["", "| mode | bare proxy CPU µs/req (mean) | hotswap CPU µs/req (mean) | hotswap ÷ bare: median (per rep) "
               f"| target ≤ {TARGET_CPU_RATIO:g}× | added p50 ms: bare / hotswap (mean) |", "|---|---:|---:|---|---|---|"]
    verdicts = []
    for mode in MODES:
        pairs = [(by[("bare", mode, r)], by[("hotswap", mode, r)]) for r in reps if ("bare", mode, r) in by and ("hotswap", mode, r) in by
                 and by[("bare", mode, r)].proxy_us and by[("hotswap", mode, r)].proxy_us]  # None: a phase with no request through
        if not pairs:
            continue
        # Each rep's bare and hotswap phases ran back to back, under the same background load:
        # their ratio is the robust number; the median ignores one disturbed rep.
        per_rep = [hot.proxy_us / bare.proxy_us for bare, hot in pairs]
        ratio = statistics.median(per_rep)
        met = ratio <= TARGET_CPU_RATIO
        verdicts.append((mode, ratio, met))

        def added(target: str) -> str:
            xs = [by[(target, mode, r)].p50_ms - by[("direct", mode, r)].p50_ms for r in reps
                  if (target, mode, r) in by and ("direct", mode, r) in by]
            return f"{mean(xs):+.1f}" if xs else "-"

        summary.append(f"| {mode} | {mean([bare.proxy_us for bare, _ in pairs]):.0f} | {mean([hot.proxy_us for _, hot in pairs]):.0f} "
                       f"| **{ratio:.2f}×** ({', '.join(f'{x:.2f}' for x in per_rep)}) "
                       f"| {'met' if met else '**missed**'} | {added('bare')} / {added('hotswap')} |")

    head = [
        SECTION,
        "",
        f"{h.host(started)}, {h.client_versions()}, commit {h.git_rev()}. Took {elapsed:.0f} s.",
        "",
        "```",
        command,
        "```",
        "",
        f"Upstream: `engines.sim` ({' '.join(SIM_FLAGS)}); direct and bare proxy share one sim started by the bench, "
        "hotswap launches its own from the roster with the same flags (under `engines.process.reaper`; the engine writes its own log file, nothing passes through the router). "
        f"Load: a separate aiohttp process, {args.concurrency} concurrent keep-alive connections, "
        f"{args.requests} non-stream requests (`/v1/completions`, max_tokens 16) and {args.stream_requests} streams "
        f"(max_tokens 64, 64 data chunks + `[DONE]`) per phase after a warmup, each phase capped at {args.max_seconds:g} s; "
        "loopback only. Latency is to the last byte. CPU is utime+stime from `/proc/PID/stat` around the measured window: "
        "*proxy* = the bare proxy or the router process (its engine children excluded); *engine* = the sim behind it "
        "(for direct, the engine's CPU is the baseline and there is no proxy). Added latency = target − direct, same rep. "
        "*Other procs' CPU* = the share of the machine's CPU (from `/proc/stat`) that processes outside the bench used during "
        "the phase: the machine is shared, so compare ratios of adjacent phases, not absolute numbers. "
        f"Load average at start / end: {args.loadavg_start} / {h.loadavg()}.",
        "",
        f"Hotswap: client API key auth on (`auth.api_keys: [\"${{BENCH_KEY}}\"]`), Prometheus metrics on (always), one model, "
        "no body rewrite (the client's `model` is the engine's served name). "
        f"Idle proxy CPU (nothing sent, {args.idle_seconds:g} s): "
        + ", ".join(f"{n} {v:.1f} ms/s" for n, v in idle.items()) + ".",
        "",
    ]
    verdict = []
    for mode, ratio, met in verdicts:
        verdict.append(f"- {mode}: hotswap uses **{ratio:.3f}×** the bare proxy's CPU per request (median of per-rep ratios) — "
                       f"target ≤ {TARGET_CPU_RATIO:g}×: **{'met' if met else 'missed'}**.")
    ticks = [p.proxy_us * p.ok / 1e6 * h.CLK_TCK for p in phases if p.proxy_us]
    if ticks:
        verdict.append(f"- CPU resolution: {1e3 / h.CLK_TCK:g} ms ticks; the smallest proxy CPU measured in one phase was "
                       f"{min(ticks):.0f} ticks, so quantization alone is within ±{100 / min(ticks):.1f}% per phase.")
    errors = sum(p.errors for p in phases)
    if errors:
        verdict.append(f"- **{errors} requests failed**; the numbers above are suspect.")
    return "\n".join(head + lines + summary + ["", "Verdict:", ""] + verdict) + "\n"


# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_load_args(p, reps=3, reps_help="interleaved repetitions of direct, bare, hotswap")
    p.add_argument("--targets", default="direct,bare,hotswap", help="comma-separated subset (default %(default)s)")
    h.add_session_args(p)
    a = p.parse_args(argv)
    a.key = "bench-" + os.urandom(8).hex()
    a.loadavg_start = h.loadavg()
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    with h.session(args, "hotswap-bench-") as run:
        args.loadavg_start = run.load_start
        print(f"bench: starting sim, bare proxy and hotswap (logs in {run.tmp})", flush=True)
        targets = [t for t in start_targets(run.procs, args, run.tmp) if t.name in wanted]
        print(f"bench: ready after {time.monotonic() - run.t0:.1f} s", flush=True)
        idle = h.idle_cpu(targets, args.idle_seconds)
        phases: list[h.Phase] = []
        for rep in range(1, args.reps + 1):
            for target in targets:
                for mode in [m for m in MODES if m in args.modes.split(",")]:
                    phases.append(h.run_phase(run.procs, target, mode, rep, args, run.tmp))
        run.publish(report(phases, idle, args, h.command_line(), run.started, time.monotonic() - run.t0), SECTION)
        return 1 if any(p.errors for p in phases) else 0
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
