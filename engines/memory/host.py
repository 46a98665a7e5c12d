"""What one engine holds in host RAM because it slept: measured after every sleep and wake.

At Level 1 vLLM copies every GPU allocation of the weights into a pinned host tensor
(vllm/device_allocator/cumem.py:268, `torch.empty(size, dtype=uint8, device="cpu",
pin_memory=PIN_MEMORY)`, read in vLLM 0.32). PyTorch's caching host allocator rounds each
pinned block up to a power of two and keeps a freed block cached (torch 2.13,
torch/cuda/memory.py:399 `host_memory_stats`: "Block sizes are rounded up to the next power
of two"), so a sleeper holds up to twice its weights, and after the wake (cumem.py:360 drops
the backup into that cache) it still does until the cache is emptied
(torch/accelerator/memory.py:35 `empty_host_cache`).

The number is a difference: what the engine holds now minus what it held awake before its
first sleep since it booted (its `baseline`), so the process's own footprint (Python, CUDA
libraries, the model runner's pinned staging buffers) is not counted. Two sources, the
first that answers wins:

- `extension`: the worker extension's `hotswap_host_memory` (engines/vllm_worker/extension.py), PyTorch's
  pinned bytes summed over the workers; exact, and it can also empty the cache
  (`hotswap_empty_host_cache`), which the engine asks for after every Level-1 wake;
- `proc`: the engine's process tree's resident memory (VmRSS, summed over /proc/PID/status;
  `shared` is RssFile + RssShmem), for an engine without the extension or where CUDA is not
  there to report; it cannot give anything back.

An engine neither answers for (attached by `url:` without the extension, or a measurement that
failed) is `unmeasured`: the scheduler counts it by estimate (router/scheduling/costs.py,
`PRIOR_FACTOR` × its checkpoint while it may hold a Level-1 copy). A measurement never fails
a sleep or a wake: it falls back, and says so once per boot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from config.schema import ModelSpec
from engines.process import loads_extension
from engines.vllm.client import EngineError, EngineHTTPError, VLLMClient

if TYPE_CHECKING:
    from engines.process.engine_process import EngineProcess

log = logging.getLogger("hotswap")

# The first guess of what a Level-1 sleep holds, × the checkpoint's bytes, until it is measured.
# Power-of-two rounding of each weight tensor's pinned block alone costs 1.14 × on Llama-3.1-8B's
# tensors (qkv_proj 1.33 ×, gate_up and down 1.14 ×: engines/sim/host_memory.py) and between 1
# and 2 × in general; 1.35 × weights is what has been reported on H100/H200 hosts (issue 23,
# which adds 1.4 GiB: the process's own growth, which the baseline leaves out here), so the
# guess errs on the side of Level 2 until the first Level-1 sleep is measured. docs/operators.md.
PRIOR_FACTOR = 1.35
EXTENSION, PROC, UNMEASURED = "extension", "proc", "unmeasured"
REPORT_RPC, RELEASE_RPC = "hotswap_host_memory", "hotswap_empty_host_cache"
RPC_S = 10.0  # one report or release; the engine has just answered a sleep or a wake
GB = 1e9
PROC_FIELDS = {"VmRSS": "rss", "RssFile": "shared", "RssShmem": "shared"}


@dataclass(frozen=True)
class Reading:
    """One look at an engine's host memory, in bytes."""

    source: str  # EXTENSION: pinned bytes the host allocator owns (active + cached); PROC: the tree's VmRSS
    bytes: int
    shared: int = 0  # PROC only: RssFile + RssShmem over the tree


def proc_reading(pids: set[int], proc: Path = Path("/proc")) -> Optional[Reading]:
    """The resident and shared memory of `pids`, summed; None when none of them could be read
    (all gone: the engine died). Processes that exit during the walk are skipped."""
    rss = shared = 0
    seen = False
    for pid in pids:
        try:
            text = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        seen = True
        for line in text.splitlines():
            name, _, value = line.partition(":")
            what = PROC_FIELDS.get(name)
            if what is None:
                continue
            kib = int(value.split()[0]) * 1024
            if what == "rss":
                rss += kib
            else:
                shared += kib
    return Reading(PROC, rss, shared) if seen else None


def pinned_bytes(results: list[Any]) -> Optional[int]:
    """The pinned bytes in a `hotswap_host_memory` answer (one result per worker), summed; None
    when no worker could report (no CUDA: the CPU platform)."""
    reports = [r for r in results if isinstance(r, dict) and r.get("available")]
    if not reports:
        return None
    return sum(int(r["allocated_bytes"]) for r in reports)


