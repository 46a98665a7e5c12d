"""A request for a model this node does not serve, passed on to a peer that does (`node.peers`).

The proxy's endpoint calls `Peers.hand_off` where it would answer 404 model_not_found.

A front routes by the body's `model` only when it can read it: HAProxy sees the first
`tune.bufsize` of a body, so a long conversation whose `model` comes last (the anthropic SDK
writes it after `messages`) reaches any node. That node has already read the whole body; it
asks its peers' /v1/models which of them serves the model (`router.fleet.listings`: cached,
one fetch in flight per peer, a failing peer skipped with backoff), sends the body there and
relays the answer, a stream as it arrives.

Hand-offs have their own connection pool, never the engines' control session (sleep, wake,
canary and metrics calls must not wait behind a hundred long streams), and at most
`node.peer_connections` of them are in flight to one peer: one more is a 503 `peer_busy` at
once, which a client or a front retries, rather than a wait in a connector's queue that no
deadline bounds. Peers' addresses and what failed on each go to the log and /admin/status,
never into a client's answer.

The request keeps its class: this node's (its key's, lowered by the client's X-Hotswap-Class) goes
with it as X-Hotswap-Class, which the peer reads as any client's header, to lower the class of the
key it checks, never to raise it; a batch request stays batch, and nobody is promoted by a hop.

A paused stream (router.proxy.resume) whose model is awake on a peer is finished there rather than
waiting here (`awake_peer`, `continue_on`): its continuation is the request sent, the answer is
spliced into the client's stream as a local continuation would be. ServerlessLLM's live migration,
done from outside the engine: the pause is one prefill on the peer.

One hop only: the forwarded request carries `HOP_HEADER`, and a node that receives it answers
its own 404, so two nodes that each think the other has a model cannot pass it back and forth.
The client's key travels with the request and the peer checks it (the fleet shares its keys);
no key is ever logged or kept (listings are cached under a digest of it, since a scoped key
sees fewer models).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from typing import Any, NamedTuple, Optional

import aiohttp
from aiohttp import web

from config.schema import Roster
from config.sections import INTERACTIVE
from router.errors import CLIENT_CLOSED, APIError, anthropic_path, sse_error
from router.fleet.listings import Listings
from router.fleet.node import NODE_HEADER, card
from router.keys import CLASS_HEADER

HOP_HEADER = "X-Hotswap-Forwarded-By"  # its value: the name of the node that passed the request on
PASSED_ON_HEADER = "X-Hotswap-Passed-On-By"  # on the answer, for the client: this node passed it on (X-Hotswap-Node served it)
# What a peer needs of the client's request, and what the client needs of the peer's answer.
REQUEST_HEADERS = ("Authorization", "x-api-key", "anthropic-version", "anthropic-beta", "Content-Type", "Accept",
                   "X-Hotswap-Max-Wait")
CREDENTIALS = ("Authorization", "x-api-key")
ANSWER_HEADERS = ("Content-Type", "Retry-After", NODE_HEADER, "Cache-Control", "X-Request-Id")
CONNECT_S = 5.0
DETOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=30)
BUSY_RETRY_AFTER_S = 1.0
TAIL_CHUNKS = 16  # a stream's last chunks kept for its record: where the usage event is
log = logging.getLogger("hotswap")


class PeerFailed(Exception):
    """A paused answer could not be finished on the peer; `sent`: some of it reached the client first."""

    def __init__(self, why: str, sent: bool = False):
        super().__init__(why)
        self.sent = sent


class Passed(NamedTuple):
    """A hand-off's answer, and what the proxy records of it (the activity log's `peer` and numbers)."""

    response: web.StreamResponse
    peer: str  # the node that answered (its X-Hotswap-Node, else its listing's node), else its URL
    status: int  # the peer's; CLIENT_CLOSED when the client left before the end of the stream
    first_byte_at: Optional[float]  # time.monotonic() when the peer's first body bytes came
    end: bytes  # the body, or a stream's last chunks


class Peers:
    """The peers' model lists, and the hand-off of one request to the peer that serves its model."""

    def __init__(self) -> None:
        self.listings = Listings()
        self.passed_on: collections.Counter[str] = collections.Counter()  # hand-offs in flight, per peer
        self._session: Optional[aiohttp.ClientSession] = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Made at first use, inside the running loop (aiohttp's rule), wherever the app was built. Unbounded as
        # a pool: the bound is `node.peer_connections` per peer (a reload changes it for the next hand-off),
        # checked before a connection is asked for, so nothing ever queues inside the connector.
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self, app: Any = None) -> None:
        if self._session is not None:
            await self._session.close()

    async def hand_off(self, request: web.Request, router, path: str, body: bytes, model: str,
                       not_here: APIError, klass: str) -> Passed:
        """Answer the request from the peer that serves `model`, or raise `not_here` (no peer has it: said, not named).
        `klass`: the request's class here, which the peer may only lower (by its own key's class)."""
        peers = router.roster.node.peer_urls()
        if not peers or HOP_HEADER in request.headers:
            raise not_here
        headers = {**_passed_on(request), CLASS_HEADER: klass}
        peer = await self._where(peers, model, _credential(headers, anthropic_path(path)), router.roster.node.peer_connections,
                                 not_here)
        node = self.listings.of(peer).node or "a peer"
        headers[HOP_HEADER] = card(router.roster)["name"]
        # Each silence of the peer's answer is bounded by its own wait for a wake, plus a stream's stall limit.
        queue = router.roster.queue
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S, sock_read=queue.max_wait_s + queue.stall_timeout_s)
        response: Optional[web.StreamResponse] = None
        named, status, first, tail = self.listings.of(peer).node or peer, 502, None, collections.deque(maxlen=TAIL_CHUNKS)
        self.passed_on[peer] += 1
        try:
            async with self.session.post(peer + path, data=body, headers=headers, timeout=timeout) as answer:
                named, status = answer.headers.get(NODE_HEADER, named), answer.status
                kept = {k: answer.headers[k] for k in ANSWER_HEADERS if k in answer.headers}
                kept[PASSED_ON_HEADER] = headers[HOP_HEADER]
                if not answer.content_type == "text/event-stream":
                    payload = await answer.read()
                    return Passed(web.Response(status=status, body=payload, headers=kept), named, status, time.monotonic(), payload)
                response = web.StreamResponse(status=answer.status, headers=kept)
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    first = first or time.monotonic()
                    tail.append(chunk)
                    if not await _written(request, response, chunk, queue.stall_timeout_s):
                        log.warning("a stream passed on to peer %s (node %s, serving '%s') was cut: its client took "
                                    "nothing for queue.stall_timeout_s=%g s", peer, node, model, queue.stall_timeout_s)
                        return Passed(response, named, CLIENT_CLOSED, first, b"")
                await response.write_eof()
                return Passed(response, named, status, first, b"".join(tail))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionResetError) as exc:
            if response is not None and (request.transport is None or request.transport.is_closing()):
                # The client went away mid-stream: leaving the block cut the peer's answer too.
                return Passed(response, named, CLIENT_CLOSED, first, b"")
            self.listings.forget(peer)
            if response is None:  # logged there, once while the problem lasts
                what = f"did not answer ({type(exc).__name__})"
                self.listings.of(peer).failed(f"a request passed on to it {what}", time.monotonic())
                raise APIError(502, f"The peer node '{node}' serving '{model}' {what}.", "peer_unreachable") from None
            what = f"failed mid-stream ({type(exc).__name__})"
            log.warning("peer %s (node %s, serving '%s') %s; the stream to the client is ended with an error event",
                        peer, node, model, what)
            await response.write(sse_error(f"The peer node '{node}' serving '{model}' {what}.", "peer_unreachable",
                                           status=502, anthropic=anthropic_path(path)))
            await response.write_eof()
            return Passed(response, named, status, first, b"")
        finally:
            self.passed_on[peer] -= 1

    # -- a paused answer finished on a peer (router.proxy.endpoint's Walk.migrate) ----------------

    async def awake_peer(self, request: web.Request, router, model: str) -> Optional[str]:
        """A peer where `model` is awake now (asked afresh) with a connection to spare, or None."""
        peers = router.roster.node.peer_urls()
        if not peers or HOP_HEADER in request.headers:
            return None
        digest, headers = _credential(_passed_on(request), anthropic=False)
        listings = await self.listings.read(self.session, peers, digest, headers, fresh=True)
        limit = router.roster.node.peer_connections
        return next((url for url, listing in listings.items() if listing is not None
                     and listing.models.get(model, (False, 0.0))[0] and self.passed_on[url] < limit), None)

    def _continuing(self, request: web.Request, router, peer: str, klass: str) -> tuple[str, dict[str, str]]:
        headers = {**_passed_on(request), CLASS_HEADER: klass, HOP_HEADER: card(router.roster)["name"],
                   "Content-Type": "application/json"}
        return self.listings.of(peer).node or "a peer", headers

    async def detokenize(self, request: web.Request, router, peer: str, model: str, ids: list[int]) -> str:
        """`ids` as text, by the peer's engine for `model` (the tokenizer that will continue the answer)."""
        node, headers = self._continuing(request, router, peer, INTERACTIVE)
        try:
            async with self.session.post(peer + "/detokenize", json={"model": model, "tokens": ids}, headers=headers,
                                         timeout=DETOKENIZE_TIMEOUT) as answer:
                text = (await answer.json(content_type=None)).get("prompt") if answer.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
            raise PeerFailed(f"peer node '{node}' did not decode the answer so far ({type(exc).__name__})") from None
        if not isinstance(text, str):
            raise PeerFailed(f"peer node '{node}' did not decode the answer so far (HTTP {answer.status})")
        return text

    async def continue_on(self, request: web.Request, router, peer: str, path: str, body: bytes, klass: str,
                          response: web.StreamResponse, splice) -> str:
        """Send a paused stream's continuation to `peer` and write its events, as `splice`
        (router.proxy.continuation.Splice) rewrites them, into the client's open `response`; the peer's node
        name. Raises PeerFailed, with `sent` True once any of it reached the client."""
        node, headers = self._continuing(request, router, peer, klass)
        queue = router.roster.queue
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S, sock_read=queue.max_wait_s + queue.stall_timeout_s)
        sent = False
        self.passed_on[peer] += 1
        try:
            async with self.session.post(peer + path, data=body, headers=headers, timeout=timeout) as answer:
                if answer.status != 200 or answer.content_type != "text/event-stream":
                    raise PeerFailed(f"peer node '{node}' answered the continuation with HTTP {answer.status}")
                node = answer.headers.get(NODE_HEADER, node)
                async for chunk in answer.content.iter_any():
                    out = splice([chunk])
                    if out:
                        sent = True
                        if not await _written(request, response, b"".join(out), queue.stall_timeout_s):
                            raise ConnectionResetError("the client took nothing of its stream for queue.stall_timeout_s")
                    if splice.ended:
                        break
                if rest := splice.flush():
                    await response.write(b"".join(rest))
                return node
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.listings.forget(peer)
            self.listings.of(peer).failed(f"a continuation passed on to it failed ({type(exc).__name__})", time.monotonic())
            raise PeerFailed(f"peer node '{node}' failed mid-answer ({type(exc).__name__})", sent) from None
        finally:
            self.passed_on[peer] -= 1

    async def _where(self, peers: list[str], model: str, credential: tuple[str, dict[str, str]], limit: int,
                     not_here: APIError) -> str:
        """The peer to send `model` to: awake there first, then the shortest predicted wake, among those with room."""
        digest, headers = credential
        listings = await self.listings.read(self.session, peers, digest, headers, fresh=False)
        if not any(listing is not None and model in listing.models for listing in listings.values()):
            # A miss: a peer may have gained the model since (a reload, an adapter loaded); ask again.
            listings = await self.listings.read(self.session, peers, digest, headers, fresh=True)
        having = [(not listing.models[model][0], listing.models[model][1], i, url)
                  for i, (url, listing) in enumerate(listings.items()) if listing is not None and model in listing.models]
        if not having:
            raise APIError(404, f"{not_here.message}. No peer of this node serves it either.", "model_not_found", param="model")
        room = [choice for choice in having if self.passed_on[choice[3]] < limit]
        if not room:
            nodes = ", ".join(f"'{self.listings.of(url).node or 'a peer'}'" for *_, url in having)
            raise APIError(503, f"The model '{model}' is served by peer node {nodes}, which already has {limit} requests "
                                "passed on from this node (node.peer_connections); retry shortly.", "peer_busy",
                           retry_after=BUSY_RETRY_AFTER_S)
        return min(room)[3]

    def status(self, roster: Roster) -> list[dict[str, Any]]:
        """Each peer as this node sees it, for /admin/status: where the details a client is not told are."""
        now = time.monotonic()
        out = []
        for url in roster.node.peer_urls():
            health = self.listings.of(url)
            skipped = health.skipped(now)
            out.append({"url": url, "node": health.node, "state": "skipped" if skipped else "asked",
                        "problem": health.problem, "failures": health.failures,
                        "asked_again_in_s": round(health.skip_until - now, 1) if skipped else None,
                        "passed_on": self.passed_on[url], "peer_connections": roster.node.peer_connections})
        return out


