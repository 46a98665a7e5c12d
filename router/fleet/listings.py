"""What each peer's /v1/models says, asked as seldom as possible and never trusted blindly.

A listing is asked with the client's key (a scoped key sees fewer models) and kept per (peer,
key digest) for `LIST_TTL_S`; a miss asks again if it is older than `REFRESH_GAP_S`. Concurrent
askers of one (peer, key) share one fetch in flight: a storm of unknown models opens one
connection per peer, not one per request. A peer that fails (no answer within `LIST_TIMEOUT`,
an error status, or a listing that is not a model list) is skipped, without being asked, for a
backoff that doubles up to `BACKOFF_MAX_S` while it keeps failing, and then asked again in the
background: no request waits for a peer that has failed. A black-holed peer costs the misses
that arrive during its first fetch that fetch's timeout; every miss after it answers at once. Its failure is logged once
(its URL and what was wrong) and shown in /admin/status; a client never sees a peer's address.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

LIST_TTL_S = 10.0  # a peer's model list is reused this long
REFRESH_GAP_S = 1.0  # a miss asks a peer again, but not more often than this
LIST_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
BACKOFF_S = 5.0  # a failed peer is not asked for this long after its first failure, doubling after each further one
BACKOFF_MAX_S = 60.0
MAX_LISTINGS = 512  # (peer, key) pairs remembered
log = logging.getLogger("hotswap")


class _Node(BaseModel):
    name: Optional[str] = None


class _Card(BaseModel):
    """The fields of a model card (router/proxy/readonly.py) a hand-off decides on; the rest is ignored."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1)
    state: Optional[str] = None
    wake_estimate_s: Optional[float] = Field(None, ge=0)
    node: Optional[_Node] = None


class _ModelList(BaseModel):
    model_config = ConfigDict(extra="ignore")
    data: list[_Card]


@dataclass
class Listing:
    """One peer's models for one key: model -> (awake, wake_estimate_s), and the peer's node name."""

    at: float  # when it landed
    models: dict[str, tuple[bool, float]]
    node: Optional[str] = None


def parse(body: bytes) -> Listing:
    """A peer's /v1/models answer as a Listing; anything else raises pydantic's ValidationError, and nothing else."""
    cards = _ModelList.model_validate_json(body).data
    return Listing(time.monotonic(), {c.id: (c.state == "awake", c.wake_estimate_s or 0.0) for c in cards},
                   next((c.node.name for c in cards if c.node is not None and c.node.name), None))


@dataclass
class PeerHealth:
    """Whether a peer is asked, and what went wrong with it last (for the log and /admin/status)."""

    url: str
    failures: int = 0  # in a row
    skip_until: float = 0.0
    problem: Optional[str] = None
    node: Optional[str] = None  # its name, once a listing said it

    def skipped(self, now: float) -> bool:
        return self.failures > 0 and now < self.skip_until

    def failed(self, problem: str, now: float) -> None:
        self.failures += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** min(self.failures - 1, 16))  # 2 ** 1024 is an OverflowError
        self.skip_until = now + backoff
        if problem != self.problem:  # once per problem, however often it is asked while it lasts
            log.warning("peer %s: %s; it is skipped (asked again after %g s, backing off to %g s while it fails)",
                        self.url, problem, backoff, BACKOFF_MAX_S)
        self.problem = problem

    def answered(self) -> None:
        if self.failures:
            log.info("peer %s answers a well-formed /v1/models again; requests are passed on to it", self.url)
        self.failures, self.problem = 0, None


class Listings:
    def __init__(self) -> None:
        self._listings: dict[tuple[str, str], Listing] = {}
        self._fetching: dict[tuple[str, str], asyncio.Future[Optional[Listing]]] = {}
        self.health: dict[str, PeerHealth] = {}

    def of(self, url: str) -> PeerHealth:
        return self.health.setdefault(url, PeerHealth(url))

    async def read(self, session: aiohttp.ClientSession, peers: list[str], digest: str, headers: dict[str, str],
                   fresh: bool) -> dict[str, Optional[Listing]]:
        """Each peer's listing for this key (None: skipped, or it failed now), no older than the TTL (`fresh`: the gap)."""
        max_age = REFRESH_GAP_S if fresh else LIST_TTL_S
        found = await asyncio.gather(*(self._one(session, url, digest, headers, max_age) for url in peers))
        if len(self._listings) > MAX_LISTINGS:
            now = time.monotonic()
            self._listings = {k: v for k, v in self._listings.items() if now - v.at < LIST_TTL_S}
        return dict(zip(peers, found))

    async def _one(self, session: aiohttp.ClientSession, url: str, digest: str, headers: dict[str, str],
                   max_age: float) -> Optional[Listing]:
        health, key = self.of(url), (url, digest)
        known = self._listings.get(key)
        if known is not None and time.monotonic() - known.at < max_age:
            return known
        fetch = self._fetching.get(key)
        if fetch is None and not health.skipped(time.monotonic()):
            fetch = self._fetching[key] = asyncio.ensure_future(self._fetch(session, url, digest, headers))
            fetch.add_done_callback(lambda _: self._fetching.pop(key, None))
        if fetch is None or health.failures:
            return None  # a failing peer is asked again in the background (once its backoff is due); nobody waits for it
        # Shielded: a client that leaves does not cancel the fetch the other askers wait for.
        return await asyncio.shield(fetch)

    async def _fetch(self, session: aiohttp.ClientSession, url: str, digest: str, headers: dict[str, str]) -> Optional[Listing]:
        health, problem = self.of(url), ""
        try:
            async with session.get(url + "/v1/models", headers=headers, timeout=LIST_TIMEOUT) as answer:
                if answer.status in (401, 403):  # this key opens nothing there: a fact about the key, not the peer
                    listing: Optional[Listing] = Listing(time.monotonic(), {})
                elif answer.status != 200:
                    problem = f"its /v1/models answered HTTP {answer.status}"
                    listing = None
                else:
                    listing = parse(await answer.read())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the body"
            more = f"; {exc.error_count() - 1} more" if exc.error_count() > 1 else ""
            problem = f"its /v1/models is not a model list ({where}: {first['msg']}{more})"
            listing = None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            problem = f"its /v1/models did not answer within {LIST_TIMEOUT.total:g} s ({type(exc).__name__})" \
                if isinstance(exc, asyncio.TimeoutError) else f"its /v1/models did not answer ({type(exc).__name__}: {exc})"
            listing = None
        if listing is None:
            self.forget(url)
            health.failed(problem, time.monotonic())
            return None
        health.answered()
        health.node = listing.node or health.node
        self._listings[(url, digest)] = listing
        return listing

    def forget(self, url: str) -> None:
        """Drop what `url` said, for every key: it is asked afresh once it is asked at all."""
        self._listings = {k: v for k, v in self._listings.items() if k[0] != url}
