"""The simulator's disk and page cache: what a Level-2 reload and a stage cost (issue 32).

Enabled by `--sim-disk-gb-per-s GB_S` (a cold read's speed); `--sim-page-cache-gb-per-s` (default 6, an
H200 host's measured reload from RAM) is a read of resident pages. The engine's checkpoint is
`--sim-weights-gb` (or the weight files of MODEL, a local directory), resident or not as a whole.

- `hotswap_stage_weights`: resident, it only looks (mincore: no time); else it reads at disk speed and
  the checkpoint becomes resident. With `read: false` it only looks, resident or not.
- `reload_weights`, and the model's load at boot (after `--sim-boot-s`, before the port is bound): at
  page-cache speed when resident, else at disk speed (and then it is resident: the reads filled the cache).
- Calls into the worker run one at a time, as vLLM runs utility calls, so a reload sent while a stage
  reads waits for it.

The page cache is the host's: with `HOTSWAP_SIM_PAGE_CACHE=/path/cache.json` every sim on the host
shares one (a JSON file under `flock`, shared_file.py, as the GPU ledger in memory.py), holding checkpoints by their
MODEL path (two engines of one checkpoint share its pages), each with the time it was last read; over
`HOTSWAP_SIM_PAGE_CACHE_GB` (unset: unbounded) the least recently read are evicted. Without the file,
the cache is this process's own.

So is the disk: reads from it at once share its bandwidth (`SharedDisk`, the file beside the cache's:
`cache.disk.json`), as on a real host, where a stage ahead and another engine's cold reload read one
device. Each reader counts the others every `TICK_S` and advances at the disk's speed over their number;
one that stops counting (its process killed mid-read) is forgotten after `STALE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from pathlib import Path

from engines.sim import shared_file

CACHE_ENV = "HOTSWAP_SIM_PAGE_CACHE"
TICK_S = 0.05  # how often a read recounts the readers sharing the disk
STALE_S = 1.0  # a reader not heard from for this long is gone
CAPACITY_ENV = "HOTSWAP_SIM_PAGE_CACHE_GB"
DEFAULT_PAGE_CACHE_GB_S = 6.0


class PageCache:
    """Which checkpoints are resident (GB and last read, by key), LRU within a capacity."""

    def __init__(self, path: str | os.PathLike | None, capacity_gb: float | None) -> None:
        self.path = Path(path) if path else None
        self.capacity_gb = capacity_gb
        self._own: dict[str, dict] = {}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PageCache:
        env = os.environ if env is None else env
        capacity = env.get(CAPACITY_ENV)
        return cls(env.get(CACHE_ENV) or None, float(capacity) if capacity else None)

    def _locked(self) -> contextlib.AbstractContextManager[dict[str, dict]]:
        return shared_file.locked_or_own(self.path, "resident", self._own)

    def resident(self, key: str) -> bool:
        with self._locked() as entries:
            return key in entries

    def touch(self, key: str, gb: float) -> list[str]:
        """`key` was read: resident, most recently used; returns the keys evicted to make it fit."""
        with self._locked() as entries:
            entries[key] = {"gb": gb, "at": time.time()}
            evicted = []
            if self.capacity_gb is not None:
                for old in sorted((k for k in entries if k != key), key=lambda k: entries[k]["at"]):
                    if sum(e["gb"] for e in entries.values()) <= self.capacity_gb:
                        break
                    evicted.append(old)
                    del entries[old]
                if entries[key]["gb"] > self.capacity_gb:  # it does not fit at all: nothing of it stays
                    del entries[key]
            return evicted

    def drop(self, key: str) -> None:
        with self._locked() as entries:
            entries.pop(key, None)

    def snapshot(self) -> dict:
        with self._locked() as entries:
            return {"path": str(self.path) if self.path else None, "capacity_gb": self.capacity_gb,
                    "resident": {k: dict(v) for k, v in entries.items()}}


class SharedDisk:
    """The host's disk: reads at once share `gb_s` between them (an own disk without a file)."""

    def __init__(self, path: str | os.PathLike | None, gb_s: float) -> None:
        self.path = Path(path) if path else None
        self.gb_s = gb_s
        self._own: dict[str, dict] = {}
        self._ids = itertools.count()

    def _locked(self) -> contextlib.AbstractContextManager[dict[str, dict]]:
        return shared_file.locked_or_own(self.path, "readers", self._own)

    def _count(self, me: str) -> int:
        """Readers now, this one included (its heartbeat; the stale ones dropped)."""
        now = time.time()
        with self._locked() as readers:
            readers[me] = now
            for other in [k for k, at in readers.items() if now - at > STALE_S]:
                del readers[other]
            return len(readers)

    async def read(self, gb: float) -> None:
        """Read `gb` from the disk, at its speed over the readers sharing it, recounted every TICK_S."""
        me = f"{os.getpid()}:{next(self._ids)}"
        left = gb
        try:
            while left > 1e-9:
                rate = self.gb_s / self._count(me)
                tick = min(TICK_S, left / rate)
                await asyncio.sleep(tick)
                left -= tick * rate
        finally:
            with self._locked() as readers:
                readers.pop(me, None)


