"""A request for a model this node does not serve, passed on to a peer that does (`node.peers`).

The proxy's endpoint calls `Peers.hand_off` where it would answer 404 model_not_found.

A front routes by the body's `model` only when it can read it: HAProxy sees the first
`tune.bufsize` of a body, so a long conversation whose `model` comes last (the anthropic SDK
writes it after `messages`) reaches any node. That node has already read the whole body; it
asks its peers' /v1/models which of them serves the model (cached for `LIST_TTL_S`, asked
again on a miss), sends the body there and relays the answer, a stream as it arrives.

One hop only: the forwarded request carries `HOP_HEADER`, and a node that receives it answers
its own 404, so two nodes that each think the other has a model cannot pass it back and forth.
The client's key travels with the request and the peer checks it (the fleet shares its keys);
no key is ever logged or kept (listings are cached under a digest of it, since a scoped key
sees fewer models).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
from aiohttp import web

from router.errors import APIError, anthropic_path, sse_error
from router.fleet.node import NODE_HEADER, card

HOP_HEADER = "X-Hotswap-Forwarded-By"  # its value: the name of the node that passed the request on
PASSED_ON_HEADER = "X-Hotswap-Passed-On-By"  # on the answer, for the client: this node passed it on (X-Hotswap-Node served it)
# What a peer needs of the client's request, and what the client needs of the peer's answer.
REQUEST_HEADERS = ("Authorization", "x-api-key", "anthropic-version", "anthropic-beta", "Content-Type", "Accept",
                   "X-Hotswap-Max-Wait")
ANSWER_HEADERS = ("Content-Type", "Retry-After", NODE_HEADER, "Cache-Control", "X-Request-Id")
LIST_TTL_S = 10.0  # a peer's model list is reused this long
REFRESH_GAP_S = 1.0  # a miss asks a peer again, but not more often than this: a storm of unknown models stays cheap
LIST_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
CONNECT_S = 5.0
MAX_LISTINGS = 512  # (peer, key) pairs remembered
log = logging.getLogger("hotswap")


@dataclass
class Listing:
    """What one peer's /v1/models said, for one key: model -> (awake, wake_estimate_s), or why it said nothing."""

    at: float
    models: dict[str, tuple[bool, float]] = field(default_factory=dict)
    problem: Optional[str] = None


