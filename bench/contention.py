"""How much of a trace's waiting no swap policy can avoid: requests that arrive while the streams
of other models on their GPU already hold more than the GPU leaves for theirs.

Each request streams for its output tokens at its model's decode rate (the trace's own lengths,
nobody waiting). A request is *blocked* when its model's share plus the shares of the other models
streaming on a GPU it uses at that moment exceed the GPU: however it was parked or woken, either
it waits, or one of those streams is cut or its model's next request waits for a re-wake. `clear_s`
is how long until enough of those streams end for its model to fit, before any wake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol


class Request(Protocol):
    t: float
    model: str
    tokens: int


class Placed(Protocol):
    devices: tuple[int, ...]
    share: float
    tok_s: float


@dataclass(frozen=True)
class Blocked:
    request: int  # its index in the trace
    clear_s: float  # until enough of the streams in its way end


def blocked(trace: list[Request], models: dict[str, Placed], counted: Iterable[int]) -> list[Blocked]:
    streams = [(r.t, r.t + r.tokens / models[r.model].tok_s, r.model) for r in trace]
    out = []
    for i in counted:
        r, mine = trace[i], models[trace[i].model]
        ends: dict[str, float] = {}  # model -> when its last stream running at r.t ends
        for start, end, name in streams:
            if name != r.model and start < r.t < end and set(models[name].devices) & set(mine.devices):
                ends[name] = max(end, ends.get(name, 0.0))
        for device in mine.devices:
            here = sorted((end, models[name].share) for name, end in ends.items() if device in models[name].devices)
            over = mine.share + sum(share for _, share in here) - 1.0
            if over <= 1e-9:
                continue
            for end, share in here:
                over -= share
                if over <= 1e-9:
                    out.append(Blocked(i, end - r.t))
                    break
            break
    return out
