"""The wait for a parked model on a production trace (issue 32): hotswap, the code before, and a
memory-aware LRU router, side by side in one run.

    .venv/bin/python bench/wake_trace.py [--trace bench/traces/servegen-d1-7.jsonl] [--minutes M]
        [--time-scale S] [--arms hotswap,lru,before --ab-src TREE] [--reps N] [--write-docs]

The trace is ServeGen-derived (bench/traces/README.md): bursty per-application arrivals, ten models,
on the roster bench/wake_roster.py writes (two GPUs of 141 GB, every step at an H200 host's cost,
times `--time-scale`).

The arms, each a fresh router (in its own child process, so `before` imports another tree) on
fresh simulated engines (always this tree's `engines.sim`, so every arm meets the same engines):

  hotswap   this tree
  no-ahead  this tree with `swap.wake_ahead: false`, to tell what waking ahead does
  lru       this tree with the victims chosen least recently requested first (bench/replay.py
            `lru_cost`): a memory-aware router that swaps on demand and drains its victim, as
            Ollama and Ray Serve do
  before    `--ab-src`, a checkout of the code before the change measured (its default scheduler)

Client wait = the time to the first token (embeddings: to the answer). A request streams its
trace's output tokens at its model's rate, read to the end (its engine is busy until then); its
wait is the time to its first token's event − the floor (the median of the same for requests to
an awake model before the trace: the proxy's loopback cost). Prompts are short:
the sim does not model prefill, which is the same in every arm. Reported in real seconds (wall ÷
time scale). The roster's time constants are scaled with the trace (`min_active_s`, `max_hold_s`,
`drain_timeout_s`, `queue.max_wait_s`, and the policy's `demand_tau_s`, `reuse_horizon_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import contention  # bench/contention.py: the waiting no policy avoids
import harness as h  # bench/harness.py: the run session, report helpers
from wake_roster import (DRAIN_S, MAX_WAIT_S, MIN_ACTIVE_S, MODELS, PAGE_CACHE_GB_S, TRACE, Req, load_trace, older_tree,
                         policy_keys, roster)
from replay import Failed, at_arrival_times, first_errors, lru_cost, running_router  # bench/replay.py: the in-process router

SECTION = "## The wait for a parked model on a production trace (issue 32)"
ARMS = ("hotswap", "no-ahead", "lru", "before")
CALIBRATION_REQUESTS = 20
WITHIN_S = 2.0
@dataclass
class Result:
    arm: str
    floor_s: float = 0.0  # wall
    waits: dict[int, float] = field(default_factory=dict)  # request -> real seconds to its first token
    errors: list[str] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    wakes: dict[str, int] = field(default_factory=dict)
    wake_s: dict[str, float] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)  # real seconds in each phase, over every wake
    parts: dict[int, dict[str, float]] = field(default_factory=dict)  # request -> its wait's parts (`wait_parts`)
    wall_s: float = 0.0


PARTS = ("held", "drain", "wake", "after")


def wait_parts(sent: float, first: float, spans: list[tuple[float, float, dict[str, float]]]) -> dict[str, float]:
    """Where one request's wait went, wall seconds: `held` before the wake it waited for began (busy engines
    held the room it needed until `max_hold_s`, or another wake on its GPU went first), `drain` (its
    victims' in-flight requests finishing), `wake` (the victims' sleep and the wake's own steps, the gate
    too), `after` (from promotion to its first token). The wake it waited for: the last of its model's
    to end before its first token, if it ended after the request was sent; else it waited for none and
    the whole wait is `after`."""
    ended = [sp for sp in spans if sp[1] <= first + 1e-3]
    if not ended or ended[-1][1] < sent:
        return {"after": first - sent}
    start, end, phases = ended[-1]
    waking = end - max(start, sent)
    drain = min(waking, max(0.0, phases.get("drain", 0.0) - max(0.0, sent - start)))
    return {"held": max(0.0, start - sent), "drain": drain, "wake": waking - drain, "after": max(0.0, first - end)}


async def run_arm(arm: str, trace: list[Req], args: argparse.Namespace, tmp: Path) -> Result:
    """One arm, in this process (the child's side of `run_child`)."""
    import aiohttp

    scale = args.time_scale
    text = roster(h.free_port(), args, tmp, arm)
    (tmp / f"roster-{arm}.yaml").write_text(text)
    deadline = time.monotonic() + args.max_seconds

    def setup(scheduler: Any) -> None:
        if not policy_keys(scale):
            older_tree(scheduler, scale)
        if arm == "lru":
            scheduler.cost = lru_cost(scheduler)

    timeout = aiohttp.ClientTimeout(total=(MAX_WAIT_S + 2 * max(r.tokens for r in trace) / 30) * scale + 60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client, \
            running_router(text, arm, tmp / f"engines-{arm}", deadline, setup) as run:
        res = Result(arm)

        async def send(r: Req) -> tuple[int, float, str]:
            """(status, wall seconds to the first token or the answer, error). A stream is read to its end
            (its engine is busy until then), in large blocks: the bench's own CPU is the engines' too."""
            if r.kind == "embeddings":
                path, body = "/v1/embeddings", {"model": r.model, "input": "Wake"}
            else:
                path, body = "/v1/completions", {"model": r.model, "prompt": "Wake", "max_tokens": r.tokens,
                                                 "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.monotonic()
            try:
                async with client.post(run.base_url + path, json=body) as resp:
                    if resp.status != 200 or r.kind == "embeddings":
                        data = await resp.read()
                        return resp.status, time.monotonic() - t0, "" if resp.status == 200 else data[:200].decode(errors="replace")
                    first = await resp.content.readuntil(b"\n\n")  # the first token's event
                    ttft = time.monotonic() - t0
                    tail = first[-64:]
                    while chunk := await resp.content.read(1 << 16):
                        tail = (tail + chunk)[-64:]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return 0, time.monotonic() - t0, repr(exc)
            if b"[DONE]" not in tail:
                return 0, ttft, f"the stream ended without [DONE]: ...{tail.decode(errors='replace')!r}"
            return 200, ttft, ""

        cal = Req(-1, 0.0, "llama-8b", "chat", 1)
        floors = []
        for _ in range(CALIBRATION_REQUESTS):
            status, lat, err = await send(cal)
            if status != 200:
                raise Failed(f"{arm}: calibration request answered {status}: {err}")
            floors.append(lat)
        run.scheduler.demand = type(run.scheduler.demand)(run.scheduler.demand.tau_s)  # the calibration is not demand
        res.floor_s = h.percentile(floors, 0.5)

        sent: dict[int, tuple[float, float]] = {}  # request -> (sent, first token), time.monotonic()

        async def one(r: Req) -> None:
            at = time.monotonic()
            status, lat, err = await send(r)
            if status != 200:
                res.errors.append(f"#{r.i} {r.model}: {status} {err}")
                return
            res.waits[r.i] = max(0.0, lat - res.floor_s) / scale
            sent[r.i] = (at, at + lat)

        print(f"  {arm}: booted; replaying {len(trace)} requests", flush=True)
        res.lag_s, res.wall_s = await at_arrival_times([(r.t, lambda r=r: one(r)) for r in trace], scale, deadline, arm)
    res.wakes, res.wake_s = run.recorder.wake_kinds(scale)
    res.evictions = dict(run.recorder.evictions)
    res.phase_s = run.recorder.phase_seconds(scale)
    spans = run.recorder.spans()
    for i, wait in res.waits.items():
        if wait > WITHIN_S:
            at, first = sent[i]
            res.parts[i] = {k: v / scale for k, v in wait_parts(at, first, spans.get(trace[i].model, [])).items()}
    return res


def run_child(arm: str, args: argparse.Namespace, tmp: Path) -> Result:
    """Run one arm in a child process whose `router` is the arm's tree."""
    tree = Path(args.ab_src) if arm == "before" else h.REPO
    out = tmp / f"result-{arm}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", arm, "--child-out", str(out), "--child-tmp", str(tmp),
            *args.passthrough]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(h.REPO / "bench")])}
    # Run from this tree: an engine started as `python -m engines.sim` finds its package in the working
    # directory first, and every arm must meet the same simulator.
    proc = subprocess.run(argv, env=env, cwd=str(h.REPO))
    if proc.returncode != 0:
        raise Failed(f"{arm}: the arm's process exited {proc.returncode}; its router log is {tmp / f'router-{arm}.log'}")
    data = json.loads(out.read_text())
    data["waits"] = {int(k): v for k, v in data["waits"].items()}
    data["parts"] = {int(k): v for k, v in data["parts"].items()}
    return Result(**data)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def waits_stats(xs: list[float]) -> dict[str, float]:
    return {"mean": sum(xs) / len(xs) if xs else math.nan, "p50": h.percentile(xs, 0.5), "p90": h.percentile(xs, 0.9),
            "p99": h.percentile(xs, 0.99), "within": sum(1 for x in xs if x <= WITHIN_S) / len(xs) if xs else math.nan}


