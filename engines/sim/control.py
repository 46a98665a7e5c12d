"""Test control over the simulated engine: injected faults, step delays, call log.

This is the part of the simulator that real vLLM does not have. Every dev endpoint
and generation passes through `Control.enter(step)` before it acts, so tests can
make any step slow, hang, fail or kill the process, and can read back the order in
which the router called the steps.

Fault kinds. Each fires when the step is entered, before it acts, and the call shows
in /sim/log with `"fault": KIND`, even for steps whose plain calls are not logged
(after a crash, the log is gone with the process).

- `crash`: the process exits 1 at once, as a segfaulting worker does; nobody is answered.
- `hang`: the step never answers; the rest of the server keeps serving.
- `http500`: a 500 in vLLM's error shape.
- `malformed`: a 200 whose body breaks the protocol, as from a buggy proxy or
  serialiser. `metrics`: exposition text with a non-numeric sample value, which a
  Prometheus parser rejects. Any other step: a truncated JSON object (`{"id": "cmpl-`)
  under `application/json`. A generation asked to stream gets a well-framed
  `text/event-stream` whose one data event is that truncated JSON, then `[DONE]`.
- `cut`: the connection drops without an answer (the client sees the server
  disconnect). A generation asked to stream first gets max(1, max_tokens // 2) token
  chunks (after a chat stream's role chunk), or all but its last if it stops sooner:
  no finish_reason, no `[DONE]`, no terminating chunk, so the client sees an
  incomplete body. Unlike `crash`, the process lives on. Clients retry some
  disconnects by themselves (aiohttp an idempotent GET once, the openai SDK any
  request up to max_retries), so one cut may go unseen: set `times` to match.

`boot` has no HTTP answer, so it takes only crash, hang and http500 (a failed boot).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass

STEPS = (
    "boot",
    "sleep",
    "release_kv_cache_memory",
    "wake",
    "stage",
    "wake_weights",
    "wake_kv_cache",
    "reload_weights",
    "reload_draft",
    "reset_prefix_cache",
    "generate",
    "metrics",
    "health",  # http500 here is vLLM's answer once its engine core has died under a live API server
)
# A step whose cost depends on its argument takes a delay of its own under these names (never a
# fault): a Level-1 sleep copies the weights out to host RAM, a Level-2 sleep only drops them.
DELAY_VARIANTS = ("sleep_level0", "sleep_level1", "sleep_level2")
FAULT_KINDS = ("crash", "hang", "http500", "malformed", "cut")
BOOT_KINDS = ("crash", "hang", "http500")

# Steps the router polls in a loop would bury the wake order the log exists for.
UNLOGGED_STEPS = frozenset({"metrics", "health", "boot"})

log = logging.getLogger("vllm.sim")


class InjectedFault(Exception):
    """The step must answer with the fault (http500, malformed or cut) instead of acting;
    the HTTP layer carries it out, as it knows what the step would have answered."""

    def __init__(self, step: str, kind: str) -> None:
        super().__init__(f"injected {kind} at step {step}")
        self.step, self.kind = step, kind


@dataclass
class Fault:
    step: str
    kind: str
    times: int | None = None  # None: fires on every call until cleared

    def __post_init__(self) -> None:
        if self.step not in STEPS:
            raise ValueError(f"unknown step {self.step!r}; steps: {', '.join(STEPS)}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; kinds: {', '.join(FAULT_KINDS)}")
        if self.step == "boot" and self.kind not in BOOT_KINDS:
            raise ValueError(f"boot has no HTTP answer to break; kinds at boot: {', '.join(BOOT_KINDS)}")
        if self.times is not None and (not isinstance(self.times, int) or self.times < 1):
            raise ValueError("times must be a positive integer or null")


def crash(reason: str) -> None:
    """Die like a segfaulting worker: no cleanup, no goodbye to clients."""
    print(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [sim] {reason}; exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


async def hang_forever() -> None:
    await asyncio.Event().wait()


class Control:
    def __init__(self, delays: dict[str, float], faults: list[Fault], log_limit: int = 10000) -> None:
        self.delays = dict(delays)
        self.faults = list(faults)
        self.calls: collections.deque[dict] = collections.deque(maxlen=log_limit)

    def record(self, step: str, query: dict | None = None, *, force: bool = False, **extra: object) -> dict | None:
        if step in UNLOGGED_STEPS and not force:
            return None
        entry = {"step": step, "t": time.monotonic(), "query": query or {}, **extra}
        self.calls.append(entry)
        return entry

    def take_fault(self, step: str) -> Fault | None:
        for i, f in enumerate(self.faults):
            if f.step == step:
                if f.times is not None:
                    f.times -= 1
                    if f.times == 0:
                        del self.faults[i]
                return f
        return None

    async def enter(self, step: str, query: dict | None = None, *, variant: str | None = None, **extra: object) -> None:
        """Log the call, then apply the step's delay (`variant`'s, one of DELAY_VARIANTS, when set)
        and fault (in that order, so a hung or failed step still shows in the log as called)."""
        entry = self.record(step, query, **extra)
        delay = self.delays.get(variant or step, self.delays.get(step, 0.0))
        if delay > 0:
            await asyncio.sleep(delay)
        fault = self.take_fault(step)
        if fault is None:
            return
        # A fault is always logged: a test must see that its fault fired, polled step or not.
        if entry is None:
            entry = self.record(step, query, force=True, **extra)
        entry["fault"] = fault.kind
        log.warning("injected fault at step %s: %s", step, fault.kind)
        if fault.kind == "crash":
            crash(f"injected crash at step {step}")
        elif fault.kind == "hang":
            await hang_forever()
        else:
            raise InjectedFault(step, fault.kind)

    def faults_json(self) -> list[dict]:
        return [asdict(f) for f in self.faults]