class Peers:
    """The peers' model lists, and the hand-off of one request to the peer that serves its model."""

    def __init__(self) -> None:
        self._listings: dict[tuple[str, str], Listing] = {}
        self._down: set[str] = set()  # peers whose failure was logged (once, until they answer again)

    async def hand_off(self, request: web.Request, router, path: str, body: bytes, model: str,
                       not_here: APIError) -> web.StreamResponse:
        """Answer the request from the peer that serves `model`, or raise `not_here`, naming the peers asked."""
        peers = router.roster.node.peer_urls()
        if not peers or HOP_HEADER in request.headers:
            raise not_here
        credential = _credential(request)
        session = router.session
        peer, asked = await self._where(session, peers, model, credential)
        if peer is None:
            said = "; ".join(f"{url}: {why}" for url, why in asked.items())
            raise APIError(404, f"{not_here.message}. Not served by this node's peers either (asked {said}).",
                           "model_not_found", param="model")
        headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
        headers[HOP_HEADER] = card(router.roster)["name"]
        # Each silence of the peer's answer is bounded by its own wait for a wake, plus a stream's stall limit.
        queue = router.roster.queue
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S, sock_read=queue.max_wait_s + queue.stall_timeout_s)
        response: Optional[web.StreamResponse] = None
        try:
            async with session.post(peer + path, data=body, headers=headers, timeout=timeout) as answer:
                kept = {k: answer.headers[k] for k in ANSWER_HEADERS if k in answer.headers}
                kept[PASSED_ON_HEADER] = headers[HOP_HEADER]
                if not answer.content_type == "text/event-stream":
                    return web.Response(status=answer.status, body=await answer.read(), headers=kept)
                response = web.StreamResponse(status=answer.status, headers=kept)
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionResetError) as exc:
            if response is not None and (request.transport is None or request.transport.is_closing()):
                return response  # the client went away mid-stream: leaving the block cut the peer's answer too
            why = f"peer {peer} (serving '{model}') {'did not answer' if response is None else 'failed mid-stream'}: {type(exc).__name__}"
            self._forget(peer)
            if response is None:
                raise APIError(502, why, "peer_unreachable") from None
            log.warning("%s; the stream to the client is ended with an error event", why)
            await response.write(sse_error(why, "peer_unreachable", status=502, anthropic=anthropic_path(path)))
            await response.write_eof()
            return response

    async def _where(self, session: aiohttp.ClientSession, peers: list[str], model: str,
                     credential: tuple[str, dict[str, str]]) -> tuple[Optional[str], dict[str, str]]:
        """The peer to send `model` to (awake there first, then the shortest predicted wake), and what each peer said."""
        listings = await self._read(session, peers, credential, fresh=False)
        if not any(model in listing.models for listing in listings.values()):
            # A miss: a peer may have gained the model since (a reload, an adapter loaded); ask again.
            listings = await self._read(session, peers, credential, fresh=True)
        having = [(not listings[url].models[model][0], listings[url].models[model][1], i, url)
                  for i, url in enumerate(peers) if model in listings[url].models]
        asked = {url: listings[url].problem or "not served there" for url in peers}
        return (min(having)[3] if having else None), asked

    async def _read(self, session: aiohttp.ClientSession, peers: list[str], credential: tuple[str, dict[str, str]],
                    fresh: bool) -> dict[str, Listing]:
        digest, headers = credential
        now = time.monotonic()
        max_age = REFRESH_GAP_S if fresh else LIST_TTL_S

        async def listing(url: str) -> Listing:
            known = self._listings.get((url, digest))
            if known is not None and now - known.at < max_age:
                return known
            self._listings[(url, digest)] = known = await self._fetch(session, url, headers)
            return known

        found = await asyncio.gather(*(listing(url) for url in peers))
        if len(self._listings) > MAX_LISTINGS:
            self._listings = {k: v for k, v in self._listings.items() if now - v.at < LIST_TTL_S}
        return dict(zip(peers, found))

    async def _fetch(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Listing:
        at = time.monotonic()
        try:
            async with session.get(url + "/v1/models", headers=headers, timeout=LIST_TIMEOUT) as answer:
                if answer.status != 200:
                    return Listing(at, problem=f"its /v1/models answered {answer.status}")
                cards = (await answer.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
            if url not in self._down:
                self._down.add(url)
                log.warning("peer %s did not answer /v1/models (%s); it is skipped until it does", url, type(exc).__name__)
            return Listing(at, problem=f"unreachable ({type(exc).__name__})")
        if url in self._down:
            self._down.discard(url)
            log.info("peer %s answers /v1/models again", url)
        models = {c["id"]: (c.get("state") == "awake", float(c.get("wake_estimate_s") or 0))
                  for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)}
        return Listing(at, models)

    def _forget(self, url: str) -> None:
        """A peer that failed a hand-off is asked afresh next time."""
        self._listings = {k: v for k, v in self._listings.items() if k[0] != url}


def _credential(request: web.Request) -> tuple[str, dict[str, str]]:
    """The client's key as /v1/models takes it (Bearer; the anthropic SDK sends x-api-key), and a digest to cache under."""
    auth = request.headers.get("Authorization") or (f"Bearer {request.headers['x-api-key']}" if "x-api-key" in request.headers else "")
    return hashlib.sha256(auth.encode()).hexdigest(), ({"Authorization": auth} if auth else {})


PEERS_KEY = web.AppKey("peers", Peers)
