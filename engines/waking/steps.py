"""The staged wake, written once. The engine runs these steps; metrics, tests and benchmarks
read their phase names from here, so a new step is added in exactly one place.

Level 2 (weights discarded at sleep), in this order:
  0. stage               collective_rpc hotswap_stage_weights (engines that load the worker
                         extension): joins a stage already running (begun while the victims
                         drained and slept, or in the background within host.page_cache_budget_gb),
                         so the reloads below read RAM, not the disk; else it only looks (mincore),
                         since reading first and then reloading costs more than the reload reading
                         the disk itself (docs/benchmarks.md: 1.41x on vLLM). Never fails the wake:
                         a failed or timed-out stage is logged once and the wake goes on.
  1. wake_weights        POST /wake_up?tags=weights
  2. reload_draft        collective_rpc hotswap_reload_draft (only with draft_restore: reload) —
                         draft first, so the target reload after it stays authoritative for
                         shared tensors
  3. reload_weights      collective_rpc reload_weights (the target, from disk)
  4. wake_kv_cache       POST /wake_up?tags=kv_cache
  5. reset_prefix_cache  POST /reset_prefix_cache, retried while it answers success=false
Level 1 (weights kept in host RAM): POST /wake_up (timed as wake_kv_cache), reset_prefix_cache.
Level 0, KV-parked (weights on the GPU, KV cache released; engines/waking/ladder.py):
  1. wake_kv_cache       POST /wake_up?tags=kv_cache, which must answer status "awake": vLLM 0.32
                         re-maps the KV cache's memory (device_allocator/cumem.py:331 `wake_up`,
                         contents undefined) and resumes its scheduler only once nothing sleeps any
                         more (v1/engine/core.py:997-1019); "sleeping" would leave requests hanging
  2. reset_prefix_cache  as above: the re-mapped pages hold garbage, a cached prefix must not
                         point into them. The gate still runs after it: a KV fault (vLLM #44972,
                         undefined KV pages after a wake) is what its logprob check catches.

Each step is `run(client, timeout)`; `swap.timeouts.<phase>` bounds it. A step with `fatal=False`
(only `stage`) is timed like the others (its phase; its failures counted apart, hotswap_stage_failures_total):
its failure is the wake's loss of a speed-up, not the wake's failure.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from engines.vllm import EngineError, VLLMClient


@dataclass(frozen=True)
class Step:
    phase: str
    run: Callable[[VLLMClient, float], Awaitable[Any]]
    fatal: bool = True


async def stage_weights(client: VLLMClient, timeout: float, read: bool = True) -> dict[str, Any]:
    """The worker extension's report ({files, bytes, read_bytes, seconds, resident_before}) of the
    rank that read (the others skip: the page cache is the host's); `read=False`: it only looks."""
    results = await client.collective_rpc("hotswap_stage_weights", timeout=timeout, kwargs=None if read else {"read": False})
    reports = [r for r in results if isinstance(r, dict) and not r.get("skipped")]
    if not reports:
        raise EngineError("POST /collective_rpc hotswap_stage_weights", f"no worker staged: {results!r:.300}")
    return reports[0]


async def reload_draft(client: VLLMClient, timeout: float) -> list[Any]:
    results = await client.collective_rpc("hotswap_reload_draft", timeout=timeout)
    # Every worker holds a shard of the draft: one that did not reload leaves the draft broken.
    if not results or not all(isinstance(r, dict) and r.get("reloaded") is True for r in results):
        raise EngineError("POST /collective_rpc hotswap_reload_draft", f"not every worker reloaded its draft: {results}")
    return results


async def reset_prefix_cache(client: VLLMClient, timeout: float) -> None:
    # vLLM answers success=false while blocks are still held; they free up shortly.
    deadline = time.monotonic() + timeout
    delay = 0.02
    while not await client.reset_prefix_cache(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() + delay > deadline:
            raise EngineError("POST /reset_prefix_cache", f"still answering success=false after {timeout:g} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


STAGE = Step("stage", stage_weights, fatal=False)
LEVEL2 = (
    Step("wake_weights", lambda client, t: client.wake_up(["weights"], timeout=t)),
    Step("reload_draft", reload_draft),
    Step("reload_weights", lambda client, t: client.collective_rpc("reload_weights", timeout=t)),
    Step("wake_kv_cache", lambda client, t: client.wake_up(["kv_cache"], timeout=t)),
    Step("reset_prefix_cache", reset_prefix_cache),
)
async def wake_kv_cache(client: VLLMClient, timeout: float) -> Any:
    answer = await client.wake_up(["kv_cache"], timeout=timeout)
    if isinstance(answer, dict) and answer.get("status") not in (None, "awake"):
        raise EngineError("POST /wake_up?tags=kv_cache", f"the engine is still asleep after its KV cache's wake: {answer}")
    return answer


LEVEL0 = (
    Step("wake_kv_cache", wake_kv_cache),
    Step("reset_prefix_cache", reset_prefix_cache),
)
LEVEL1 = (
    Step("wake_kv_cache", lambda client, t: client.wake_up((), timeout=t)),
    Step("reset_prefix_cache", reset_prefix_cache),
)

# Every phase a swap can report, in the order a swap goes through them (metric labels, status).
PHASES = ("drain", "sleep", "release_kv_cache", STAGE.phase, *(s.phase for s in LEVEL2), "gate")


def steps(level: int, draft_restore: str, stages: bool = True, drill: bool = False) -> tuple[Step, ...]:
    """The wake steps for an engine asleep at `level` whose draft is restored per `draft_restore`;
    `stages`: it loads the worker extension, so a Level-2 wake stages its checkpoint first.
    `drill`: an operator's drill (POST /admin/drill, `hotswap trial --drill`): this one wake leaves
    out reload_draft on purpose, so the draft comes back as vLLM #52479 leaves it and the gate is seen
    to refuse it."""
    if level == 0:
        return LEVEL0
    if level == 1:
        return LEVEL1
    restores = draft_restore == "reload" and not drill
    return (STAGE,) * stages + tuple(s for s in LEVEL2 if s.phase != "reload_draft" or restores)


def phases(level: int, draft_restore: str, stages: bool = True) -> list[str]:
    return [s.phase for s in steps(level, draft_restore, stages)]