def summary(xs: list[float], minutes: float, res: Result) -> dict[str, float]:
    """`minutes`: the whole replay's (warm-up too), which every wake of `res` falls in."""
    wakes = sum(res.wakes.get(k, 0) for k in ("level1", "level2"))
    return {**waits_stats(xs), "wakes_min": wakes / minutes}


def pooled(rounds: list[dict[str, Result]], measured: set[int]) -> dict[str, dict[str, float]]:
    """Each arm's waits over every round: in each round, of the requests answered 200 in all its arms."""
    oks = [[i for i in sorted(measured) if all(i in res.waits for res in results.values())] for results in rounds]
    return {a: waits_stats([results[a].waits[i] for results, ok in zip(rounds, oks) for i in ok]) for a in rounds[0]}


def verdict(stats: dict[str, dict[str, float]]) -> str:
    """hotswap's numbers against the issue's targets (and `before` and LRU, where they ran)."""
    hs = stats["hotswap"]
    verdicts = [f"within {WITHIN_S:g} s: {hs['within']:.0%} (target ≥ 90%)", f"p99 {hs['p99']:.1f} s (target ≤ 15 s)"]
    if "before" in stats:
        b = stats["before"]
        verdicts += [f"mean ÷ before {hs['mean'] / b['mean']:.2f}× (target ≤ 0.5×)",
                     f"p99 ÷ before {hs['p99'] / b['p99']:.2f}× (target ≤ 0.6×)"]
    if "lru" in stats:
        lru = stats["lru"]
        worse = [k for k in ("mean", "p50", "p90", "p99") if hs[k] > lru[k] + 0.005]
        verdicts.append("never worse than LRU at mean, p50, p90, p99" if not worse else f"WORSE than LRU at {', '.join(worse)}")
    return "; ".join(verdicts)


