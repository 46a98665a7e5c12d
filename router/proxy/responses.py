"""Which engine created which Responses id, so that retrieve and cancel (and a follow-up's
`previous_response_id`) reach the engine whose in-process store holds that response.

Bounded (oldest forgotten first) and with expiry: vLLM's own store never forgets, but the
router must not grow without bound. A forgotten id is a 404 in OpenAI's shape, the same
answer the engine gives for an id it does not know.
"""

from __future__ import annotations

import collections
import json
import re
import time
from typing import Any, Callable, NamedTuple, Optional

from aiohttp import web

from engines.engine import Engine
from router.auth import grant_of
from router.keys import Grant

MAX_IDS = 100_000
TTL_S = 24 * 3600.0
SNIFF_LIMIT = 64 * 1024  # the id is in the first event (response.created); never look further

# The first "id" in a Responses answer or stream is the response's own (its output items
# come later, inside it), whatever the key order of the serializer.
_FIRST_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')


class Pin(NamedTuple):
    engine: str  # the roster name of the engine that holds the response
    model: str  # the name the creating request used (a LoRA adapter's, say): what a key's scope is checked against


class ResponseIds:
    def __init__(self, max_ids: int = MAX_IDS, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic):
        self.max_ids, self.ttl_s, self.clock = max_ids, ttl_s, clock
        self._ids: collections.OrderedDict[str, tuple[Pin, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, response_id: str, engine_name: str, model: Optional[str] = None) -> None:
        self._ids[response_id] = (Pin(engine_name, model or engine_name), self.clock() + self.ttl_s)
        self._ids.move_to_end(response_id)
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def pin(self, response_id: str) -> Optional[Pin]:
        entry = self._ids.get(response_id)
        if entry is None:
            return None
        if entry[1] < self.clock():
            del self._ids[response_id]
            return None
        return entry[0]

    def engine_of(self, response_id: str) -> Optional[str]:
        pin = self.pin(response_id)
        return pin.engine if pin is not None else None


def id_in_answer(payload: bytes) -> Optional[str]:
    try:
        answer = json.loads(payload)
    except (ValueError, RecursionError):  # vLLM echoes a client's tools and metadata, nested as the client wrote them
        return None
    rid = answer.get("id") if isinstance(answer, dict) else None
    return rid if isinstance(rid, str) and rid else None


class StreamSniffer:
    """Finds the response id in the first bytes of a Responses stream, then stays out of the way."""

    def __init__(self, found: Callable[[str], None]):
        self.found = found
        self.buffer = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        match = _FIRST_ID.search(self.buffer)
        if match:
            self.found(match.group(1).decode("utf-8", "replace"))
        if match or len(self.buffer) > SNIFF_LIMIT:
            self.done, self.buffer = True, b""


# -- the engine a Responses request goes to, and how its answer's id is remembered -------------------

RESPONSE_IDS_KEY = web.AppKey("response_ids", ResponseIds)


def engine_for(request: web.Request, router, body: dict[str, Any], creates_response: bool) -> tuple[Engine, str]:
    """The engine for a request's `model` (Router.resolve); a Responses follow-up's, where its conversation lives."""
    model = body.get("model")
    if creates_response and (model is None or model in router.virtuals):
        # A follow-up without a model continues where its conversation lives, under the name it was started with;
        # one by a virtual name, on the member that holds the conversation (another member never saw it).
        previous = body.get("previous_response_id")
        pin = request.app[RESPONSE_IDS_KEY].pin(previous) if isinstance(previous, str) else None
        engine = pinned_engine(router, pin, grant_of(request))
        if engine is not None and pin is not None and (model is None or router.virtuals.reaches(grant_of(request), model, engine)):
            return engine, pin.model
    return router.resolve(model, grant_of(request))


def pinned_engine(router, pin: Optional[Pin], grant: Grant) -> Optional[Engine]:
    """The engine a response was pinned to, unless it has left the roster or `grant` may not use it
    under the name the response was created with (the same check as resolution's)."""
    engine = router.engines.get(pin.engine) if pin is not None else None
    if engine is None or pin is None or engine.retiring:
        return None
    if not (grant.allows(engine, pin.model) or router.virtuals.reaches(grant, pin.model, engine)):
        return None
    return engine


def pinning(request: web.Request, engine: Engine, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """forward()'s arguments that remember the id of the response `engine` creates."""
    ids = request.app[RESPONSE_IDS_KEY]

    def remember(response_id: str) -> None:
        ids.remember(response_id, engine.name, name)

    if body.get("stream") is True:
        return {"sniffer": StreamSniffer(remember)}
    return {"on_answer": lambda payload: (rid := id_in_answer(payload)) and remember(rid)}
