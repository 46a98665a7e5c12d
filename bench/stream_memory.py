"""What the router keeps per stream, at 1,000 long streams at once: its RSS beside another tree's (issue 55).

    .venv/bin/python bench/stream_memory.py --ab-src BEFORE_TREE [--streams 1000] [--tokens 600] [--reps 2]

A resumable stream costs the router what it must remember to resume it (router/proxy/resume.py's
Transcript: references to the relayed chunks up to 64 KiB, then the answer's token ids and text).
This opens `--streams` streams at once through each router (this tree's, `hotswap`, and the one at
`--ab-src`, `hotswap-ab`), each `--tokens` tokens long at `--token-rate` tokens/s, so every stream
crosses the compaction while all are open, and samples each router's RSS (VmRSS) every 0.2 s: its
RSS before, its peak while the streams run, and after. Both routers front one simulator (attached
by `url:`), the targets in reverse order every other rep. The router's CPU per stream is read
beside it (utime+stime over the run): past the compaction, a resumable stream's events are parsed.
It asserts only that every stream arrived whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

import harness as h  # bench/harness.py: processes, /proc, the report's head
from harness import MODEL, REPO, SIM_ENV

HEADING = "## Router memory per stream (issue 55)"


def start_sim(procs: h.Processes, tmp: Path, token_rate: float) -> int:
    port = h.free_port()
    log = tmp / "sim.log"
    sim = procs.start("sim", [sys.executable, "-m", "engines.sim", "serve", f"{MODEL}/sim", "--host", "127.0.0.1", "--port", str(port),
                              "--served-model-name", MODEL, "--enable-sleep-mode", "--sim-boot-s", "0",
                              "--sim-token-rate", str(token_rate)], log, env=SIM_ENV)
    h.wait_until_ok(f"http://127.0.0.1:{port}/health", sim, log)
    return port


def start_router(procs: h.Processes, tmp: Path, name: str, src: Path, upstream: int) -> tuple[str, int]:
    port = h.free_port()
    roster = f"listen: {{host: 127.0.0.1, port: {port}}}\nmodels:\n  - name: {MODEL}\n    url: http://127.0.0.1:{upstream}\n"
    proc, _ = h.start_router(procs, tmp, name, port, roster, src=src)
    return f"http://127.0.0.1:{port}", proc.pid


async def streams(url: str, pid: int, n: int, tokens: int) -> dict:
    """Open n streams at once; RSS sampled until the last ends."""
    body = json.dumps({"model": MODEL, "prompt": "A long answer about", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    bad: list[str] = []

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
            data = await r.read()
        if r.status != 200 or data.count(b"data: ") != tokens + 1 or not data.rstrip().endswith(b"data: [DONE]"):
            bad.append(f"HTTP {r.status}: {data[:200]!r}")

    before = h.rss_mb([pid])
    peak, t0, cpu0 = before, time.monotonic(), h.cpu_seconds(pid)
    conn = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        running = asyncio.gather(*(one(session) for _ in range(n)))
        while not running.done():
            peak = max(peak, h.rss_mb([pid]))
            await asyncio.wait({running}, timeout=0.2)
        await running
    if bad:
        raise SystemExit(f"bench: {len(bad)} of {n} streams were not whole; first: {bad[0]}")
    return {"before": before, "peak": peak, "after": h.rss_mb([pid]), "wall_s": time.monotonic() - t0,
            "cpu_ms": (h.cpu_seconds(pid) - cpu0) * 1e3 / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ab-src", type=Path, required=True, metavar="DIR", help="the tree to compare with (e.g. a worktree of main)")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=600, help="tokens per stream (default %(default)s: past the 64 KiB compaction)")
    p.add_argument("--token-rate", type=float, default=20.0, help="each stream's tokens/s (default %(default)s)")
    p.add_argument("--reps", type=int, default=2)
    h.add_session_args(p)
    args = p.parse_args()
    with h.session(args, "hotswap-stream-memory-") as run:
        upstream = start_sim(run.procs, run.tmp, args.token_rate)
        targets = {"hotswap": start_router(run.procs, run.tmp, "hotswap", REPO, upstream),
                   "hotswap-ab": start_router(run.procs, run.tmp, "hotswap-ab", args.ab_src, upstream)}
        results: dict[str, list[dict]] = {name: [] for name in targets}
        for rep in range(args.reps):
            for name in (list(targets) if rep % 2 == 0 else list(reversed(targets))):
                url, pid = targets[name]
                r = asyncio.run(streams(url, pid, args.streams, args.tokens))
                results[name].append(r)
                print(f"  rep {rep} {name:10s} RSS before {r['before']:6.1f} MB  peak {r['peak']:6.1f} MB  "
                      f"after {r['after']:6.1f} MB  CPU {r['cpu_ms']:5.1f} ms/stream  ({r['wall_s']:.0f} s)", flush=True)
        rows = ["| target | rep | RSS before MB | peak MB | after MB | peak − before, KB per stream | router CPU ms per stream |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for name, reps in results.items():
            for rep, r in enumerate(reps):
                rows.append(f"| {name} | {rep} | {r['before']:.1f} | {r['peak']:.1f} | {r['after']:.1f} | "
                            f"{(r['peak'] - r['before']) * 1024 / args.streams:.1f} | {r['cpu_ms']:.2f} |")
        grew = {name: max(r["peak"] - r["before"] for r in reps) for name, reps in results.items()}
        text = "\n".join([
            HEADING, "", h.host(run.started), "",
            f"{args.streams} streams at once, {args.tokens} tokens each at {args.token_rate:g} tokens/s, through each router "
            f"(`hotswap`: {h.git_rev()}; `hotswap-ab`: {args.ab_src.name}); command: `{h.command_line()}`.", "", *rows, "",
            f"Per stream, at the peak: hotswap {grew['hotswap'] * 1024 / args.streams:.1f} KB, "
            f"hotswap-ab {grew['hotswap-ab'] * 1024 / args.streams:.1f} KB."])
        run.publish(text, HEADING)
        return 0
    return 130


if __name__ == "__main__":
    sys.exit(main())