async def _written(request: web.Request, response: web.StreamResponse, chunk: bytes, stall_s: float) -> bool:
    """Write one chunk to the client; False (the connection cut) when the write waited `stall_s` for a client
    that takes nothing. Without it, a client that stops reading would hold its hand-off, and so one of the
    peer's node.peer_connections, for as long as it keeps the connection open."""
    try:
        async with asyncio.timeout(stall_s):
            await response.write(chunk)
        return True
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return False


def _passed_on(request: web.Request) -> dict[str, str]:
    """The client's headers a peer needs. aiohttp decodes headers as UTF-8 with surrogateescape, and its client
    cannot send such a value on: bytes that are not UTF-8 are refused here, as the peer would refuse them."""
    headers = {}
    for name in REQUEST_HEADERS:
        value = request.headers.get(name)
        if value is None:
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            if name in CREDENTIALS:  # no key is such bytes (router/auth.py compares the bytes as sent)
                raise APIError(401, f"Invalid API key: the {name} header is not UTF-8 text, and no key is.",
                               "invalid_api_key") from None
            raise APIError(400, f"The {name} header is not UTF-8 text.", "invalid_header") from None
        headers[name] = value
    return headers


def _credential(headers: dict[str, str], anthropic: bool) -> tuple[str, dict[str, str]]:
    """The client's key as the peer's /v1/models takes it (Bearer), the one its auth reads on this route (the
    anthropic SDK sends x-api-key), and a digest to cache the listing under."""
    if "x-api-key" in headers and (anthropic or "Authorization" not in headers):
        auth = f"Bearer {headers['x-api-key']}"
    else:
        auth = headers.get("Authorization", "")
    return hashlib.sha256(auth.encode()).hexdigest(), ({"Authorization": auth} if auth else {})


PEERS_KEY = web.AppKey("peers", Peers)
