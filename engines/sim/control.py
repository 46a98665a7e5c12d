"""Test control over the simulated engine: injected faults, step delays, call log.

This is the part of the simulator that real vLLM does not have. Every dev endpoint
and generation passes through `Control.enter(step)` before it acts, so tests can
make any step slow, hang, fail or kill the process, and can read back the order in
which the router called the steps.
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
    "wake",
    "wake_weights",
    "wake_kv_cache",
    "reload_weights",
    "reload_draft",
    "reset_prefix_cache",
    "generate",
    "metrics",
)
FAULT_KINDS = ("crash", "hang", "http500")

# Steps the router polls in a loop would bury the wake order the log exists for.
UNLOGGED_STEPS = frozenset({"metrics", "boot"})

log = logging.getLogger("vllm.sim")


class InjectedHTTP500(Exception):
    """The step must answer 500 without acting."""


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

    def record(self, step: str, query: dict | None = None, **extra: object) -> None:
        if step not in UNLOGGED_STEPS:
            self.calls.append({"step": step, "t": time.monotonic(), "query": query or {}, **extra})

    def take_fault(self, step: str) -> Fault | None:
        for i, f in enumerate(self.faults):
            if f.step == step:
                if f.times is not None:
                    f.times -= 1
                    if f.times == 0:
                        del self.faults[i]
                return f
        return None

    async def enter(self, step: str, query: dict | None = None, **extra: object) -> None:
        """Log the call, then apply the step's delay and fault (in that order, so a
        hung or failed step still shows in the log as called)."""
        self.record(step, query, **extra)
        delay = self.delays.get(step, 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        fault = self.take_fault(step)
        if fault is None:
            return
        log.warning("injected fault at step %s: %s", step, fault.kind)
        if fault.kind == "crash":
            crash(f"injected crash at step {step}")
        elif fault.kind == "hang":
            await hang_forever()
        else:
            raise InjectedHTTP500(f"injected http500 at step {step}")

    def faults_json(self) -> list[dict]:
        return [asdict(f) for f in self.faults]
