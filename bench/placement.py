"""Placement policies (issue 12): one skewed trace, three ways of choosing what to park.

    .venv/bin/python bench/placement.py [--requests N] [--rate R] [--time-scale S] [--seed N] [--write-docs]

Six simulated engines (`engines.sim`, real processes, the GPU memory oracle on) sized like an
H200 mix on one 141 GB GPU (`MODELS`), with a host-RAM budget (`--ram-budget-gb`) that holds some
of them at Level 1 but not all. Every step the router drives takes what it takes on a real GPU
(the measured floors below, scaled by each model's weights), times `--time-scale`.

One trace (`--seed`): Poisson arrivals at `--rate` requests per second of real time, each for a
model drawn from a zipf(`--zipf`) over `--popularity`, each decoding a known number of tokens at
the model's real decode rate (time-scaled), so the engine's own generation time is known. The
same trace is replayed against a fresh router and fresh engines for each policy:

  group      one-awake-per-group (the behaviour before placement): every model in one `group`
  lru        placement by memory, victims least recently requested first: a bench-local cost
             function (2**recency rank, so the cheapest set is the LRU prefix that makes room)
             set as the scheduler's `cost`
  cost-aware placement by memory, the default `Scheduler.expected_cost`

The router runs in this process (bench/replay.py), so its scheduler's cost function can be swapped.
The roster's time constants are scaled by `--time-scale` as well, so the policy sees the trace as it
would in real time.

Client wait = request latency - the engine's own generation time (tokens / decode rate) - the
floor (the median of the same for 20 requests to an already awake model before the trace: the
proxy's loopback cost). Reported in real-time seconds (wall seconds / time scale). The first
`--warmup` requests of the trace are replayed but not counted. Printed as markdown; with
`--write-docs` written to docs/benchmarks.md under "Placement policies: the last generated run".

To A/B a scheduler change, copy `router/` (and `engines/`, `config/`) somewhere, patch the copy
and run with `PYTHONPATH=/path/to/copy`: the in-process router and the engines import it first.
Every engine is stopped on exit, Ctrl-C or SIGTERM (the router stops them; `engines.process.reaper`
takes them down if this process dies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h  # bench/harness.py: the run session, processes, report helpers
from replay import Failed, at_arrival_times, first_errors, lru_cost, running_router  # bench/replay.py: the in-process router

SECTION = "## Placement policies: the last generated run"
POLICIES = ("group", "lru", "cost-aware")
GPU_GB = 141.0

# Measured floors on an H200 (issue 12), in real seconds.
L1_GB_PER_S = 27 / 0.5  # Level 1: weights back from pinned host RAM
L2_S_PER_GB = 4.5 / 27  # Level 2: reload from page cache
BOOT_FIXED_S = 15.0  # cold boot beyond loading the weights: 27 GB -> 19.5 s
SLEEP_S = 0.3
# The scheduler's and the roster's time constants (real seconds), scaled like the trace.
MIN_ACTIVE_S, MAX_HOLD_S, MAX_WAIT_S, DRAIN_S = 5.0, 30.0, 300.0, 30.0
DEMAND_TAU_S, REUSE_HORIZON_S = 300.0, 60.0  # the roster's defaults
CALIBRATION_REQUESTS = 20


@dataclass(frozen=True)
class Model:
    name: str
    share: float  # --gpu-memory-utilization
    weights_gb: float
    tok_s: float  # real decode tokens/s
    tokens: tuple[int, int]  # a request decodes uniformly this many (inclusive)

    @property
    def l1_s(self) -> float:
        return self.weights_gb / L1_GB_PER_S

    @property
    def l2_s(self) -> float:
        return self.weights_gb * L2_S_PER_GB

    @property
    def boot_s(self) -> float:
        return BOOT_FIXED_S + self.l2_s


MODELS = {m.name: m for m in (
    Model("llama-70b", 0.60, 140, 25, (16, 128)),
    Model("qwen-32b", 0.35, 64, 40, (16, 128)),
    Model("chat-8b", 0.25, 16, 80, (16, 128)),
    Model("code-8b", 0.25, 16, 80, (16, 128)),
    Model("embed", 0.05, 1, 50, (1, 1)),  # one "token": ~20 ms of real work
    Model("rerank", 0.05, 1, 50, (1, 1)),
)}
DEFAULT_POPULARITY = "chat-8b,embed,llama-70b,qwen-32b,rerank,code-8b"


@dataclass(frozen=True)
class Req:
    i: int
    t: float  # real seconds from the start
    model: str
    tokens: int


def make_trace(seed: int, n: int, rate: float, popularity: list[str], zipf_s: float) -> list[Req]:
    rng = random.Random(seed)
    weights = [1 / (k ** zipf_s) for k in range(1, len(popularity) + 1)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        m = MODELS[rng.choices(popularity, weights)[0]]
        out.append(Req(i, t, m.name, rng.randint(*m.tokens)))
    return out


def step_delays(m: Model, scale: float) -> dict[str, float]:
    """The sim's step delays (wall seconds) for model `m`."""
    return {"sleep": SLEEP_S * scale, "wake": m.l1_s * scale,
            "wake_weights": 0.05 * m.l2_s * scale, "reload_weights": 0.9 * m.l2_s * scale,
            "wake_kv_cache": 0.05 * m.l2_s * scale}


