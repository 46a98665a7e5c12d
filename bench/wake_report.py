"""The wake-latency trace bench's report (bench/wake_trace.py): each arm's waits against the issue's
targets, where the wakes' and the waits' time went, and what no policy avoids (bench/contention.py)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import contention  # bench/contention.py: the waiting no policy avoids
import harness as h  # bench/harness.py: report helpers
from replay import first_errors
from wake_roster import MIN_ACTIVE_S, MODELS, PAGE_CACHE_GB_S, Req

SECTION = "## The production trace: the last generated run"
BATCH_SECTION = "## The batch arm: the last generated run"
# Not "Engines killed at random during the production trace": that section is written by hand, from several runs.
CHAOS_SECTION = "## The chaos arm: the last generated run"
STREAM_CUT = "the stream was cut"  # how bench/wake_trace.py's client reports a stream it saw cut, in Result.errors


def section(arms: list[str]) -> str:
    """The docs section a run writes: the batch arm's against hotswap alone is issue 33's measurement, the chaos arm's issue 55's."""
    if "chaos" in arms:
        return CHAOS_SECTION
    return BATCH_SECTION if set(arms) == {"hotswap", "batch"} else SECTION
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
    batch_job_s: float = 0.0  # real seconds from the batch job's first request sent to its last answer
    batch_wakes: int = 0  # wakes for batch requests alone (wake_trace.batch_harm)
    batch_harmed: list[int] = field(default_factory=list)  # interactive requests those wakes made wait
    # The chaos arm's: seed, every_s, kills [(trace s, model, in flight)], resumed and cut {reason: n}, the pauses'
    # histogram (pause_buckets {le: cumulative}, pause_sum, wall seconds), batch [answered, asked].
    chaos: dict = field(default_factory=dict)


PARTS = ("held", "drain", "wake", "after")


def bucket_quantile(buckets: dict[str, int], q: float) -> float:
    """A quantile of a Prometheus histogram's cumulative buckets, interpolated within its bucket as PromQL's
    histogram_quantile does (nan without observations; the highest finite bound past it)."""
    bounds = sorted((float(le), n) for le, n in buckets.items())
    total = bounds[-1][1] if bounds else 0
    if not total:
        return math.nan
    rank, below, lower = q * total, 0, 0.0
    for upper, n in bounds:
        if n >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * ((rank - below) / (n - below) if n > below else 1.0)
        below, lower = n, upper
    return lower


def chaos_counts(res: Result) -> dict[str, Any]:
    """The chaos arm's numbers: kills, resumed and cut, pauses (real seconds), and what its client saw cut or refused."""
    c, scale_s = res.chaos, res.chaos.get("time_scale", 1.0)
    kills = c.get("kills", [])
    pauses = sum(c.get("resumed", {}).values())
    streams = [e for e in res.errors if STREAM_CUT in e]
    return {"kills": len(kills), "by_model": {m: sum(1 for k in kills if k[1] == m) for m in sorted({k[1] for k in kills})},
            "in_flight": sum(k[2] for k in kills), "resumed": c.get("resumed", {}), "cut": c.get("cut", {}),
            "p50": bucket_quantile(c.get("pause_buckets", {}), 0.5) / scale_s,
            "p99": bucket_quantile(c.get("pause_buckets", {}), 0.99) / scale_s,
            "mean": c.get("pause_sum", 0.0) / pauses / scale_s if pauses else math.nan,
            "streams_cut": len(streams), "refused": len(res.errors) - len(streams), "batch": c.get("batch", [0, 0])}


def chaos_line(res: Result, n_trace: int) -> str:
    """One line of the chaos arm's numbers, for the run's progress and the report."""
    k = chaos_counts(res)
    cut = sum(k["cut"].values())
    return (f"{k['kills']} kills ({', '.join(f'{m} {n}' for m, n in k['by_model'].items()) or 'none'}; "
            f"{k['in_flight']} requests in flight at them); answers resumed: "
            f"{', '.join(f'{r} {n}' for r, n in sorted(k['resumed'].items())) or 'none'}; their pauses p50 {k['p50']:.1f} s, "
            f"p99 {k['p99']:.1f} s, mean {k['mean']:.1f} s; cut for good by the router: "
            f"{', '.join(f'{r} {n}' for r, n in sorted(k['cut'].items()) if n) or 'none'} ({cut}); "
            f"the client saw {k['streams_cut']} streams cut (no [DONE], or an error event) and "
            f"{k['refused']} requests answered other than 200; batch requests answered {k['batch'][0]} of {k['batch'][1]}")


