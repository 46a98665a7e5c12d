"""The wait for a parked model on a production trace (issue 32): hotswap, the code before, and a
memory-aware LRU router, side by side in one run.

    .venv/bin/python bench/wake_trace.py [--trace bench/traces/servegen-d1-7.jsonl] [--minutes M]
        [--time-scale S] [--arms hotswap,lru,before --ab-src TREE] [--reps N] [--write-docs]
        [--arms chaos --chaos-every-s S --chaos-seed N]

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
  batch     this tree, with a batch client added to the trace (`--batch-*`: a job of requests for one
            model, all due at once, sent as `X-Hotswap-Class: batch` by a fixed number of workers without
            streaming, as an evaluation harness sends them); its interactive waits are set against hotswap's
  batch-before  `--ab-src` with the same batch client: the batch arm's A/B against the code before
  chaos     the batch arm with engines killed at random (issue 55): during the trace, at exponential gaps of mean
            `--chaos-every-s` trace seconds (seeded by `--chaos-seed`, printed), the process of an engine serving
            requests is SIGKILLed, as a crash or the OOM killer ends it; the router restarts it and must resume
            every answer the kill cut. Reported: the kills, the answers resumed by reason and their pauses, and what was cut
            (the router's counters, read from /metrics, and the client's side: a stream without [DONE] or with an
            error event, an answer other than 200)

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
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import harness as h  # bench/harness.py: the run session, report helpers
from wake_roster import MAX_WAIT_S, MODELS, TRACE, Req, batch_flood, batch_max_wait_s, load_trace, older_tree, policy_keys, roster
from replay import Failed, at_arrival_times, lru_cost, running_router  # bench/replay.py: the in-process router
from wake_report import STREAM_CUT, WITHIN_S, Result, chaos_line, report, section, summary  # bench/wake_report.py: the section it writes

log = logging.getLogger("bench")
ARMS = ("hotswap", "no-ahead", "lru", "before", "batch", "batch-before", "chaos")
BATCH_ARMS = ("batch", "batch-before", "chaos")
BEFORE_ARMS = ("before", "batch-before")  # run from --ab-src
CHAOS_ARMS = ("chaos",)
BATCH_HEADER = {"X-Hotswap-Class": "batch"}
CALIBRATION_REQUESTS = 20
ERROR_EVENT = b'data: {"error"'  # router.errors.sse_error's event: JSON escapes a quote inside text, so only an error matches


async def kill_at_random(run: Any, seed: int, every_s: float, scale: float, span_s: float, kills: list[list[Any]]) -> None:
    """The chaos arm's killer, for the trace's `span_s` seconds: at exponential gaps of mean `every_s` trace seconds,
    SIGKILL the process of an engine serving requests (the child of its reaper, as a crash ends it: the reaper and
    the router see it die), the next one serving when none is. Not after the trace's last arrival: then only the
    engines finishing its last answers serve, and a restarted one, serving its paused answers again, would be the
    target of every kill. Appends (trace second, model, requests in flight) to `kills`. The gaps and the draws of
    the victims come from two generators of `seed`: a draw among more or fewer engines leaves the gaps as they were."""
    from engines.engine import State

    gaps, draws = random.Random(seed), random.Random(f"victims {seed}")
    t0 = time.monotonic()
    while True:
        gap = gaps.expovariate(1 / every_s) * scale
        if time.monotonic() + gap > t0 + span_s * scale:
            return
        await asyncio.sleep(gap)  # the chaos's own clock, not a readiness wait
        while True:
            serving = sorted((e for e in run.router.engines.values() if e.state is State.AWAKE and e.in_flight
                              and e.process is not None and e.process.returncode is None), key=lambda e: e.name)
            if serving:
                break
            if time.monotonic() > t0 + span_s * scale:
                return
            await asyncio.sleep(scale)  # one trace second, until an engine serves
        victim = draws.choice(serving)
        pids = h.children(victim.process.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if pids:
            kills.append([(time.monotonic() - t0) / scale, victim.name, victim.in_flight])
            log.info("bench: chaos: SIGKILLed %s (pid %s) with %d requests in flight", victim.name, pids, victim.in_flight)


def streams_metrics(text: str) -> dict[str, Any]:
    """From the router's /metrics: answers resumed and cut for good by reason, and the pauses' histogram (every model's)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"resumed": {}, "cut": {}, "pause_buckets": {}, "pause_sum": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "hotswap_streams_resumed_total":
                out["resumed"][sample.labels["reason"]] = out["resumed"].get(sample.labels["reason"], 0) + int(sample.value)
            elif sample.name == "hotswap_streams_cut_total":
                out["cut"][sample.labels["reason"]] = out["cut"].get(sample.labels["reason"], 0) + int(sample.value)
            elif sample.name == "hotswap_stream_pause_seconds_bucket":
                le = sample.labels["le"]
                out["pause_buckets"][le] = out["pause_buckets"].get(le, 0) + int(sample.value)
            elif sample.name == "hotswap_stream_pause_seconds_sum":
                out["pause_sum"] += sample.value
    return out


def batch_harm(trace: list[Req], sent: dict[int, tuple[float, float]], moves: list[tuple[str, list[str], float, float]],
               model: str) -> tuple[int, list[int]]:
    """The batch job's own wakes, and the interactive requests they made wait. A wake of `model` is the
    batch's when a batch request and no interactive one waited for it as it began. An interactive
    request it made wait is one for a model that wake parked, sent after the wake began, whose wait
    ended with that model's next wake (an upper bound: the model might have been parked anyway).
    Returns (the batch's wakes, those requests)."""
    def waiting(at: float, batch: bool) -> bool:
        return any(r.batch == batch and r.model == model and r.i in sent and sent[r.i][0] <= at < sent[r.i][1] for r in trace)

    wakes = [(victims, start) for to, victims, start, _ in moves
             if to == model and waiting(start, True) and not waiting(start, False)]
    harmed = set()
    for victims, start in wakes:
        for victim in victims:
            later = [(s, e) for to, _, s, e in moves if to == victim and s > start]
            if not later:
                continue
            next_end = later[0][1]
            harmed |= {r.i for r in trace if not r.batch and r.model == victim and r.i in sent
                       and start <= sent[r.i][0] < next_end <= sent[r.i][1] + 1e-3}
    return len(wakes), sorted(harmed)


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

    if arm in BATCH_ARMS:
        trace = sorted(trace + batch_flood(trace, args.batch_model, args.batch_requests, args.batch_at_minute * 60,
                                           args.batch_tokens), key=lambda r: r.t)
    # A batch request may wait until the trace's interactive demand is over: queue.batch_max_wait_s at most.
    longest_wait_s = max(MAX_WAIT_S, batch_max_wait_s() or 0.0) if arm in BATCH_ARMS else MAX_WAIT_S
    timeout = aiohttp.ClientTimeout(total=(longest_wait_s + 2 * max(r.tokens for r in trace) / 30) * scale + 60)
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
                                                 "temperature": 0, "ignore_eos": True, "stream": not r.batch}
            t0 = time.monotonic()
            try:
                async with client.post(run.base_url + path, json=body, headers=BATCH_HEADER if r.batch else None) as resp:
                    if resp.status != 200 or r.kind == "embeddings" or r.batch:
                        data = await resp.read()
                        return resp.status, time.monotonic() - t0, "" if resp.status == 200 else data[:200].decode(errors="replace")
                    first = await resp.content.readuntil(b"\n\n")  # the first token's event
                    ttft = time.monotonic() - t0
                    tail, error = first[-64:], ERROR_EVENT in first
                    while chunk := await resp.content.read(1 << 16):
                        error = error or ERROR_EVENT in tail[-len(ERROR_EVENT):] + chunk
                        tail = (tail + chunk)[-64:]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return 0, time.monotonic() - t0, repr(exc)
            if error:
                return 0, ttft, f"{STREAM_CUT}: an error event; it ended ...{tail.decode(errors='replace')!r}"
            if b"[DONE]" not in tail:
                return 0, ttft, f"{STREAM_CUT}: it ended without [DONE]: ...{tail.decode(errors='replace')!r}"
            return 200, ttft, ""

        cal = Req(-1, 0.0, "llama-8b", "chat", 1)
        floors = []
        for _ in range(CALIBRATION_REQUESTS):
            status, lat, err = await send(cal)
            if status != 200:
                raise Failed(f"{arm}: calibration request answered {status}: {err}")
            floors.append(lat)
        for rates in ("demand", "user_demand"):  # the calibration is not demand (user_demand: where the tree has it)
            if hasattr(run.scheduler, rates):
                setattr(run.scheduler, rates, type(run.scheduler.demand)(run.scheduler.demand.tau_s))
        res.floor_s = h.percentile(floors, 0.5)

        sent: dict[int, tuple[float, float]] = {}  # request -> (sent, first token), time.monotonic()
        # The batch job's workers: a harness keeps a fixed number of requests open, not the whole job.
        batch_workers = asyncio.Semaphore(args.batch_concurrency)

        async def one(r: Req) -> None:
            if r.batch:
                async with batch_workers:
                    await answer(r)
            else:
                await answer(r)

        async def answer(r: Req) -> None:
            at = time.monotonic()
            # In the router's log (this process's): a request's wait read beside the scheduler's decisions.
            log.info("bench: #%d %s sent (trace %.1f s)", r.i, r.model, r.t - trace[0].t)
            status, lat, err = await send(r)
            log.info("bench: #%d %s answered %d, first token after %.2f s real", r.i, r.model, status, lat / scale)
            if status != 200:
                res.errors.append(f"#{r.i} {r.model}{' (batch)' if r.batch else ''}: {status} {err}")
                return
            res.waits[r.i] = max(0.0, lat - res.floor_s) / scale
            sent[r.i] = (at, at + lat)

        print(f"  {arm}: booted; replaying {len(trace)} requests", flush=True)
        chaos = None
        if arm in CHAOS_ARMS:
            res.chaos = {"seed": args.chaos_seed, "every_s": args.chaos_every_s, "time_scale": scale, "kills": []}
            chaos = asyncio.create_task(kill_at_random(run, args.chaos_seed, args.chaos_every_s, scale,
                                                       trace[-1].t - trace[0].t, res.chaos["kills"]))
        try:
            lags, res.wall_s = await at_arrival_times([(r.t, lambda r=r: one(r)) for r in trace], scale, deadline, arm)
        finally:
            if chaos is not None:
                chaos.cancel()
                await asyncio.gather(chaos, return_exceptions=True)
        res.lag_s = [lag for r, lag in zip(trace, lags) if not r.batch]  # the trace's arrivals: a batch job's are all due at once
        if chaos is not None:
            async with client.get(run.base_url + "/metrics") as resp:
                res.chaos.update(streams_metrics(await resp.text()))
            res.chaos["batch"] = [sum(1 for r in trace if r.batch and r.i in res.waits), sum(1 for r in trace if r.batch)]
    job = [sent[r.i] for r in trace if r.batch and r.i in sent]
    if job:
        res.batch_job_s = (max(end for _, end in job) - min(at for at, _ in job)) / scale
        res.batch_wakes, res.batch_harmed = batch_harm(trace, sent, run.recorder.moves(), args.batch_model)
    res.wakes, res.wake_s = run.recorder.wake_kinds(scale)
    res.evictions = dict(run.recorder.evictions)
    res.phase_s = run.recorder.phase_seconds(scale)
    spans = run.recorder.spans()
    by_id = {r.i: r for r in trace}
    for i, wait in res.waits.items():
        if wait > WITHIN_S:
            at, first = sent[i]
            res.parts[i] = {k: v / scale for k, v in wait_parts(at, first, spans.get(by_id[i].model, [])).items()}
    return res


