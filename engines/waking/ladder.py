"""The sleep ladder: the rungs an engine may be parked on, and the steps down to each, written once
(the engine runs them, as it runs `engines.waking.steps`'s steps back up).

  awake -> level 0, KV-parked -> level 1 -> level 2

Level 0 is vLLM 0.32's own name (read in vllm/v1/engine/core.py of the CPU tier's venv):
  - `POST /sleep?level=0` (entrypoints/serve/dev/sleep/api_router.py:26-34, `Query(ge=0, le=2)`)
    only pauses the scheduler: core.py:959-976 `sleep` returns after `pause_scheduler` for a
    level below 1, with "No GPU memory changes" and the prefix cache kept.
  - `POST /release_kv_cache_memory` (api_router.py:37-41) then frees the KV cache: core.py:1021-1039
    resets the caches and has the executor discard the allocations tagged `kv_cache`, the pool the
    GPU worker allocates the KV cache in (v1/worker/gpu_worker.py:885): v1/executor/abstract.py:419
    `discard` -> v1/worker/gpu_worker.py:358 -> the cumem allocator's `discard`,
    device_allocator/cumem.py:300: unmapped, no host copy. It refuses (a 500 from the engine core's
    utility call, after which uvicorn drops the connection: engines.vllm sends it unpooled) unless a
    pause has completed with no request left, and while any executor memory already sleeps: so it
    runs once, right after the level-0 sleep.
  - Its wake is `POST /wake_up?tags=kv_cache` (engines.waking.steps.LEVEL0): a KV re-allocation, no weight
    copy. vLLM resumes scheduling only when no tag sleeps any more (core.py:1012-1018).
  - From level 0 an engine can go further down without waking: `POST /sleep?level=N` skips the
    allocations already discarded (cumem.py:257-262) and offloads (1) or drops (2) the weights.
On the CPU backend the worker's `discard` raises "Selective discard is not supported on CPU"
(v1/worker/cpu_worker.py:187-188): there the release fails, which the CPU tier's tests record.

What each rung keeps on the GPU (router.scheduling.placement counts it): level 0 its weights and
its residual; levels 1 and 2 the residual only.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from engines.vllm import VLLMClient
from engines.waking.steps import Step

KV_PARKED = 0  # the level at which only the KV cache is released
SleepPolicy = Union[Literal["auto"], int]


def rungs(policy: SleepPolicy) -> tuple[int, ...]:
    """The levels a roster entry's `sleep_level` lets an engine be parked at, shallowest first
    (`auto`: the whole ladder, chosen per park; a number: that level alone)."""
    return (KV_PARKED, 1, 2) if policy == "auto" else (int(policy),)


def down(level: int, mode: str) -> tuple[Step, ...]:
    """The steps that park an awake, drained engine at `level` (`mode`: vLLM's pause mode)."""
    sleep = Step("sleep", lambda client, t: client.sleep(level, mode, timeout=t))
    if level == KV_PARKED:
        return sleep, Step("release_kv_cache", release_kv_cache)
    return (sleep,)


def further(level: int) -> tuple[Step, ...]:
    """The steps that take a KV-parked engine down to `level` (1 or 2) without waking it: nothing
    runs on it, so there is nothing to wait for."""
    return (Step("sleep", lambda client, t: client.sleep(level, "wait", timeout=t)),)


async def release_kv_cache(client: VLLMClient, timeout: float) -> Any:
    return await client.release_kv_cache_memory(timeout=timeout)
