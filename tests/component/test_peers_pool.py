"""Requests passed on to a peer have their own connections, bounded per peer by
`node.peer_connections`; the engines' control calls (sleep, wake, canary, metrics) have theirs,
which no amount of passed-on traffic can take. Real routers, a slow simulated engine on the peer."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from tests.support import Hopeless, eventually, free_port, http, roster_dict, sim_model

POOL = 100  # as many as aiohttp's default pool, which the hand-offs shared with the control calls before


async def test_a_swap_completes_while_passed_on_streams_hold_the_peers_whole_pool(start_router):
    b_port = free_port()
    a = await start_router(roster_dict(sim_model("x", group="g"), sim_model("y", group="g"),
                                       node={"name": "node-a", "peers": [f"http://127.0.0.1:{b_port}"],
                                             "peer_connections": POOL}))
    # The peer's model decodes 5 tokens a second: a stream of 4000 tokens outlasts the test.
    slow = sim_model("slow", args=("--sim-token-rate", "5"), gate={"enabled": False})
    await start_router(roster_dict(slow, node={"name": "node-b"}), port=b_port)
    awake = "x" if (await a.engine("x"))["state"] == "awake" else "y"
    parked = "y" if awake == "x" else "x"

    started = [asyncio.Event() for _ in range(POOL)]
    body = {"model": "slow", "prompt": "long", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    async def stream(s: aiohttp.ClientSession, began: asyncio.Event) -> None:
        async with s.post(a.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["X-Hotswap-Node"] == "node-b"
            async for _ in r.content:
                began.set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)) as s:
        streams = [asyncio.create_task(stream(s, began)) for began in started]
        try:
            await eventually(lambda: _all_began(streams, started), timeout=60, what=f"{POOL} streams through node-a")
            # The peer's pool is full: one more is told so at once, in the route's error shape, not queued.
            async with s.post(a.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                refused = r.status, r.headers.get("Retry-After"), await r.json()
            assert refused[0] == 503 and refused[1] and refused[2]["error"]["code"] == "peer_busy", refused
            assert "node-b" in refused[2]["error"]["message"] and "node.peer_connections" in refused[2]["error"]["message"]
            assert str(b_port) not in refused[2]["error"]["message"]
            peer = (await a.status())["peers"][0]
            assert (peer["passed_on"], peer["peer_connections"]) == (POOL, POOL)

            # node-a's engines are still in reach: a swap (sleep one, wake and judge the other) completes.
            status, _, swapped = await http(a, "POST", f"/admin/swap?model={parked}", timeout=aiohttp.ClientTimeout(total=60))
            assert status == 200 and swapped["result"] == "awake", swapped
            # ... while every one of the streams still holds its connection.
            assert not any(t.done() for t in streams), [t for t in streams if t.done()]
            assert (await a.status())["peers"][0]["passed_on"] == POOL
        finally:
            for t in streams:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*streams, return_exceptions=True)
    # The connections come back once the clients leave.
    await eventually(lambda: _passed_on(a, 0), timeout=30, what="the hand-offs ended with their clients")


def _all_began(streams: list[asyncio.Task], started: list[asyncio.Event]) -> bool:
    ended = next((t for t in streams if t.done()), None)
    if ended is not None:
        raise Hopeless(f"a stream ended: {ended.exception()!r}")
    return all(e.is_set() for e in started)


async def _passed_on(router, count: int) -> bool:
    return (await router.status())["peers"][0]["passed_on"] == count