def report(rounds: list[dict[str, Result]], header: dict, trace: list[Req], args: argparse.Namespace, started: str,
           elapsed: float, load_start: str) -> str:
    """The section: every table of the first round; with --reps, each round's numbers and the verdict pooled."""
    results = rounds[0]
    start = trace[0].t + args.warmup_minutes * 60
    measured = {r.i for r in trace if r.t >= start}
    ok = {i for i in measured if all(i in res.waits for res in results.values())}
    minutes = (trace[-1].t - start) / 60
    span = (trace[-1].t - trace[0].t) / 60
    stats = {a: summary([res.waits[i] for i in ok], span, res) for a, res in results.items()}
    lines = [
        SECTION, "",
        f"{h.host(started)}, commit {h.git_rev()}. Took {elapsed:.0f} s. Load average at start / end: "
        f"{load_start} / {h.loadavg()}.", "", "```", h.command_line(), "```", "",
        f"Trace: `{args.trace.relative_to(h.REPO) if args.trace.is_relative_to(h.REPO) else args.trace}` "
        f"({header.get('source', '?')}, commit {str(header.get('commit', '?'))[:7]}, days {header.get('days')}), "
        f"{len(trace)} requests; the first {args.warmup_minutes:g} minutes replayed but not counted, "
        f"{len(measured)} requests over {minutes:.1f} minutes measured; time scale {args.time_scale:g}. "
        f"Waits are real seconds to the first token (embeddings: to the answer), over the {len(ok)} requests "
        "answered 200 in every arm. Floor (wall): " + ", ".join(f"{a} {r.floor_s * 1e3:.1f} ms" for a, r in results.items()) + ".",
        "", "| model | GPUs | share | weights GB | L1 sleep / wake s | L2 wake s, staged / cold | boot s | tok/s | requests |",
        "|---|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for m in MODELS.values():
        st = m.steps()
        rest = st["wake_weights"] + st["wake_kv_cache"] + (st["reload_draft"] if m.kind == "chat" else 0)
        n = sum(1 for r in trace if r.model == m.name and r.i in measured)
        lines.append(f"| {m.name} | {','.join(map(str, m.devices))} | {m.share:g} | {m.weights_gb:g} | "
                     f"{st['sleep_level1']:.2f} / {st['wake']:.2f} | {rest + m.reload_s(PAGE_CACHE_GB_S):.1f} / "
                     f"{rest + m.reload_s(args.disk_gb_per_s):.1f} | {m.boot_s(args.disk_gb_per_s):.0f} | {m.tok_s:g} | {n} |")
    lines += [
        "", f"Host RAM budget {args.ram_budget_gb:g} GB (`sleep_level: auto`); a page cache of {args.page_cache_gb:g} GB "
        f"(`host.page_cache_budget_gb` {args.page_cache_budget_gb:g} where the arm's tree has it); disk "
        f"{args.disk_gb_per_s:g} GB/s cold; `min_active_s` {MIN_ACTIVE_S:g}, `max_hold_s` {args.max_hold_s:g}, "
        f"`drain_timeout_s` {DRAIN_S:g}; the gate on (its canary after every wake; the embedder's off).", "",
        f"| arm | mean s | p50 s | p90 s | p99 s | within {WITHIN_S:g} s | wakes/min | wakes L1 / L2 / boot | parks | "
        "demotions | stops | errors | send lag p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for a, res in results.items():
        s, w, ev = stats[a], res.wakes, res.evictions
        parks = sum(v for k, v in ev.items() if k not in ("demote", "stop"))
        lines.append(f"| {a} | {s['mean']:.2f} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.1f} | {s['within']:.0%} | "
                     f"{s['wakes_min']:.1f} | {w.get('level1', 0)} / {w.get('level2', 0)} / {w.get('boot', 0)} | {parks} | "
                     f"{ev.get('demote', 0)} | {ev.get('stop', 0)} | {len(res.errors)} | "
                     f"{h.percentile(res.lag_s, 0.99) * 1e3 / args.time_scale:.0f} |")
    verdict_stats = stats
    if len(rounds) > 1:
        verdict_stats = pooled(rounds, measured)
        lines += ["", f"That is round 1 of {len(rounds)} (`--reps`; each round runs the arms in a rotated order, as the "
                  "machine drifts; every table below is round 1's). Each round's mean / p90 / p99 / within "
                  f"{WITHIN_S:g} s, and all rounds pooled:", "",
                  "| arm | " + " | ".join(f"round {k + 1}" for k in range(len(rounds))) + " | pooled |",
                  "|---|" + "---|" * (len(rounds) + 1)]
        per_round = [pooled([r], measured) for r in rounds]
        for a in results:
            cells = [r[a] for r in per_round] + [verdict_stats[a]]
            lines.append(f"| {a} | " + " | ".join(f"{c['mean']:.2f} / {c['p90']:.1f} / {c['p99']:.1f} / {c['within']:.0%}"
                                                  for c in cells) + " |")
    if "hotswap" in verdict_stats:
        lines += ["", f"**hotswap{' (pooled)' if len(rounds) > 1 else ''}: {verdict(verdict_stats)}.**"]
    phases = sorted({p for res in results.values() for p in res.phase_s}, key=lambda p: -max(r.phase_s.get(p, 0) for r in results.values()))
    lines += ["", "Where the wakes' time went: real seconds per wake in each phase (the victims' drain and sleep included), "
              "over every successful wake or boot of the replay:", "",
              "| arm | wakes | " + " | ".join(phases) + " |", "|---|---:|" + "---:|" * len(phases)]
    for a, res in results.items():
        n = max(1, sum(res.wakes.values()))
        lines.append(f"| {a} | {sum(res.wakes.values())} | " + " | ".join(f"{res.phase_s.get(p, 0) / n:.2f}" for p in phases) + " |")
    lines += ["", f"Where the waits over {WITHIN_S:g} s went (`wait_parts`): mean real seconds per such request, of the "
              "requests counted above: `held` before the wake it waited for began (busy engines kept the room until "
              "`max_hold_s`, or another wake on its GPU went first), `drain` (its victims' requests finishing), `wake` "
              "(the victims' sleep and the wake's steps, the gate included), `after` (promotion to its first token; "
              "all of a wait that no wake of its model ended in):", "",
              f"| arm | waits over {WITHIN_S:g} s | mean s | " + " | ".join(PARTS) + " |", "|---|---:|---:|" + "---:|" * len(PARTS)]
    for a, res in results.items():
        long = [i for i in ok if i in res.parts]
        n = max(1, len(long))
        means = [sum(res.parts[i].get(p, 0.0) for i in long) / n for p in PARTS]
        lines.append(f"| {a} | {len(long)} | {sum(res.waits[i] for i in long) / n:.1f} | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    stuck = contention.blocked(trace, MODELS, sorted(ok))
    clear = sorted(b.clear_s for b in stuck)
    if stuck:
        lines += ["", f"What no policy avoids (`bench/contention.py`): {len(stuck)} of these {len(ok)} requests "
                  f"({len(stuck) / len(ok):.1%}) arrive while other models' streams on their GPU (at the trace's own "
                  "lengths, nobody waiting) leave no room for their model's share: each of them, or one of those "
                  f"streams (cut, or its model's next request waiting for a wake), waits; the streams end in median "
                  f"{h.percentile(clear, 0.5):.1f} s, p90 {h.percentile(clear, 0.9):.1f} s, before any wake. By GPU: "
                  + ", ".join(f"{d}: {sum(1 for b in stuck if d in MODELS[trace[b.request].model].devices)}"
                              for d in sorted({d for m in MODELS.values() for d in m.devices})) + "."]
    lines += ["", "Mean wait per model (s):", "", "| model | requests | " + " | ".join(results) + " |",
              "|---|---:|" + "---:|" * len(results)]
    for name in MODELS:
        ids = [i for i in ok if trace[i].model == name]
        cells = [f"{sum(res.waits[i] for i in ids) / len(ids):.2f}" if ids else "-" for res in results.values()]
        lines.append(f"| {name} | {len(ids)} | " + " | ".join(cells) + " |")
    return "\n".join(lines + first_errors([res.errors for res in results.values()])) + "\n"


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="a JSON-lines trace (default %(default)s)")
    p.add_argument("--minutes", type=float, default=None, help="replay only the trace's first MINUTES (a quick look)")
    p.add_argument("--warmup-minutes", type=float, default=2.0,
                   help="the trace's first minutes are replayed but not counted: the router's demand estimate starts "
                        "empty, as no running router's does (default %(default)s)")
    p.add_argument("--time-scale", type=float, default=0.1, help="wall seconds per real second (default %(default)s)")
    p.add_argument("--ram-budget-gb", type=float, default=64.0,
                   help="host.ram_budget_gb (default %(default)s: fewer than the sleepers' weights, so many park at Level 2 "
                        "and the disk, the page cache and staging are in the wait)")
    p.add_argument("--max-hold-s", type=float, default=30.0,
                   help="swap.max_hold_s, real seconds: how long a waiter lets busy engines keep the room (default 30)")
    p.add_argument("--disk-gb-per-s", type=float, default=2.0, help="a cold read from disk (default %(default)s)")
    p.add_argument("--page-cache-gb", type=float, default=128.0,
                   help="the host's page cache: the sims evict the least recently read checkpoint past it (default %(default)s)")
    p.add_argument("--page-cache-budget-gb", type=float, default=96.0,
                   help="host.page_cache_budget_gb: what the router may stage ahead (default %(default)s)")
    p.add_argument("--arms", default="hotswap,lru", help=f"comma-separated, of {', '.join(ARMS)} (default %(default)s)")
    p.add_argument("--reps", type=int, default=1, help="run the arms this many rounds, each in a rotated order, and "
                   "pool their waits for the verdict (default 1)")
    p.add_argument("--ab-src", default=None, help="the tree the `before` arm runs (a checkout of the code before)")
    p.add_argument("--max-seconds", type=float, default=900.0, help="cap on each arm's run, wall (default %(default)s)")
    p.add_argument("--write-docs", action="store_true", help="write the section into --docs (default: print only)")
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-tmp", type=Path, help=argparse.SUPPRESS)
    h.add_session_args(p)
    a = p.parse_args(argv)
    a.trace = a.trace.resolve()
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not a.arms or not set(a.arms) <= set(ARMS):
        p.error(f"--arms: choose from {', '.join(ARMS)}")
    if "before" in a.arms and not (a.ab_src and (Path(a.ab_src) / "router").is_dir()):
        p.error("--arms before needs --ab-src, a tree with router/ in it (e.g. `git worktree add /tmp/before <commit>`)")
    if not 0 < a.time_scale <= 1:
        p.error("--time-scale must be in (0, 1]")
    a.no_docs = a.no_docs or not a.write_docs
    # What a child gets again: everything but the arms, the docs and the session's own flags.
    a.passthrough = ["--trace", str(a.trace), "--time-scale", f"{a.time_scale!r}", "--ram-budget-gb", f"{a.ram_budget_gb!r}",
                     "--disk-gb-per-s", f"{a.disk_gb_per_s!r}", "--page-cache-gb", f"{a.page_cache_gb!r}",
                     "--page-cache-budget-gb", f"{a.page_cache_budget_gb!r}", "--max-seconds", f"{a.max_seconds!r}",
                     "--max-hold-s", f"{a.max_hold_s!r}", "--no-docs"]
    if a.reps < 1:
        p.error("--reps must be at least 1")
    if a.minutes is not None and a.minutes <= a.warmup_minutes:
        p.error("--minutes must be more than --warmup-minutes")
    if a.minutes is not None:
        a.passthrough += ["--minutes", f"{a.minutes!r}"]
    return a


def child_main(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        filename=str(args.child_tmp / f"router-{args.child}.log"))
    _, trace = load_trace(args.trace, args.minutes)
    try:
        res = uvloop.run(run_arm(args.child, trace, args, args.child_tmp))
    except Failed as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    args.child_out.write_text(json.dumps(asdict(res)))
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    header, trace = load_trace(args.trace, args.minutes)
    with h.session(args, "hotswap-wakebench-") as run:
        span = trace[-1].t - trace[0].t
        print(f"bench: {len(trace)} requests over {span:.0f} s real = {span * args.time_scale:.0f} s wall per arm; "
              f"arms {', '.join(args.arms)}; logs in {run.tmp}", flush=True)
        rounds: list[dict[str, Result]] = []
        try:
            for k in range(args.reps):
                order = args.arms[k % len(args.arms):] + args.arms[:k % len(args.arms)]
                tmp = run.tmp if args.reps == 1 else run.tmp / f"round-{k + 1}"
                tmp.mkdir(exist_ok=True)
                results = {}
                for arm in order:
                    print(f"bench: {arm}" + (f" (round {k + 1} of {args.reps})" if args.reps > 1 else ""), flush=True)
                    results[arm] = run_child(arm, args, tmp)
                    start = trace[0].t + args.warmup_minutes * 60
                    counted = [w for i, w in results[arm].waits.items() if trace[i].t >= start]
                    s = summary(counted, span / 60, results[arm])
                    print(f"  {arm}: mean {s['mean']:.2f} s, p50 {s['p50']:.2f}, p90 {s['p90']:.2f}, p99 {s['p99']:.1f}, "
                          f"within {WITHIN_S:g} s {s['within']:.0%}, {len(results[arm].errors)} errors", flush=True)
                rounds.append({arm: results[arm] for arm in args.arms})
        except Failed as exc:
            keep = "" if args.keep_logs else " (they are removed on exit: run with --keep-logs to read them)"
            print(f"bench: {exc}{keep}", file=sys.stderr)
            return 1
        text = report(rounds, header, trace, args, run.started, time.monotonic() - run.t0, run.load_start)
        run.publish(text, SECTION)
        return 0
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
