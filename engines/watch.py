"""Watching an engine while it serves. Neither watch acts on its own: a collapse sets
`needs_restart` for the group's scheduler, and an engine found unhealthy is FAILED, which the
scheduler handles like any other failure.

- acceptance: over a sliding window (gate.MidlifeWatch), because a draft can collapse mid-life,
  after its gate passed: from the numbers served answers carry (`answered`, fed by the proxy)
  where they carry them, else from the spec-decode counters.
- suspect: a proxied answer broke off. One broken connection does not justify a cold restart
  (minutes on a GPU), but vLLM keeps its API server up after its engine core died, and then
  only /health tells.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engines.gate import canary
from engines.vllm.client import EngineError, VLLMClient
from engines.engine import Engine, State
from engines.handshake import HEALTH_CALL_S

log = logging.getLogger("hotswap")


async def acceptance(engine: Engine) -> None:
    """Sample the spec-decode counters; flag a collapse over the window (served traffic only)."""
    baseline = engine.baseline
    if engine.state is not State.AWAKE or not engine.has_draft or baseline is None or baseline.mal is None:
        return
    counters = canary.read_counters(await engine.client.metrics(timeout=engine.swap.timeouts.gate))
    was_collapsed = engine.midlife.collapsed
    mal, problems = engine.midlife.observe(time.monotonic(), counters, baseline.mal)
    if mal is not None:
        engine.observed_mal, engine.observed_mal_source = mal, engine.midlife.source
    if not problems:
        engine.needs_restart = None  # recovered before the restart began: nothing to remedy
    elif not was_collapsed:
        reason = "; ".join(problems)
        log.error("engine %s: acceptance collapsed while serving: %s", engine.name, reason)
        engine.observer.midlife_collapse(engine, mal, reason)
        if engine.spec.gate.on_midlife == "restart":
            engine.needs_restart = reason


def answered(engine: Engine, payload: bytes) -> None:
    """A served answer (a buffered body, or a stream's last bytes): its own acceptance numbers, if it
    has them, go to the engine's window. A substring search, and a parse of the metrics object alone."""
    if engine.has_draft:
        counts = canary.answer_spec_counts(payload)
        if counts is not None:
            engine.midlife.answered(time.monotonic(), *counts)


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
