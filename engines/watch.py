"""Watching an engine while it serves. Neither watch acts on its own: a collapse sets
`gate.needs_restart` for the scheduler, and an engine found unhealthy is FAILED, which the
scheduler handles like any other failure.

Here, not in engines/gate/: this module acts on the Engine (reads it, fails it, tells its
observer), and engine.py imports the gate; the judging itself is the gate record's.

- acceptance: over a sliding window (gate.MidlifeWatch), because a draft can collapse mid-life,
  after its gate passed: from the numbers served answers carry (`answered`, fed by the proxy)
  (the proxy reads them once, for the activity log too) where they carry them, else from the
  spec-decode counters.
- suspect: a proxied answer broke off. One broken connection does not justify a cold restart
  (minutes on a GPU), but vLLM keeps its API server up after its engine core died, and then
  only /health tells.
"""

from __future__ import annotations

import asyncio
import logging

from engines.engine import Engine, State
from engines.gate import read_counters
from engines.vllm import EngineError, VLLMClient
from engines.waking.handshake import HEALTH_CALL_S

log = logging.getLogger("hotswap")


async def acceptance(engine: Engine) -> None:
    """Sample the spec-decode counters for the acceptance window (served traffic only); the gate
    record judges them (engines.gate.record)."""
    if engine.state is not State.AWAKE or not engine.has_draft or not engine.gate.watching:
        return
    counters = read_counters(await engine.client.metrics(timeout=engine.swap.timeouts.gate))
    collapse = engine.gate.observe(counters)
    if collapse is not None:
        log.error("engine %s: acceptance collapsed while serving: %s", engine.name, collapse)
        engine.observer.midlife_collapse(engine, engine.gate.observed_mal, collapse)


def answered(engine: Engine, steps: int, accepted: int) -> None:
    """A served answer's own speculative-decoding counts (the proxy read them from its end), for the
    acceptance window."""
    if engine.has_draft:
        engine.gate.answered(steps, accepted)


def suspect(engine: Engine, why: str) -> None:
    """Ask the engine's /health once (at most one probe at a time); FAILED if it is not healthy."""
    if engine.state is State.AWAKE and engine.client is not None and (engine.probe is None or engine.probe.done()):
        engine.probe = asyncio.create_task(_probe_health(engine, engine.client, why), name=f"probe:{engine.name}")


async def _probe_health(engine: Engine, client: VLLMClient, why: str) -> None:
    try:
        await client.health(timeout=HEALTH_CALL_S)
    except EngineError as exc:
        if engine.state is State.AWAKE:
            engine.fail(f"unhealthy after an answer broke off ({why}): {exc}")
    else:
        log.warning("engine %s: an answer broke off (%s); /health answers ok, so it keeps serving", engine.name, why)