def run_child(arm: str, args: argparse.Namespace, tmp: Path) -> Result:
    """Run one arm in a child process whose `router` is the arm's tree."""
    tree = Path(args.ab_src) if arm in BEFORE_ARMS else h.REPO
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


# -- the run ---------------------------------------------------------------------------------------

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
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="swap.drain_timeout_s, real seconds: how long a parked engine's streams may run on before they are "
                        "cut (default 30; near 0 prices a park as if it could preempt its streams, which vLLM's gate forbids)")
    p.add_argument("--disk-gb-per-s", type=float, default=2.0, help="a cold read from disk (default %(default)s)")
    p.add_argument("--page-cache-gb", type=float, default=128.0,
                   help="the host's page cache: the sims evict the least recently read checkpoint past it (default %(default)s)")
    p.add_argument("--page-cache-budget-gb", type=float, default=96.0,
                   help="host.page_cache_budget_gb: what the router may stage ahead (default %(default)s)")
    p.add_argument("--batch-model", default="gemma-27b", choices=sorted(MODELS),
                   help="the batch arm's client: the model it floods (default %(default)s)")
    p.add_argument("--batch-requests", type=int, default=200, help="the batch arm's flood, requests (default %(default)s)")
    p.add_argument("--batch-at-minute", type=float, default=14.0,
                   help="the trace's minute the flood is sent at (default %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=256, help="each batch request's output tokens (default %(default)s)")
    p.add_argument("--batch-concurrency", type=int, default=16,
                   help="the batch client's workers: requests it keeps open at once (default %(default)s)")
    p.add_argument("--chaos-every-s", type=float, default=90.0,
                   help="the chaos arm: mean trace seconds between kills, at exponential gaps (default %(default)s: longer than "
                        "the slowest cold boot, 55 s, so a kill seldom finds its last victim still restarting)")
    p.add_argument("--chaos-seed", type=int, default=None, help="the chaos arm's seed (default: a random one, printed)")
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
    # The smoke (tests/component/test_trace_chaos.py): the arm that takes every path (the trace, the batch
    # client, the kills, the report) over the trace's first two minutes.
    a = h.parse(p, argv, smoke=dict(arms="chaos", minutes=2.0, warmup_minutes=1.0, batch_at_minute=0.5, batch_requests=24,
                                    batch_concurrency=8, chaos_every_s=30.0, max_seconds=240.0))
    a.trace = a.trace.resolve()
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not a.arms or not set(a.arms) <= set(ARMS):
        p.error(f"--arms: choose from {', '.join(ARMS)}")
    if set(BEFORE_ARMS) & set(a.arms) and not (a.ab_src and (Path(a.ab_src) / "router").is_dir()):
        p.error("--arms before needs --ab-src, a tree with router/ in it (e.g. `git worktree add /tmp/before <commit>`)")
    if not 0 < a.time_scale <= 1:
        p.error("--time-scale must be in (0, 1]")
    a.no_docs = a.no_docs or not a.write_docs
    if a.chaos_seed is None:
        a.chaos_seed = random.SystemRandom().randrange(1 << 31)
    if not a.chaos_every_s > 0:
        p.error("--chaos-every-s must be more than 0")
    # What a child gets again: everything but the arms, the docs and the session's own flags.
    a.passthrough = ["--trace", str(a.trace), "--time-scale", f"{a.time_scale!r}", "--ram-budget-gb", f"{a.ram_budget_gb!r}",
                     "--disk-gb-per-s", f"{a.disk_gb_per_s!r}", "--page-cache-gb", f"{a.page_cache_gb!r}",
                     "--page-cache-budget-gb", f"{a.page_cache_budget_gb!r}", "--max-seconds", f"{a.max_seconds!r}",
                     "--max-hold-s", f"{a.max_hold_s!r}", "--drain-timeout-s", f"{a.drain_timeout_s!r}", "--batch-model", a.batch_model,
                     "--batch-requests", str(a.batch_requests), "--batch-at-minute", f"{a.batch_at_minute!r}",
                     "--batch-tokens", str(a.batch_tokens), "--batch-concurrency", str(a.batch_concurrency),
                     "--warmup-minutes", f"{a.warmup_minutes!r}", "--chaos-every-s", f"{a.chaos_every_s!r}",
                     "--chaos-seed", str(a.chaos_seed), "--no-docs"]
    if a.reps < 1:
        p.error("--reps must be at least 1")
    if "batch" in a.arms and "hotswap" not in a.arms:
        p.error("--arms batch is measured against hotswap: run both (e.g. --arms hotswap,batch)")
    if min(a.batch_requests, a.batch_tokens, a.batch_concurrency) < 1:
        p.error("--batch-requests, --batch-tokens and --batch-concurrency must be at least 1")
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
        if set(CHAOS_ARMS) & set(args.arms):
            print(f"bench: chaos: a SIGKILL every {args.chaos_every_s:g} s of trace on average, --chaos-seed {args.chaos_seed}",
                  flush=True)
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
                    counted = [w for i, w in results[arm].waits.items() if i < len(trace) and trace[i].t >= start]  # the trace's own
                    s = summary(counted, span / 60, results[arm])
                    print(f"  {arm}: mean {s['mean']:.2f} s, p50 {s['p50']:.2f}, p90 {s['p90']:.2f}, p99 {s['p99']:.1f}, "
                          f"within {WITHIN_S:g} s {s['within']:.0%}, {len(results[arm].errors)} errors", flush=True)
                    if results[arm].chaos:
                        print(f"  {arm}: {chaos_line(results[arm], len(trace))}", flush=True)
                rounds.append({arm: results[arm] for arm in args.arms})
        except Failed as exc:
            keep = "" if args.keep_logs else " (they are removed on exit: run with --keep-logs to read them)"
            print(f"bench: {exc}{keep}", file=sys.stderr)
            return 1
        text = report(rounds, header, trace, args, run.started, time.monotonic() - run.t0, run.load_start)
        run.publish(text, section(args.arms))
        return 0
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
