"""Load on loopback, bounded in count and time: many concurrent streams, many models. Nothing is lost.

Set HOTSWAP_RELIABILITY_REPORT=path to append the measured figures (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp

from router.daemon import raise_open_file_limit
from tests.support import roster_dict, sim_model

STREAMS = 1000
TOKENS = 32


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def report(**figures) -> None:
    path = os.environ.get("HOTSWAP_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


async def stream_once(session: aiohttp.ClientSession, url: str, model: str) -> str:
    body = {"model": model, "prompt": "load", "max_tokens": TOKENS, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return f"http {r.status}"
            chunks, done = 0, False
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    chunks += 1
            return "ok" if done and chunks == TOKENS else f"short stream ({chunks} chunks, done={done})"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"{type(exc).__name__}"


async def test_a_thousand_concurrent_streams_across_the_roster_lose_nothing(start_router):
    fast = ("--sim-token-rate", "400")  # ~0.1 s per stream: all of them overlap
    roster = roster_dict(sim_model("a", group="g1", default=True, args=fast), sim_model("b", group="g1", args=fast),
                         sim_model("c", group="g2", devices=[1], default=True, args=fast),
                         queue={"max_waiting": 2 * STREAMS, "max_wait_s": 120}, swap={"max_hold_s": 2, "min_active_s": 0.5})
    raise_open_file_limit()  # the load generator holds 1000 sockets too
    router = await start_router(roster)
    rss_before = rss_mib(router.proc.pid)
    models = ["a", "b", "c"]
    timeout = aiohttp.ClientTimeout(total=180, sock_connect=30)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        results = await asyncio.gather(*(stream_once(session, router.url, models[i % 3]) for i in range(STREAMS)))
        peak = rss_mib(router.proc.pid)
    elapsed = time.monotonic() - started
    failures = {r: results.count(r) for r in set(results) if r != "ok"}
    assert not failures, failures
    assert sum(e["in_flight"] + e["queued"] for e in (await router.status())["engines"]) == 0
    report(scenario="1000 concurrent streams, 3 models in 2 groups", sent=STREAMS, answered=results.count("ok"),
           lost=STREAMS - results.count("ok"), seconds=round(elapsed, 1), router_rss_mib_before=round(rss_before, 1),
           router_rss_mib_after=round(peak, 1))


async def test_a_fifty_model_roster_boots_and_routes_every_model(start_router):
    models = [sim_model(f"m{i:02d}", devices=[i // 5], default=i % 5 == 0, args=("--sim-token-rate", "2000"))
              for i in range(50)]
    started = time.monotonic()
    router = await start_router(roster_dict(*models, swap={"boot_timeout_s": 120}), timeout_s=240)
    booted_s = time.monotonic() - started
    rss_idle = rss_mib(router.proc.pid)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def ask(name: str) -> str:
            async with session.post(router.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 4}) as r:
                return "ok" if r.status == 200 and (await r.json())["choices"][0]["text"] else f"http {r.status}"

        results = await asyncio.gather(*(ask(m["name"]) for m in models))
    assert results == ["ok"] * 50, results
    status = await router.status()
    assert len(status["placement"]["devices"]) == 10 and all(s["result"] == "ok" for s in status["swaps"])
    report(scenario="50-model roster (10 GPUs, 5 models each)", sent=50, answered=results.count("ok"), lost=50 - results.count("ok"),
           boot_seconds=round(booted_s, 1), router_rss_mib_idle=round(rss_idle, 1), router_rss_mib_after=round(rss_mib(router.proc.pid), 1))
