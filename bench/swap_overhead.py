"""Swap path overhead (issue 8): the router's own time per swap, beyond what the engines take.

    .venv/bin/python bench/swap_overhead.py [--swaps N] [--step-delay STEP=SECONDS ...]

Two simulated engines (`engines.sim`, a draft model each, Level-2 sleep, no boot delay) share one
group of a real router (`python -m router.cli serve`, `swap.min_active_s: 0`). Every step the
router drives has a known delay in the sim (`--sim-step-delay`, defaults below). The bench then
sends one request at a time, alternating the two models, so every request triggers exactly one
swap (sleep the awake engine, staged Level-2 wake of the other, promotion gate), and after each
swap reads the swap's record from GET /admin/status (`groups.*.last_swap`: `seconds` and the
per-step `phases`) and the woken engine's call log from the sim (GET /sim/log on the engine's
port: the monotonic time at which each step's request reached the engine).

Per swap it reports:

  router        swap seconds - sum(phase seconds): what the scheduler does outside the timed steps
                (target < 5 ms)
  step RTT      each phase's time - its configured delay: HTTP round trip + the sim's handling +
                the engine wrapper's bookkeeping
  gate beyond   gate phase seconds - the canary's own generation, timed as a direct completion of
  canary        the same body (gate prompt, max_tokens, temperature 0, ignore_eos) on the freshly
                promoted engine right after the swap, min of 3 (target < 50 ms)
  client extra  the swapping request's latency through the router - swap seconds - the same request
                sent directly to the engine: queueing, the scheduler's wake-up, the lease

Times are medians and p90 over the swaps. Results go to docs/benchmarks.md under
"Swap path overhead: the last generated run". Loopback only; bounded by --swaps and --max-seconds; every
process is stopped on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

import harness as h  # bench/harness.py: processes, the router starter, report helpers, the run session
from engines import waking

SECTION = "## Swap path overhead: the last generated run"
GROUP = "bench"
MODELS = ("swap-a", "swap-b")
# The roster's engines sleep at Level 2 and restore their draft by reload: the wake the router runs for them.
WAKE_STEPS = tuple(waking.phases(2, "reload"))
DEFAULT_DELAYS = {"sleep": 0.05, "wake_weights": 0.2, "reload_draft": 0.1, "reload_weights": 0.15,
                  "wake_kv_cache": 0.05, "reset_prefix_cache": 0.02}
TOKEN_RATE = 2000.0
TARGET_ROUTER_MS = 5.0
TARGET_GATE_MS = 50.0
REQUEST = {"prompt": "Swap to", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def http(method: str, url: str, body: Optional[dict] = None, timeout: float = 60.0) -> tuple[int, Any, float]:
    """(status, parsed JSON or raw bytes, seconds)."""
    t0 = time.perf_counter()
    status, raw = h.request(method, url, json.dumps(body).encode() if body is not None else None, timeout=timeout)
    dt = time.perf_counter() - t0
    try:
        return status, json.loads(raw), dt
    except ValueError:
        return status, raw, dt


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--swaps", type=int, default=30, help="swaps to measure (default %(default)s)")
    p.add_argument("--warmup-swaps", type=int, default=2, help="swaps run first and not counted (default %(default)s)")
    p.add_argument("--step-delay", action="append", default=[], metavar="STEP=SECONDS",
                   help=f"override a sim step delay (defaults: {', '.join(f'{k}={v:g}' for k, v in DEFAULT_DELAYS.items())})")
    p.add_argument("--max-seconds", type=float, default=300.0, help="stop measuring after this long (default %(default)s)")
    h.add_session_args(p)
    a = h.parse(p, argv, smoke=dict(swaps=2, warmup_swaps=1, max_seconds=60.0))
    a.delays = dict(DEFAULT_DELAYS)
    for item in a.step_delay:
        step, _, value = item.partition("=")
        if step not in DEFAULT_DELAYS:
            p.error(f"--step-delay: unknown step {step!r}; steps: {', '.join(DEFAULT_DELAYS)}")
        a.delays[step] = float(value)
    return a


def roster(port: int, delays: dict[str, float]) -> str:
    sim_args = ["--sim-boot-s", "0", "--sim-token-rate", f"{TOKEN_RATE:g}"]
    for step, s in delays.items():
        sim_args += ["--sim-step-delay", f"{step}={s:g}"]
    lines = [
        "# written by bench/swap_overhead.py",
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        "swap:",
        "  min_active_s: 0",
        "defaults:",
        f"  group: {GROUP}",
        "  launcher: [python, -m, engines.sim, serve]",
        f"  args: [{', '.join(json.dumps(a) for a in sim_args)}]",
        "models:",
    ]
    for i, name in enumerate(MODELS):
        lines += [f"  - name: {name}", f"    model: bench/{name}",
                  f"    speculative: {{method: draft_model, model: bench/{name}-draft, num_speculative_tokens: 3}}"]
        if i == 0:
            lines.append("    default: true")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with h.session(args, "hotswap-swapbench-") as run:
        procs, tmp, started, load_start, t0 = run.procs, run.tmp, run.started, run.load_start, run.t0
        port = h.free_port()
        print(f"bench: starting the router on port {port}, logs in {tmp}", flush=True)
        _, log = h.start_router(procs, tmp, "router", port, roster(port, args.delays), env={"PYTHONUNBUFFERED": "1"})
        base = f"http://127.0.0.1:{port}"
        # Both engines booted (the default one last) before the first swap.
        deadline = time.monotonic() + 120
        while True:
            status = http("GET", f"{base}/admin/status")[1]
            awake = [e["name"] for e in status["engines"] if e["state"] == "awake"]
            if status["booted"] and awake:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: engines not booted within 120 s; log {log}:\n{h.tail(log)}")
            time.sleep(0.1)
        for e in status["engines"]:
            procs.extra_groups.append(e["pid"])  # engines.process.reaper leads each engine's process group
        from config.schema import Gate  # the canary the router runs, for timing it directly

        g = Gate()
        canary = {"prompt": g.prompt, "max_tokens": g.max_tokens, "temperature": 0, "ignore_eos": True}
        args.canary_tokens = g.max_tokens

        rows: list[dict[str, Any]] = []
        seen_at: set[float] = set()
        active = awake[0]
        total = args.warmup_swaps + args.swaps
        measure_deadline = time.monotonic() + args.max_seconds
        for i in range(total):
            if time.monotonic() > measure_deadline:
                print(f"bench: --max-seconds reached after {len(rows)} measured swaps", flush=True)
                break
            target = MODELS[1] if active == MODELS[0] else MODELS[0]
            status_code, answer, latency = http("POST", f"{base}/v1/completions", {"model": target, **REQUEST}, timeout=120)
            if status_code != 200:
                raise SystemExit(f"bench: request for {target} answered {status_code}: {str(answer)[:300]}")
            status = http("GET", f"{base}/admin/status")[1]
            rec = status["last_swap"]
            if rec is None or rec["at"] in seen_at or rec["to"] != target or rec["result"] != "ok":
                raise SystemExit(f"bench: expected a new successful swap to {target}, /admin/status says {rec}")
            seen_at.add(rec["at"])
            active = target
            eng = next(e for e in status["engines"] if e["name"] == target)
            eport = eng["port"]
            sim_log = http("GET", f"http://127.0.0.1:{eport}/sim/log")[1]
            http("DELETE", f"http://127.0.0.1:{eport}/sim/log")
            # The same work straight to the engine: the swapping request, then the canary (min of 3).
            direct_req = http("POST", f"http://127.0.0.1:{eport}/v1/completions", {"model": target, **REQUEST})[2]
            direct_canary = min(http("POST", f"http://127.0.0.1:{eport}/v1/completions", {"model": target, **canary})[2]
                                for _ in range(3))
            if i < args.warmup_swaps:
                continue
            phases = rec["phases"]
            # The woken engine's calls from this wake on: the wake steps, then the canary (the first
            # generate after them; earlier generates are this bench's direct requests of the last round).
            start = next((i for i, c in enumerate(sim_log) if c["step"] == WAKE_STEPS[0]), len(sim_log))
            t_call: dict[str, float] = {}
            for c in sim_log[start:]:
                if c["step"] in (*WAKE_STEPS, "generate") and c["step"] not in t_call:
                    t_call[c["step"]] = c["t"]
            verdict = eng.get("last_verdict") or {}
            rows.append({
                "n": len(rows) + 1, "from": rec["from"], "to": rec["to"], "seconds": rec["seconds"], "phases": phases,
                "router_s": rec["seconds"] - sum(phases.values()),
                "vs_delays_s": rec["seconds"] - sum(args.delays.values()) - direct_canary,
                "gate_s": phases.get("gate", float("nan")), "canary_s": direct_canary,
                "gate_beyond_s": phases.get("gate", float("nan")) - direct_canary,
                "verdict_s": verdict.get("seconds"), "verdict": verdict.get("result"),
                "client_s": latency, "direct_req_s": direct_req, "client_extra_s": latency - rec["seconds"] - direct_req,
                "t_call": t_call,
            })
            r = rows[-1]
            print(f"  swap {r['n']:3d} {r['from']} -> {r['to']}: {r['seconds'] * 1e3:7.1f} ms, router {r['router_s'] * 1e3:6.2f} ms, "
                  f"gate {r['gate_s'] * 1e3:6.1f} ms (canary {direct_canary * 1e3:5.1f} ms, beyond {r['gate_beyond_s'] * 1e3:5.1f} ms), "
                  f"client extra {r['client_extra_s'] * 1e3:5.1f} ms, verdict {r['verdict']}", flush=True)
        if not rows:
            raise SystemExit("bench: no swap measured")
        text = report(rows, args, h.command_line(), started, time.monotonic() - t0, load_start)
        run.publish(text, SECTION)
        return 0
    return 130


def report(rows: list[dict[str, Any]], args: argparse.Namespace, command: str, started: str, elapsed: float, load_start: str) -> str:
    ms = lambda xs: [x * 1e3 for x in xs if x is not None]  # noqa: E731

    def line(label: str, xs: list[float], note: str = "", target: Optional[float] = None) -> str:
        med, p90 = h.percentile(xs, 0.5), h.percentile(xs, 0.9)
        verdict = f" | **{'met' if med < target else 'missed'}** (< {target:g} ms)" if target is not None else " | "
        return f"| {label} | {med:.2f} | {p90:.2f} | {min(xs):.2f} | {max(xs):.2f}{verdict} | {note} |"

    steps = [s for s in waking.PHASES if s != "gate" and any(s in r["phases"] for r in rows)]  # the gate has rows of its own
    table = [
        "| per swap, ms | median | p90 | min | max | target | what |",
        "|---|---:|---:|---:|---:|---|---|",
        line("swap total", ms([r["seconds"] for r in rows]), f"`last_swap.seconds`; configured step delays sum to "
             f"{sum(args.delays.values()) * 1e3:.0f} ms"),
        line("**router: total − Σ phases**", ms([r["router_s"] for r in rows]),
             "scheduler work outside the timed steps (state changes, record, lease grant)", TARGET_ROUTER_MS),
        line("total − Σ configured delays − canary", ms([r["vs_delays_s"] for r in rows]),
             "everything that is not the engine's own step time: HTTP round trips, the gate's scrapes, the router"),
        line("gate phase", ms([r["gate_s"] for r in rows]), "`phases.gate`: two or more /metrics scrapes, the canary, the verdict"),
        line("canary alone (direct)", ms([r["canary_s"] for r in rows]),
             f"the canary body sent straight to the promoted engine (min of 3), {args.canary_tokens} tokens at {TOKEN_RATE:g} tok/s"),
        line("**gate beyond the canary**", ms([r["gate_beyond_s"] for r in rows]), "gate phase − canary alone", TARGET_GATE_MS),
        line("client extra", ms([r["client_extra_s"] for r in rows]),
             "the swapping request's latency − swap total − the same request direct: queue, scheduler wake-up, lease"),
    ]
    step_rows = ["", "| step | configured delay ms | measured median ms | beyond the delay: median | p90 |", "|---|---:|---:|---:|---:|"]
    for s in steps:
        xs = [r["phases"][s] for r in rows if s in r["phases"]]
        d = args.delays.get(s, 0.0)
        beyond = ms([x - d for x in xs])
        step_rows.append(f"| {s} | {d * 1e3:.0f} | {h.percentile(ms(xs), 0.5):.2f} | {h.percentile(beyond, 0.5):.2f} "
                         f"| {h.percentile(beyond, 0.9):.2f} |")
    # From the woken engine's own clock: how long after the previous step's request reached the
    # engine did the next one arrive, beyond that step's delay (= that step's round trip + the router between steps).
    gaps = ["", "Gaps between the router's calls as the woken engine saw them (sim log, one monotonic clock): "
                "arrival of each call − arrival of the previous one − the previous step's delay, median / p90 ms: "]
    parts = []
    order = [*WAKE_STEPS, "generate"]
    for a, b in zip(order, order[1:]):
        xs = ms([r["t_call"][b] - r["t_call"][a] - args.delays.get(a, 0.0) for r in rows if a in r["t_call"] and b in r["t_call"]])
        if xs:
            parts.append(f"{a} → {'canary' if b == 'generate' else b} {h.percentile(xs, 0.5):.2f} / {h.percentile(xs, 0.9):.2f}")
    gaps[-1] += "; ".join(parts) + "."
    verdicts = {r["verdict"] for r in rows}
    head = [
        SECTION, "",
        f"{h.host(started)}, commit {h.git_rev()}. {len(rows)} swaps measured "
        f"(after {args.warmup_swaps} warm-up swaps). Took {elapsed:.0f} s. Load average at start / end: {load_start} / {h.loadavg()}.",
        "", "```", command, "```", "",
        "Two simulated engines (`engines.sim`, each with a draft model, `sleep_level: 2`, `draft_restore: reload`, gate on with its "
        f"defaults) in one group of a real router process, `swap.min_active_s: 0`, sim flags `--sim-boot-s 0 --sim-token-rate {TOKEN_RATE:g}` "
        "and step delays " + ", ".join(f"`{k}={v:g}`" for k, v in args.delays.items()) + ". One request at a time (max_tokens "
        f"{REQUEST['max_tokens']}), alternating the two models, so each request swaps: sleep the awake engine, the "
        f"{len(WAKE_STEPS)}-step Level-2 "
        "wake of the other, the promotion gate. Each swap's `seconds` and `phases` come from GET /admin/status (`last_swap`); "
        f"gate verdicts: {', '.join(sorted(str(v) for v in verdicts))}.",
        "",
    ]
    return "\n".join(head + table + step_rows + gaps) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
