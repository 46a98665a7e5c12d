"""Staging one engine's checkpoint into the page cache (the `stage` phase of a Level-2 wake, engines.waking.steps).

A stage is `collective_rpc hotswap_stage_weights`: the worker extension reads the files vLLM's loader
reads (engines/vllm_worker/staging.py). It may start before the wake: while the victims that make
room for it drain and sleep, or in the background within host.page_cache_budget_gb (the scheduler
decides, router/scheduling/staging.py). At most one stage per engine runs at a time; a wake joins
the one running rather than reading the files twice. A stage never fails anything: whatever goes
wrong is logged once, with the reason, and the next reload reads the disk.

A sleeping engine answers it: vLLM 0.32's engine core dispatches a utility call (collective_rpc) in
whatever state it is (`_handle_client_request`, vllm/v1/engine/core.py:1687), one at a time in its busy
loop, so a reload sent while a stage reads waits for it.

Only engines the router started with the worker extension stage (engines.process `loads_extension`):
any other engine would answer an AttributeError 500 and close its connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from engines.vllm import EngineError, VLLMClient
from engines.waking.steps import stage_weights

log = logging.getLogger("hotswap")

RESIDENT = 0.98  # a checkpoint this resident before a stage counts as staged (a few pages always go)


class Stager:
    """One engine's stages: the one in flight, and what the last one found and did."""

    def __init__(self, name: str, enabled: bool):
        self.name = name
        self.enabled = enabled  # its process loads the worker extension (engines.process `loads_extension`)
        self.task: Optional[asyncio.Task[Optional[dict[str, Any]]]] = None
        self.last: Optional[dict[str, Any]] = None  # the last report (None: none since the last reload)
        self.done_at: Optional[float] = None  # time.monotonic() of the last successful stage
        self.failure: Optional[str] = None  # why the last stage did not stage
        self.why: str = ""  # why the running stage was begun ("room", "ahead", "wake")
        self.found_resident = False  # the last wake's stage found the checkpoint already in the page cache
        self.cached: Optional[bool] = None  # the last wake's reload read the page cache (None: no stage ran)
        self.loaded_at: Optional[float] = None  # time.monotonic() of the last load that read it all (a boot, a reload)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def staged(self) -> bool:
        """Its checkpoint was read into the page cache since its last reload (as far as the router
        knows: the kernel may have evicted pages since, which the wake's own stage then sees)."""
        return self.done_at is not None

    def begin(self, client: Optional[VLLMClient], timeout: float, why: str) -> Optional[asyncio.Task[Optional[dict[str, Any]]]]:
        """Start a stage unless one is running (then that one); None when this engine does not stage."""
        if not self.enabled or client is None:
            return None
        if not self.running:
            self.why = why
            self.task = asyncio.create_task(self._run(client, timeout), name=f"stage:{self.name}")
        return self.task

    async def join(self, client: Optional[VLLMClient], timeout: float) -> Optional[dict[str, Any]]:
        """The wake's stage step: the running stage (or a new one), waited for up to `timeout`. A stage
        past it goes on in the engine (vLLM runs utility calls one at a time, so the reload after it
        waits for it anyway, and reads what it has staged)."""
        task = self.begin(client, timeout, "wake")
        if task is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            self._failed(f"no answer within {timeout:.3g} s; the wake goes on")
            return None

    async def step(self, client: Optional[VLLMClient], timeout: float) -> bool:
        """The wake's stage step; False when it failed (the wake goes on either way). A stage running is
        joined: vLLM runs utility calls one at a time, so the reload would wait for it anyway, and then
        reads RAM. One begun for this wake while its victims drained and slept, and done, is not asked
        again. Otherwise it only looks (mincore): a checkpoint read first and then reloaded from the page
        cache costs more than the reload reading the disk itself (1.41x on vLLM, docs/benchmarks.md), so
        a wake never stages for itself; the look tells the wake-cost estimate which rate its reload reads at."""
        if self.staged and not self.running and self.why == "room":
            report, resident = self.last, True
        else:
            report = await (self.join(client, timeout) if self.running else self._call(client, timeout, read=False))
            resident = bool(report) and float(report.get("resident_before", 0)) >= RESIDENT
        ok = bool(report and report.get("files"))
        self.found_resident = resident
        if not ok:
            self.cached = None if report is None else False
        elif report is self.last or resident:  # a stage completed, or the pages were there
            self.cached = True
        else:  # only looked: the reload reads what is resident, the disk if (nearly) nothing is
            self.cached = False if float(report.get("resident_before", 0)) <= 1 - RESIDENT else None
        return ok

    @property
    def read_at(self) -> Optional[float]:
        """When its checkpoint was last read into the page cache, by a load or a stage (None: never, as far as
        the router knows): its place among the checkpoints the page cache keeps, newest first."""
        return max((t for t in (self.done_at, self.loaded_at) if t is not None), default=None)

    def booting(self, enabled: bool) -> None:
        """A new process: whether it stages is whether its argv loads the worker extension (a reload can change
        sleep_level in place, for the next process only), and nothing of the last process's stages holds."""
        self.forget()
        self.enabled = enabled
        self.last = self.done_at = self.failure = self.cached = None
        self.found_resident = False

    def reloaded(self) -> None:
        """A load (a boot's, a Level-2 reload) read the checkpoint: the next Level-2 sleep's pages are the
        kernel's to keep or drop."""
        self.done_at = None
        self.last = None
        self.loaded_at = time.monotonic()

    def evicted(self) -> None:
        """Newer reads have filled the page cache past what it keeps: staged no longer, as far as the router knows."""
        self.done_at = None

    def forget(self) -> None:
        """The engine's process is stopping: a stage running in it ends with it."""
        if self.running:
            assert self.task is not None
            self.task.cancel()
        self.task = None

    async def _run(self, client: VLLMClient, timeout: float) -> Optional[dict[str, Any]]:
        started = time.monotonic()
        report = await self._call(client, timeout, read=True)
        if report is None or not report.get("files"):
            return report
        self.last = report
        self.done_at = time.monotonic()
        log.info("engine %s: staged %d files, %.2f GB (%.2f GB read, %.0f%% resident before) in %.2f s (%s)", self.name,
                 report.get("files", 0), report.get("bytes", 0) / 1e9, report.get("read_bytes", 0) / 1e9,
                 100 * float(report.get("resident_before", 0)), time.monotonic() - started, self.why)
        return report

    async def _call(self, client: Optional[VLLMClient], timeout: float, read: bool) -> Optional[dict[str, Any]]:
        """The extension's report, or None when it failed (said once, in `failure`); `read=False`: a look."""
        if not self.enabled or client is None:
            return None
        try:
            report = await stage_weights(client, timeout, read=read)
        except (EngineError, TimeoutError, OSError) as exc:
            self._failed(str(exc) or type(exc).__name__)
            return None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a defect, or an answer nobody anticipated: a stage fails nothing else
            log.exception("engine %s: unexpected error while staging its checkpoint", self.name)
            self._failed(f"internal error: {exc!r}")
            return None
        if not report.get("files"):
            self._failed(f"nothing to stage: {report.get('reason') or 'the worker found no weight files'}")
        elif self.failure is not None:
            # Any answer with files, a wake's look included, shows the cause has passed (a cause that lasts,
            # a loader without files, fails the look too): else one timeout would end staging ahead for good,
            # since a wake never stages for itself and staging ahead skips an engine whose last stage failed.
            log.info("engine %s: staging works again (it had failed: %s)", self.name, self.failure)
            self.failure = None
        return report

    def _failed(self, why: str) -> None:
        # Once per cause: a stage that cannot work (no files, no extension) would say so at every wake.
        if why != self.failure:
            log.warning("engine %s: staging its checkpoint failed (%s); its reload reads the disk", self.name, why)
        self.failure = why
        self.done_at = None

    def as_dict(self) -> dict[str, Any]:
        """For /admin/status."""
        return {"enabled": self.enabled, "staged": self.staged, "running": self.running, "last": self.last,
                "failure": self.failure}