def roster(policy: str, port: int, scale: float, budget_gb: float, ledger: Path, default: str) -> str:
    env = {"HOTSWAP_SIM_GPU_LEDGER": str(ledger), "HOTSWAP_SIM_GPU_MEMORY_GB": f"0={GPU_GB:g}"}
    lines = [
        f"# written by bench/placement.py ({policy})",
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        f"swap: {{min_active_s: {MIN_ACTIVE_S * scale:g}, max_hold_s: {MAX_HOLD_S * scale:g}, "
        f"drain_timeout_s: {DRAIN_S * scale:g}, demand_tau_s: {DEMAND_TAU_S * scale:g}, "
        f"reuse_horizon_s: {REUSE_HORIZON_S * scale:g}}}",
        f"queue: {{max_wait_s: {MAX_WAIT_S * scale:g}}}",
        f"gpus: [{{index: 0, memory_gb: {GPU_GB:g}}}]",
        f"host: {{ram_budget_gb: {budget_gb:g}}}",
        "defaults:",
        "  launcher: [python, -m, engines.sim, serve]",
        "  gate: {enabled: false}",
        f"  env: {json.dumps(env)}",
    ]
    if policy == "group":
        lines.append("  group: one")
    lines.append("models:")
    for m in MODELS.values():
        args = ["--gpu-memory-utilization", f"{m.share:g}", "--sim-boot-s", f"{m.boot_s * scale:.4f}",
                "--sim-token-rate", f"{m.tok_s / scale:g}"]
        for step, s in step_delays(m, scale).items():
            args += ["--sim-step-delay", f"{step}={s:.4f}"]
        lines += [f"  - name: {m.name}", f"    model: bench/{m.name}", f"    weights_gb: {m.weights_gb:g}",
                  f"    args: {json.dumps(args)}"]
        if m.name == default:
            lines.append("    default: true")
    return "\n".join(lines) + "\n"


@dataclass
class Result:
    policy: str
    floor_s: float  # wall
    waits: dict[int, float] = field(default_factory=dict)  # request -> real seconds beyond generation and floor
    hits: dict[int, bool] = field(default_factory=dict)  # its model was awake and free when it was sent
    errors: list[str] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)  # how late each request was sent (wall)
    wakes: dict[str, int] = field(default_factory=dict)  # level1 / level2 / boot
    wake_s: dict[str, float] = field(default_factory=dict)  # real seconds, the same keys
    evictions: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


