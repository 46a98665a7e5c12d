"""try-local's checks of the front itself (issue 24, items 1 and 4), called by trylocal.py.

- Awake-affinity (`park` + `affinity`, SIGKILL run only): `shared` is on node-a and node-b; it is
  parked on node-a, then 200 requests go through the front: all should be served by node-b, where
  it is awake, and node-a should not wake. The main load then SIGKILLs node-b, the awake node, and
  trylocal's table shows the traffic moving to node-a (woken through its backup line).
- The admin rule (`admin`, both runs): through the front an outside client can neither read
  /admin/status nor put an engine to sleep (the nodes have no admin key: they trust loopback,
  and the front is on loopback), and HAProxy's stats are not on the public bind.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Callable

import openai
from steps import SETTLE_S, call, poll

PARKED, AWAKE = "node-a", "node-b"  # where `shared` is parked / awake for the affinity check
REQUESTS = 200


def status(node_url: str, timeout: float = 30.0) -> dict:
    return json.loads(call("GET", node_url + "/admin/status", timeout)[1])


def state(node_url: str, model: str, timeout: float = 30.0) -> str:
    return next(e["state"] for e in status(node_url, timeout)["engines"] if e["name"] == model)


def wakes(node_url: str, model: str, since: float) -> int:
    """Wakes of `model` on the node that ended after `since` (epoch seconds), from its /admin/status."""
    return sum(1 for s in status(node_url)["swaps"] if s["to"] == model and s["at"] >= since)


def park(node_url: str, states: Callable[[], dict]) -> None:
    """Park `shared` on `node_url` (the operator's own loopback call, straight to the node) and wait
    until HAProxy has heard it from the node's agent: that node's primary line for shared drains."""
    code, body = call("POST", node_url + "/admin/sleep?model=shared", timeout=SETTLE_S)
    assert code == 200, f"parking shared on {PARKED}: POST /admin/sleep?model=shared answered {code}: {body[:300]!r}"
    poll(f"shared parked on {PARKED} (/admin/status)", SETTLE_S,
         lambda: ((now := state(node_url, "shared", 5.0)) == "sleeping", f"shared is {now}"))
    poll(f"HAProxy draining shared's primary line on {PARKED} (its agent, 1 s apart)", SETTLE_S,
         lambda: ((now := states().get(("model_shared", PARKED))) == "DRAIN", f"that line is {now}"))


def affinity(front_url: str, parked_url: str, concurrency: int) -> tuple[list[tuple[str, bool]], str]:
    """200 shared requests through the front while shared is awake only on node-b: claims and a line of numbers."""
    since = time.time()
    served: collections.Counter[str] = collections.Counter()

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=front_url, api_key="unused", max_retries=0, timeout=15)
        todo = iter(range(REQUESTS))

        async def worker() -> None:
            for _ in todo:
                try:
                    raw = await client.completions.with_raw_response.create(model="shared", prompt="hello", max_tokens=8)
                    served[raw.headers.get("x-hotswap-node") or "?"] += 1
                except openai.APIError as exc:
                    served[f"error {type(exc).__name__}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await client.close()

    asyncio.run(run())
    woke, still = wakes(parked_url, "shared", since), state(parked_url, "shared")
    text = (f"affinity: shared awake on {AWAKE}, parked on {PARKED}: {REQUESTS} requests through the front, "
            f"served by {', '.join(f'{n} {c}' for n, c in sorted(served.items()))}; wakes of shared on {PARKED}: {woke} "
            f"(it is {still})")
    claims = [(f"affinity: {served[AWAKE]}/{REQUESTS} shared requests served by {AWAKE}, where shared is awake "
               f"({served[PARKED]} by {PARKED}, where it is parked)", served[AWAKE] == REQUESTS),
              (f"affinity: {PARKED} did not wake shared for them ({woke} wakes; still {still})", woke == 0 and still == "sleeping")]
    return claims, text


def moved_after_kill(results: list, killed_at: float) -> tuple[str, bool]:
    """After the awake node's SIGKILL: shared's answers come from node-a (its backup line woke it)."""
    after = sorted((r for r in results if r.model == "shared" and r.started > killed_at and not r.error), key=lambda r: r.ended)
    first = next((r for r in after if r.node == PARKED), None)
    when = f"first answer from {PARKED} {first.ended - killed_at:.1f} s after the kill" if first else f"no answer from {PARKED}"
    return (f"after {AWAKE} (where shared was awake) was SIGKILLed, shared moved to {PARKED}: {when}",
            first is not None and all(r.node == PARKED for r in after))


def admin(front_url: str, stats_url: str, node_url: str) -> list[tuple[str, bool]]:
    """The front does not hand loopback's trust to its clients (the nodes have no admin key)."""
    read = [call("GET", front_url + path)[0] for path in ("/admin/status", "/%61dmin/status", "/ui")]
    slept = call("POST", front_url + "/admin/sleep?model=alpha")[0]
    alpha = state(node_url, "alpha")
    public_stats = call("GET", front_url + "/haproxy-stats;csv")
    local_stats = call("GET", stats_url)
    return [
        (f"through the front, /admin/status, /%61dmin/status and /ui answer {read} and /admin/sleep {slept}; "
         f"alpha is still {alpha} on node-a", all(c == 403 for c in read) and slept == 403 and alpha == "awake"),
        (f"HAProxy's stats are not on the public bind ({public_stats[0]}), only on the loopback stats bind ({local_stats[0]})",
         public_stats[0] != 200 and b"pxname" not in public_stats[1] and local_stats[0] == 200),
    ]
