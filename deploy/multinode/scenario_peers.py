"""try-local's checks of the fleet's one /v1/models and of bodies of any size (docs/multi-node.md).

trylocal.py runs these through the front while every node is up, before its load (the KILL run):

- GET /v1/models at the front (deploy/multinode/models.lua) lists every model once, with the
  nodes that have it;
- chat bodies of 40 kB and 8 MB whose `model` comes after the front's 16 kB buffer, sent with the
  openai and the anthropic SDK (the anthropic SDK writes `model` after `messages`; the openai SDK
  writes it first, so it is given there in `extra_body`, which comes last; each body's offset of
  `"model"` is measured, not assumed), for a model only one node has: every one is answered by
  that node, and some arrived elsewhere first and were passed on (node.peers).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import anthropic
import openai
from steps import POLL_CALL_S, SETTLE_S, Failed, get, poll

ONLY_ON = ("alpha", "node-a")  # a model that one node alone serves
SIZES = (("40 kB", 40_000), ("8 MB", 8_000_000))
BUFSIZE = 16384  # HAProxy's tune.bufsize default: what the front reads of a body to find `model`
ROUNDS = 3  # per SDK and size: the front's leastconn takes turns among idle nodes, so some land elsewhere


@dataclass
class Sent:
    sdk: str
    size: str
    model_at: int = -1  # offset of `"model"` in the body the SDK wrote
    node: Optional[str] = None
    passed_on_by: Optional[str] = None
    error: Optional[str] = None


def _recorder(sent: Sent, sdk) -> object:
    """The SDK's own HTTP client, noting where `"model"` is in the body the SDK wrote."""
    async def look(request) -> None:
        sent.model_at = request.content.find(b'"model"')

    return sdk.DefaultAsyncHttpxClient(timeout=60, event_hooks={"request": [look]})


async def _one(front: str, sdk: str, label: str, size: int) -> Sent:
    sent = Sent(sdk, label)
    text = "long conversation " * (size // 18)
    model = ONLY_ON[0]
    try:
        if sdk == "openai":
            async with openai.AsyncOpenAI(base_url=front + "/v1", api_key="unused", max_retries=0,
                                          http_client=_recorder(sent, openai)) as c:
                # This SDK writes `model` first; named in extra_body instead, it comes last (after messages).
                raw = await c.chat.completions.with_raw_response.create(
                    messages=[{"role": "user", "content": text}], model=openai.omit, max_tokens=4, extra_body={"model": model})
                raw.parse()
        else:
            async with anthropic.AsyncAnthropic(base_url=front, api_key="unused", max_retries=0,
                                                http_client=_recorder(sent, anthropic)) as c:
                raw = await c.messages.with_raw_response.create(
                    messages=[{"role": "user", "content": text}], model=model, max_tokens=4)
                await raw.parse()
        sent.node, sent.passed_on_by = raw.headers.get("x-hotswap-node"), raw.headers.get("x-hotswap-passed-on-by")
    except (openai.APIError, anthropic.APIError) as exc:
        sent.error = f"{getattr(exc, 'status_code', '')} {type(exc).__name__}".strip()
    return sent


async def _bodies(front: str) -> list[Sent]:
    out = []
    for sdk in ("openai", "anthropic"):
        for label, size in SIZES:
            for _ in range(ROUNDS):  # one at a time: each request finds every node idle
                out.append(await _one(front, sdk, label, size))
    return out


def _models(front: str) -> tuple[dict, int]:
    """The front's listing once every node has answered it, and how many asks that took. The front gives
    each node 2 s (models.lua): on a busy machine a node can miss that once, and is then listed in
    `unanswered_nodes`, as it should be; the claim is about the union, so ask again (and say so). Never
    whole within SETTLE_S: the last listing, for the claim to fail on."""
    asks, listing = 0, {}

    def whole() -> tuple[bool, str]:
        nonlocal asks, listing
        asks += 1
        code, body = get(front + "/v1/models", POLL_CALL_S)
        listing = json.loads(body) if code == 200 else {}
        return code == 200 and not listing.get("unanswered_nodes"), f"{code}, unanswered: {listing.get('unanswered_nodes')}"

    try:
        poll("GET /v1/models at the front, every node answering", SETTLE_S, whole)
    except Failed:
        pass
    return listing, asks


def claims(front: str, holders: dict[str, list[str]]) -> tuple[list[str], list[tuple[str, bool]]]:
    """Lines for the summary and (claim, holds) pairs. `holders`: model -> the nodes that have it."""
    listing, asks = _models(front)
    ids = [m["id"] for m in listing.get("data", [])]
    seen = {m["id"]: sorted(n["name"] for n in m["nodes"]) for m in listing.get("data", [])}
    sent = asyncio.run(_bodies(front))
    model, node = ONLY_ON
    passed = [s for s in sent if s.passed_on_by]
    answered_by = Counter(s.node or s.error or "?" for s in sent)
    where = ", ".join(f"{m} on {'+'.join(n)}" for m, n in seen.items())
    lines = [f"/v1/models at the front: {where}; unanswered nodes: {listing.get('unanswered_nodes') or 'none'}"
             + (f" (asked {asks} times: the earlier answers were not whole)" if asks > 1 else ""),
             f"bodies for {model} (only on {node}), `model` past the front's {BUFSIZE // 1024} kB: " + "; ".join(
                 f"{s.sdk} {s.size} (model at byte {s.model_at}) -> {s.node or s.error}"
                 + (f" via {s.passed_on_by}" if s.passed_on_by else "") for s in sent)]
    out = [
        (f"/v1/models through the front lists each of the {len(holders)} models once, with the nodes that have it "
         f"({len(ids)} cards: {sorted(ids)})",
         sorted(ids) == sorted(holders) and len(ids) == len(set(ids)) and not listing.get("unanswered_nodes")
         and all(seen.get(m) == sorted(h) for m, h in holders.items())),
        (f"{len(sent)} chat bodies of 40 kB and 8 MB with `model` after the first 16 kB (openai and anthropic SDKs) "
         f"for {model}, only on {node}: every one answered by {node} "
         f"({', '.join(f'{k} {v}' for k, v in sorted(answered_by.items()))})",
         all(s.model_at > BUFSIZE for s in sent) and all(not s.error and s.node == node for s in sent)),
        (f"{len(passed)} of them reached another node first (the front could not read their model) and were "
         f"passed on to {node} (node.peers)", bool(passed) and all(s.passed_on_by != node for s in passed)),
    ]
    return lines, out