async def run_policy(policy: str, trace: list[Req], args: argparse.Namespace, tmp: Path) -> Result:
    import aiohttp

    from engines.engine import State

    scale = args.time_scale
    port = h.free_port()
    default = args.popularity[0]
    text = roster(policy, port, scale, args.ram_budget_gb, tmp / f"ledger-{policy}.json", default)
    (tmp / f"roster-{policy}.yaml").write_text(text)
    deadline = time.monotonic() + args.max_seconds

    def setup(scheduler: Any) -> None:
        if policy == "lru":
            scheduler.cost = lru_cost(scheduler)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=MAX_WAIT_S * scale + 60)) as client, \
            running_router(text, f"placement {policy}", tmp / f"engines-{policy}", deadline, setup) as run:
        router, scheduler, recorder = run.router, run.scheduler, run.recorder
        url = f"{run.base_url}/v1/completions"
        awake = [e.name for e in router.engines.values() if e.state is State.AWAKE]
        print(f"  {policy}: booted; awake: {', '.join(awake)}", flush=True)

        async def send(r: Req) -> tuple[int, float, str]:
            body = {"model": r.model, "prompt": "Place", "max_tokens": r.tokens, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            try:
                async with client.post(url, json=body) as resp:
                    data = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return 0, time.perf_counter() - t0, repr(exc)
            return status, time.perf_counter() - t0, "" if status == 200 else data[:200].decode(errors="replace")

        def generation_s(r: Req) -> float:  # wall
            return r.tokens / (MODELS[r.model].tok_s / scale)

        # The floor: an awake model's request through the router (then forget that demand).
        cal = Req(-1, 0.0, default, 1)
        floors = []
        for _ in range(CALIBRATION_REQUESTS):
            status, lat, err = await send(cal)
            if status != 200:
                raise Failed(f"{policy}: calibration request answered {status}: {err}")
            floors.append(lat - generation_s(cal))
        scheduler.demand = type(scheduler.demand)(scheduler.demand.tau_s)  # the calibration is not demand
        res = Result(policy, h.percentile(floors, 0.5))

        async def one(r: Req) -> None:
            engine = router.engines[r.model]
            res.hits[r.i] = engine.state is State.AWAKE and engine.name not in scheduler.busy
            status, lat, err = await send(r)
            if status != 200:
                res.errors.append(f"#{r.i} {r.model}: {status} {err}")
                return
            res.waits[r.i] = (lat - generation_s(r) - res.floor_s) / scale

        res.lag_s, res.wall_s = await at_arrival_times([(r.t, lambda r=r: one(r)) for r in trace], scale, deadline,
                                                       policy, progress=100)
    res.wakes, res.wake_s = recorder.wake_kinds(args.time_scale)
    res.evictions = dict(recorder.evictions)
    return res


# -- report ----------------------------------------------------------------------------------------

def stats(res: Result, ids: set[int]) -> tuple[float, float, int]:
    xs = [res.waits[i] for i in ids if i in res.waits]
    return (sum(xs) / len(xs) if xs else math.nan), h.percentile(xs, 0.99), len(xs)


def report(results: dict[str, Result], trace: list[Req], args: argparse.Namespace, started: str, elapsed: float,
           load_start: str) -> str:
    measured = {r.i for r in trace[args.warmup:]}
    ok_everywhere = {i for i in measured if all(i in res.waits for res in results.values())}
    summary = {p: stats(res, ok_everywhere) for p, res in results.items()}
    ca_mean = summary["cost-aware"][0]
    lines = [
        SECTION, "",
        f"{h.host(started)}, {h.client_versions()}, commit {h.git_rev()}. Took {elapsed:.0f} s. "
        f"Load average at start / end: {load_start} / {h.loadavg()}.",
        "", "```", h.command_line(), "```", "",
        f"Trace: {len(trace)} requests (seed {args.seed}), Poisson arrivals at {args.rate:g}/s over "
        f"{trace[-1].t:.0f} s of real time, models drawn zipf(s={args.zipf:g}) by popularity "
        f"{' > '.join(args.popularity)}; the first {args.warmup} are replayed but not counted. "
        f"Time scale {args.time_scale:g} (every delay, decode rate and scheduler constant; one replay "
        f"took about {max(r.wall_s for r in results.values()):.0f} s of wall time). Waits are in real-time seconds: "
        "latency − the engine's own generation − the floor (the median of that for an awake model before the trace: "
        + ", ".join(f"{p} {res.floor_s * 1e3:.1f} ms wall" for p, res in results.items()) + "). "
        f"{len(ok_everywhere)} requests answered 200 under every policy are compared.",
        "",
        "| model | share | weights GB | Level-1 wake s | Level-2 wake s | cold boot s | decode tok/s | requests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    count = {n: sum(1 for i in measured if trace[i].model == n) for n in MODELS}
    for m in MODELS.values():
        lines.append(f"| {m.name} | {m.share:g} | {m.weights_gb:g} | {m.l1_s:.2f} | {m.l2_s:.2f} | {m.boot_s:.1f} | "
                     f"{m.tok_s:g} | {count[m.name]} |")
    lines += [
        "",
        f"One GPU of {GPU_GB:g} GB, `sleep_residual_gb` 1 per sleeper, host-RAM budget {args.ram_budget_gb:g} GB "
        "(`sleep_level: auto`), gate off (no drafts), sleep 0.3 s, `min_active_s` 5, `max_hold_s` 30, "
        "`queue.max_wait_s` 300 (real seconds). The sim's GPU memory oracle is on: an accounting error would "
        "fail a boot or wake (none did unless errors say so).",
        "",
        "| policy | mean wait s | p99 wait s | mean ÷ cost-aware | found model awake | wakes L1 / L2 / boot | "
        "their seconds | parks | demotions | stops | errors |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for p, res in results.items():
        mean, p99, _ = summary[p]
        hit = sum(1 for i in measured if res.hits.get(i)) / len(measured)
        w, ev = res.wakes, res.evictions
        parks = sum(v for k, v in ev.items() if k not in ("demote", "stop"))
        lines.append(f"| {p} | {mean:.2f} | {p99:.1f} | {mean / ca_mean:.2f}× | {hit:.0%} | "
                     f"{w.get('level1', 0)} / {w.get('level2', 0)} / {w.get('boot', 0)} | "
                     f"{res.wake_s.get('level1', 0):.0f} / {res.wake_s.get('level2', 0):.0f} / {res.wake_s.get('boot', 0):.0f} | {parks} | "
                     f"{ev.get('demote', 0)} | {ev.get('stop', 0)} | {len(res.errors)} |")
    lru_mean = summary["lru"][0]
    group_mean = summary["group"][0]
    verdict = "beats" if ca_mean < lru_mean else "does NOT beat"
    lines += [
        "",
        f"**Cost-aware {verdict} LRU on mean wait: {ca_mean:.2f} s vs {lru_mean:.2f} s, "
        f"{(1 - ca_mean / lru_mean) * 100:+.0f}% ({lru_mean / ca_mean:.2f}× less wait)"
        if ca_mean < lru_mean else
        f"**Cost-aware {verdict} LRU on mean wait: {ca_mean:.2f} s vs {lru_mean:.2f} s "
        f"({ca_mean / lru_mean:.2f}× LRU's wait)",
    ]
    lines[-1] += (f"; one-awake-per-group waits {group_mean / ca_mean:.2f}× as long as cost-aware and "
                  f"{group_mean / lru_mean:.2f}× as long as LRU. p99: cost-aware ÷ LRU "
                  f"{summary['cost-aware'][1] / summary['lru'][1]:.2f}×, cost-aware ÷ group "
                  f"{summary['cost-aware'][1] / summary['group'][1]:.2f}×.**")
    # Where cost-aware loses: per model, and request by request against LRU.
    lines += ["", "Mean wait per model (s), and the share of all waiting each model's requests account for:", "",
              "| model | requests | " + " | ".join(POLICIES) + " | cost-aware ÷ LRU |",
              "|---|---:|" + "---:|" * len(POLICIES) + "---:|"]
    for name in MODELS:
        ids = {i for i in ok_everywhere if trace[i].model == name}
        cells = []
        for p in POLICIES:
            mean = stats(results[p], ids)[0]
            total = sum(results[p].waits[i] for i in ok_everywhere)
            share = sum(results[p].waits[i] for i in ids) / total if total else math.nan
            cells.append(f"{mean:.2f} ({share:.0%})")
        ca, lru = stats(results["cost-aware"], ids)[0], stats(results["lru"], ids)[0]
        ratio = f"{ca / lru:.2f}×" if lru > 0.005 else "-"
        lines.append(f"| {name} | {len(ids)} | " + " | ".join(cells) + f" | {ratio} |")
    worse = [i for i in ok_everywhere if results["cost-aware"].waits[i] > results["lru"].waits[i] + 0.5]
    better = [i for i in ok_everywhere if results["lru"].waits[i] > results["cost-aware"].waits[i] + 0.5]
    by_model = {}
    for i in worse:
        by_model[trace[i].model] = by_model.get(trace[i].model, 0) + 1
    lines += [
        "",
        f"Request by request against LRU (same trace): cost-aware waited > 0.5 s longer on {len(worse)} requests "
        f"({', '.join(f'{n} {c}' for n, c in sorted(by_model.items(), key=lambda kv: -kv[1])) or 'none'}), "
        f"> 0.5 s shorter on {len(better)}. Send lag (the replay's own lateness, wall): p99 "
        + ", ".join(f"{p} {h.percentile(res.lag_s, 0.99) * 1e3:.1f} ms" for p, res in results.items()) + ".",
    ]
    return "\n".join(lines + first_errors([res.errors for res in results.values()])) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500, help="requests in the trace (default %(default)s)")
    p.add_argument("--warmup", type=int, default=50, help="first requests not counted (default %(default)s)")
    p.add_argument("--rate", type=float, default=0.5, help="arrivals per second of real time (default %(default)s)")
    p.add_argument("--zipf", type=float, default=1.0, help="zipf exponent over --popularity (default %(default)s)")
    p.add_argument("--popularity", default=DEFAULT_POPULARITY,
                   help="models, most requested first; the first is the roster's default (default %(default)s)")
    p.add_argument("--ram-budget-gb", type=float, default=160.0, help="host.ram_budget_gb (default %(default)s)")
    p.add_argument("--time-scale", type=float, default=0.05, help="wall seconds per real second (default %(default)s)")
    p.add_argument("--seed", type=int, default=12, help="the trace's seed (default %(default)s)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset, for a quick look "
                   "(the report needs all three; default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=600.0, help="cap on each policy's run, wall (default %(default)s)")
    p.add_argument("--write-docs", action="store_true", help="write the section into --docs (default: print only)")
    h.add_session_args(p)
    # The smoke: every policy and the report, on a trace of a few requests in hundredths of real time.
    a = h.parse(p, argv, smoke=dict(requests=12, warmup=2, time_scale=0.01, max_seconds=60.0))
    a.popularity = [x.strip() for x in a.popularity.split(",")]
    if sorted(a.popularity) != sorted(MODELS):
        p.error(f"--popularity must name each of {', '.join(MODELS)} once")
    a.policies = [x.strip() for x in a.policies.split(",")]
    if not set(a.policies) <= set(POLICIES):
        p.error(f"--policies: choose from {', '.join(POLICIES)}")
    if not 0 < a.time_scale <= 1:
        p.error("--time-scale must be in (0, 1]")
    if not 0 <= a.warmup < a.requests:
        p.error("--warmup must be below --requests")
    a.no_docs = a.no_docs or not a.write_docs
    return a


def summary_line(res: Result, measured: set[int]) -> str:
    mean, p99, n = stats(res, measured)
    return (f"  {res.policy}: mean wait {mean:.2f} s, p99 {p99:.1f} s over {n} requests; wakes {res.wakes}; "
            f"in cold boots {res.wake_s.get('boot', 0.0):.0f} s; evictions {res.evictions}; {len(res.errors)} errors; floor {res.floor_s * 1e3:.1f} ms wall")


async def run_all(trace: list[Req], args: argparse.Namespace, tmp: Path) -> dict[str, Result]:
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # cancel: the routers stop their engines on the way out
        loop.add_signal_handler(sig, main.cancel)
    results = {}
    measured = {r.i for r in trace[args.warmup:]}
    for policy in args.policies:
        print(f"bench: {policy}: replaying {len(trace)} requests", flush=True)
        results[policy] = await run_policy(policy, trace, args, tmp)
        print(summary_line(results[policy], measured), flush=True)
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    trace = make_trace(args.seed, args.requests, args.rate, args.popularity, args.zipf)
    with h.session(args, "hotswap-placementbench-") as run:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                            filename=str(run.tmp / "router.log"))
        print(f"bench: {len(trace)} requests over {trace[-1].t:.0f} s real = {trace[-1].t * args.time_scale:.0f} s wall "
              f"per policy; router logs in {run.tmp}", flush=True)
        import uvloop

        try:
            results = uvloop.run(run_all(trace, args, run.tmp))
        except asyncio.CancelledError:
            print("bench: interrupted; engines stopped", file=sys.stderr)
            return 130
        except Failed as exc:
            keep = "" if args.keep_logs else " (they are removed on exit: run with --keep-logs to read them)"
            print(f"bench: {exc}{keep}", file=sys.stderr)
            return 1
        if set(results) != set(POLICIES):
            return 0
        text = report(results, trace, args, run.started, time.monotonic() - run.t0, run.load_start)
        run.publish(text, SECTION)
        return 0
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