class DiskModel:
    """One engine's checkpoint on a disk with a page cache in front of it."""

    def __init__(self, key: str, weights_gb: float, disk_gb_s: float, page_cache_gb_s: float, cache: PageCache) -> None:
        self.key, self.weights_gb = key, weights_gb
        self.disk_gb_s, self.page_cache_gb_s = disk_gb_s, page_cache_gb_s
        self.cache = cache
        self.disk = SharedDisk(None if cache.path is None else cache.path.with_suffix(".disk.json"), disk_gb_s)
        self.worker = asyncio.Lock()  # vLLM's engine core runs utility calls one at a time

    @classmethod
    def from_flags(cls, model: str, weights_gb: float | None, disk_gb_s: float, page_cache_gb_s: float) -> DiskModel:
        """From --sim-disk-gb-per-s and its companions; ValueError (the message for argparse) when they do not fit."""
        if not disk_gb_s > 0 or not page_cache_gb_s > 0:
            raise ValueError("--sim-disk-gb-per-s and --sim-page-cache-gb-per-s must be positive GB per second")
        if weights_gb is None or weights_gb < 0:
            raise ValueError("--sim-disk-gb-per-s needs the weights' size: --sim-weights-gb GB (>= 0), or MODEL a local "
                             "directory with weight files")
        try:
            cache = PageCache.from_env()
        except ValueError:
            raise ValueError(f"{CAPACITY_ENV} must be a number of GB") from None
        return cls(model, weights_gb, disk_gb_s, page_cache_gb_s, cache)

    async def stage(self, read: bool = True) -> dict:
        """`read=False` only looks, as mincore does: no time, and the pages' age is unchanged."""
        async with self.worker:
            started = time.monotonic()
            resident = self.cache.resident(self.key)
            reads = read and not resident
            if reads:
                await self.disk.read(self.weights_gb)
            if read:
                self.cache.touch(self.key, self.weights_gb)
            size = round(self.weights_gb * 1e9)
            return {"files": 1, "bytes": size, "read_bytes": size if reads else 0,
                    "seconds": round(time.monotonic() - started, 4), "resident_before": 1.0 if resident else 0.0}

    async def reload(self) -> bool:
        """Read the checkpoint, as `reload_weights` and the load at boot do (vLLM's loader reads the same
        files both times); True if it was resident."""
        async with self.worker:
            resident = self.cache.resident(self.key)
            if resident:
                await asyncio.sleep(self.weights_gb / self.page_cache_gb_s)  # RAM: each engine copies to its own GPU
            else:
                await self.disk.read(self.weights_gb)
            self.cache.touch(self.key, self.weights_gb)
            return resident

    def state_json(self) -> dict:
        return {"key": self.key, "weights_gb": self.weights_gb, "disk_gb_per_s": self.disk_gb_s,
                "page_cache_gb_per_s": self.page_cache_gb_s, "resident": self.cache.resident(self.key),
                "page_cache": self.cache.snapshot()}