class HostMemory:
    """One engine's host memory for sleep: the latest measurement and what it implies. The
    bookkeeping is plain data (the scheduler reads it); the async methods do the measuring."""

    def __init__(self, spec: ModelSpec):
        self.spec: Optional[ModelSpec] = None
        self.level1: Optional[int] = None
        self.reset(spec)

    def reset(self, spec: ModelSpec) -> None:
        """A new process (a boot), or none (a stop): nothing held for sleep, nothing known of its sources,
        but what its last Level-1 sleep held, while its roster entry is the same: that is the checkpoint's
        and the flags', not the process's. Forgotten, a copy measured over host.ram_budget_gb would be
        parked at Level 1 again by estimate after every cold boot, measured, and stopped again."""
        kept = self.level1 if self.spec == spec else None
        self.spec = spec
        self.name = spec.name
        # The router composes --worker-extension-cls for a draft it reloads and a checkpoint it stages (engines.process).
        self.expects_extension = loads_extension(spec)
        # An argv the router composed without it has none: asking would only make vLLM log an
        # AttributeError and answer 500 at every boot. `command:` and `url:` engines may have one.
        self.lacks_extension = spec.managed and spec.command is None and not self.expects_extension
        self.baseline: dict[str, int] = {}  # source -> bytes, awake before its first sleep since boot
        self.held: Optional[int] = None  # bytes held for sleep at the last measurement; None: unmeasured
        self.source = UNMEASURED
        self.after = "boot"  # what the last measurement followed: "level-1 sleep", "level-1 wake", ...
        self.at: Optional[float] = None  # time.time() of it
        self.shared: Optional[int] = None  # PROC: the tree's shared memory then
        self.level1: Optional[int] = kept  # held right after its last Level-1 sleep: what the next one costs
        self.level1_copy = False  # it may hold a Level-1 copy (asleep there, or cached since its wake)
        self.released: Optional[int] = None  # what the last emptying of the host cache gave back
        self.release_ok: Optional[bool] = None  # whether that emptying worked (None: not tried since boot)
        self.problem: Optional[str] = None  # why the last measurement fell back, for /admin/status
        self._extension: Optional[bool] = None  # it answers the report (None: not asked since boot)
        self._no_extension: Optional[str] = None  # why it does not
        self._release_why: Optional[str] = None  # why the last emptying of the cache did not work
        self._proc_why: Optional[str] = None  # why the last /proc read gave nothing
        self._baseline_why: Optional[str] = None  # why the awake footprint could not be taken (a defect)
        self._warned: set[str] = set()

    # -- what the scheduler reads ----------------------------------------------------------------

    @property
    def held_gb(self) -> Optional[float]:
        return None if self.held is None else self.held / GB

    @property
    def level1_gb(self) -> Optional[float]:
        return None if self.level1 is None else self.level1 / GB

    @property
    def releases(self) -> bool:
        """Whether a Level-1 wake gives its host memory back (the extension empties the cache):
        as the last attempt went, else as the engine was started."""
        return self.release_ok if self.release_ok is not None else self.expects_extension

    def as_dict(self) -> dict[str, Any]:
        def gb(value: Optional[int]) -> Optional[float]:
            return None if value is None else round(value / GB, 4)

        return {"measured_gb": gb(self.held), "source": self.source, "after": self.after, "at": self.at,
                "shared_gb": gb(self.shared), "level1_gb": gb(self.level1), "released_gb": gb(self.released),
                "releases": self.releases, "problem": self.problem}

    # -- measuring (never raises: a failed measurement falls back and says so) ------------------------

    async def before_sleep(self, client: Optional[VLLMClient], process: Optional["EngineProcess"]) -> None:
        """The awake footprint the later measurements are differences from, once per boot."""
        if self.baseline:
            return
        if not await self._guarded("its awake footprint", self._take_baseline(client, process)):
            self._baseline_why = f"its awake footprint could not be taken: {self.problem}"

    async def after_sleep(self, client: Optional[VLLMClient], process: Optional["EngineProcess"], level: int) -> None:
        if level == 1:
            self.level1_copy = True
        await self._guarded(f"after a level-{level} sleep", self._measure(client, process, f"level-{level} sleep"))
        if level == 1 and self.held is not None:
            self.level1 = self.held

    async def after_wake(self, client: Optional[VLLMClient], process: Optional["EngineProcess"], level: int) -> None:
        """After a Level-1 wake the backup sits in PyTorch's host cache: empty it, then measure what stays."""
        if level == 1:
            before = self.held
            await self._guarded("emptying its host cache", self._release(client))
            await self._guarded(f"after a level-{level} wake", self._measure(client, process, f"level-{level} wake"))
            self._report_release(before)
            return
        await self._guarded(f"after a level-{level} wake", self._measure(client, process, f"level-{level} wake"))

    async def _guarded(self, what: str, measuring: Any) -> bool:
        try:
            await measuring
        except Exception as exc:  # a defect, or an answer nothing anticipated: counted by estimate instead
            log.exception("engine %s: measuring its host memory (%s) failed; it is counted by estimate", self.name, what)
            self.held, self.source, self.problem = None, UNMEASURED, f"internal error: {exc!r} (traceback in the router log)"
            return False
        return True

    async def _take_baseline(self, client: Optional[VLLMClient], process: Optional["EngineProcess"]) -> None:
        pinned = await self._report(client)
        if pinned is not None:
            self.baseline[EXTENSION] = pinned
        reading = await self._read_proc(process)
        if reading is not None:
            self.baseline[PROC] = reading.bytes
        self.held, self.source, self.after, self.at = 0, self._best_source(), "awake", time.time()

    async def _measure(self, client: Optional[VLLMClient], process: Optional["EngineProcess"], after: str) -> None:
        """`problem` ends up saying why the best source was not the one used (None: the extension answered)."""
        self.after, self.at, self.problem = after, time.time(), None
        if EXTENSION in self.baseline:
            pinned = await self._report(client)
            if pinned is not None:
                self.held, self.source, self.shared = max(0, pinned - self.baseline[EXTENSION]), EXTENSION, None
                return
        elif self._no_extension:
            self.problem = self._no_extension
        if PROC in self.baseline:
            reading = await self._read_proc(process)
            if reading is not None:
                self.held, self.source, self.shared = max(0, reading.bytes - self.baseline[PROC]), PROC, reading.shared
                return
        self.held, self.source, self.shared = None, UNMEASURED, None
        if not self.baseline:
            self.problem = self._baseline_why or ("no worker extension answers, and the router has no process of it to "
                                                  "read in /proc (attached by url:)")
        else:
            proc = self._proc_why or "its processes could not be read in /proc (has it exited?)"
            self.problem = f"{self.problem}; {proc}" if self.problem else proc
        self._warn_once("unmeasured", "engine %s: its host memory cannot be measured (%s); counted by estimate", self.problem)

    async def _read_proc(self, process: Optional["EngineProcess"]) -> Optional[Reading]:
        self._proc_why = None
        try:  # a /proc read can stall on a process the kernel is busy with: bounded like an RPC
            async with asyncio.timeout(RPC_S):
                return await asyncio.to_thread(_read_tree, process)
        except TimeoutError:
            self._proc_why = f"reading its processes in /proc took longer than {RPC_S:g} s"
            return None

    def _best_source(self) -> str:
        return EXTENSION if EXTENSION in self.baseline else PROC if PROC in self.baseline else UNMEASURED

    async def _report(self, client: Optional[VLLMClient]) -> Optional[int]:
        """PyTorch's pinned bytes through the extension; None when it cannot say (not loaded, no CUDA)."""
        if client is None or self._extension is False:
            return None
        if self.lacks_extension:
            self._extension = False
            self._no_extension = self.problem = ("no worker extension: the router loads it only into engines whose draft it "
                                                 "reloads or that may sleep at level 2 (sleep_level: 1 here)")
            return None
        try:
            pinned = pinned_bytes(await client.collective_rpc(REPORT_RPC, timeout=RPC_S))
        except EngineHTTPError as exc:  # no such method: the engine runs without the extension
            self._extension = False
            self._no_extension = self.problem = f"no worker extension: {exc.cause[:200]}"
            return None
        except EngineError as exc:  # a slow or lost answer: this once from /proc
            self.problem = f"the extension did not answer ({exc})"
            return None
        if pinned is None:
            self._extension = False
            self._no_extension = self.problem = "the worker extension has no pinned host allocator (no CUDA)"
            return None
        self._extension = True
        return pinned

    async def _release(self, client: Optional[VLLMClient]) -> None:
        self.release_ok, self._release_why = False, None
        if client is None:
            self._release_why = "attached without a client (internal error)"
            return
        if self._extension is False:  # asked this boot: no extension, or no CUDA, so nothing to empty
            self._release_why = self._no_extension
            return
        try:
            results = await client.collective_rpc(RELEASE_RPC, timeout=RPC_S)
        except EngineError as exc:
            self._release_why = str(exc)[:300]
            return
        self.release_ok = any(isinstance(r, dict) and r.get("available") for r in results)
        if not self.release_ok:
            self._release_why = _reason(results)

    def _report_release(self, before: Optional[int]) -> None:
        if self.release_ok and self.held is not None:
            self.level1_copy = False
            self.released = max(0, before - self.held) if before is not None else None
            log.info("engine %s: emptied its host cache after a level-1 wake: %s given back, %.2f GB still held for sleep "
                     "(%s)", self.name, "?" if self.released is None else f"{self.released / GB:.2f} GB", self.held / GB,
                     self.source)
            return
        held = "unmeasured" if self.held is None else f"{self.held / GB:.2f} GB, {self.source}"
        self._warn_once("release", "engine %s: its host cache cannot be emptied after a level-1 wake (%s): what its "
                        "level-1 sleep pinned stays held (now %s) and counts against host.ram_budget_gb until the engine "
                        "stops; only engines whose draft the router reloads or that may sleep at level 2 load the worker extension "
                        "(docs/operators.md)",
                        self._release_why or "the release did not answer", held)

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:  # once per boot: the same cause repeats at every sleep and wake
            self._warned.add(key)
            log.warning(message, self.name, *args)


def _read_tree(process: Optional["EngineProcess"]) -> Optional[Reading]:
    """The engine's process tree in /proc (in a thread: the walk blocks); None for an attached or stopped engine."""
    if process is None or process.returncode is not None:
        return None
    pids = process.group_pids()
    return proc_reading(pids) if pids else None


def _reason(results: list[Any]) -> str:
    reasons = {str(r.get("reason")) for r in results if isinstance(r, dict) and r.get("reason")}
    return "; ".join(sorted(reasons)) or f"answered {results!r:.200}"