def chaos_verdict(rounds: list[dict[str, Result]], n_trace: int) -> str:
    """The chaos arm against issue 55's target: no stream cut."""
    lines = []
    for k, r in enumerate(rounds):
        res = r["chaos"]
        c = chaos_counts(res)
        clean = not sum(c["cut"].values()) and not c["streams_cut"] and not c["refused"] and c["batch"][0] == c["batch"][1]
        lines.append(f"{'Round ' + str(k + 1) + ': ' if len(rounds) > 1 else ''}{chaos_line(res, n_trace)}: "
                     f"**{'no stream cut, every request answered' if clean else 'NOT clean'}**.")
    c0 = rounds[0]["chaos"].chaos
    return (f"**Chaos** (the batch arm, and the process of an engine serving requests SIGKILLed at exponential gaps of mean "
            f"{c0.get('every_s', 0):g} s of trace, `--chaos-seed {c0.get('seed')}`; pauses in real seconds, p50 and p99 "
            "read from `hotswap_stream_pause_seconds`' buckets): " + " ".join(lines))


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


def batch_verdict(rounds: list[dict[str, Result]], stats: dict[str, dict[str, float]], n_trace: int,
                  args: argparse.Namespace, measured: set[int]) -> str:
    """The batch arm: the trace's (interactive) waits beside hotswap's without the batch client, and the batch's own."""
    b, hs = stats["batch"], stats["hotswap"]
    ratios = {k: b[k] / hs[k] if hs[k] > 0 else math.nan for k in ("mean", "p90", "p99")}
    worst = max(ratios.values())
    flood = [w for r in rounds for i, w in r["batch"].waits.items() if i >= n_trace]
    asked = args.batch_requests * len(rounds)
    own = (f"mean {sum(flood) / len(flood):.1f} s, p50 {h.percentile(flood, 0.5):.1f} s, max {max(flood):.1f} s"
           if flood else "none answered")
    jobs = ", ".join(f"{r['batch'].batch_job_s:.0f}" for r in rounds)
    per_round = ", ".join(f"{s['batch']['mean'] / s['hotswap']['mean']:.2f}" for s in (pooled([r], measured) for r in rounds))
    harmed = [r["batch"].waits[i] for r in rounds for i in r["batch"].batch_harmed if i in r["batch"].waits]
    waited = sum(w for r in rounds for i, w in r["batch"].waits.items() if i < n_trace)
    harm = (f"The batch's own wakes (a batch request and no interactive one waiting as each began): "
            f"{', '.join(str(r['batch'].batch_wakes) for r in rounds)} a round; the interactive requests they made wait "
            f"(for a model such a wake parked, until its next wake): {len(harmed)}, {sum(harmed):.0f} s of wait in all, "
            f"{sum(harmed) / waited if waited else 0:.1%} of the arm's interactive wait; over {WITHIN_S:g} s: "
            f"{sum(1 for w in harmed if w > WITHIN_S)}.")
    return (f"**With a batch client** ({args.batch_requests} requests for {args.batch_model} due at minute "
            f"{args.batch_at_minute:g}, {args.batch_tokens} tokens each, `X-Hotswap-Class: batch`, sent by "
            f"{args.batch_concurrency} workers without streaming): the trace's interactive "
            "waits ÷ hotswap's without it: " + ", ".join(f"{k} {v:.2f}×" for k, v in ratios.items())
            + f" ({'within' if worst <= 1.10 else 'NOT within'} the target of 1.10×); within {WITHIN_S:g} s {b['within']:.0%} "
            f"against {hs['within']:.0%}. Batch requests answered: {len(flood)} of {asked}; each one's time to its "
            f"answer, from when its worker sent it: {own}; the job, first request to last answer: {jobs} s. "
            f"Mean interactive wait with ÷ without, each round: {per_round}. " + harm)


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
        section(list(results)), "",
        f"{h.host(started)}, commit {h.git_rev()}. Took {elapsed:.0f} s. Load average at start / end: "
        f"{load_start} / {h.loadavg()}.", "", "```", h.command_line(), "```", "",
        f"Trace: `{args.trace.relative_to(h.REPO) if args.trace.is_relative_to(h.REPO) else args.trace}` "
        f"({header.get('source', '?')}, commit {str(header.get('commit', '?'))[:7]}, days {header.get('days')}), "
        f"{len(trace)} requests; the first {args.warmup_minutes:g} minutes replayed but not counted, "
        f"{len(measured)} requests over {minutes:.1f} minutes measured; time scale {args.time_scale:g}. "
        f"Waits are real seconds to the first token (embeddings: to the answer), over the {len(ok)} requests "
        "answered 200 in every arm. Floor (wall): " + ", ".join(f"{a} {r.floor_s * 1e3:.1f} ms" for a, r in results.items()) + ".",
        "", "| model | GPUs | share | weights GB | L1 sleep / wake s | L2 wake s, staged / cold | boot s, cold | tok/s | requests |",
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
        f"`drain_timeout_s` {args.drain_timeout_s:g}; the gate on (its canary after every wake; the embedder's off).", "",
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
    if "batch" in verdict_stats and "hotswap" in verdict_stats:
        lines += ["", batch_verdict(rounds, verdict_stats, len(trace), args, measured)]
    if "chaos" in verdict_stats:
        lines += ["", chaos_verdict(rounds, len(trace))]
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
