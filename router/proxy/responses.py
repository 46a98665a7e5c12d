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
from typing import Callable, NamedTuple, Optional

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
