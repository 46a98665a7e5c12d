"""The simulator's GPU memory oracle: one memory pool per device, shared by every sim process.

Enabled when `HOTSWAP_SIM_GPU_LEDGER` names a ledger file (created if absent). Each sim
engine is a holder, keyed by its pid, of some bytes on each of its devices
(`CUDA_VISIBLE_DEVICES`, unset: `0`). Device sizes come from `HOTSWAP_SIM_GPU_MEMORY_GB`
(`0=80,1=141`; 80 for any device not listed). GB here are GiB (2**30 bytes), so a device of
80 prints as 80.0 in vLLM's own messages.

An engine holds `--gpu-memory-utilization` x device memory on each of its devices while
booting and awake, and `--sim-sleep-residual-gb` per device while asleep (its CUDA context
and allocator pools). After `/release_kv_cache_memory` (KV-parked) it holds its weights
(`--sim-weights-gb`, else the weight files in MODEL, divided over its devices; unknown: none) and
its residual: its share less those is the KV cache, freed. Booting or waking checks, as vLLM does, that the memory is free
(total minus what every other live holder holds); see `OutOfMemory` for the texts.

Every access purges holders whose process is gone (exited, crashed, SIGKILLed, or a
zombie nobody reaped), so a dead engine never leaks memory and no cleanup hook is needed.
Processes share the file through an exclusive `fcntl.flock` around read-modify-write (shared_file.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engines.sim import shared_file

LEDGER_ENV = "HOTSWAP_SIM_GPU_LEDGER"
MEMORY_ENV = "HOTSWAP_SIM_GPU_MEMORY_GB"
DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
DEFAULT_DEVICE_GB = 80.0
DEFAULT_SHARE = 0.9  # vLLM's default --gpu-memory-utilization
DEFAULT_RESIDUAL_GB = 1.0

GiB = 1 << 30
# A router that adds shares as decimals (0.3 + 0.7) must not be refused for a rounding
# error in the bytes; a real overcommit is orders of magnitude larger than a page.
SLACK_BYTES = 4096

# What vLLM's cumem allocator raises when cuMemCreate fails while waking (the path and
# line are those recent vLLM builds report).
CUMEM_OOM = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:112"


def gib(n: float) -> int:
    """GB (GiB) to bytes."""
    return round(n * GiB)


def format_gib(b: int) -> str:
    """vLLM's format_gib (vllm/utils/mem_utils.py)."""
    return f"{round(b / GiB, 2)}"


def parse_sizes(text: str | None) -> dict[int, float]:
    """`0=80,1=141` -> {0: 80.0, 1: 141.0}; ValueError naming the bad item."""
    sizes: dict[int, float] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        idx, sep, gb = item.partition("=")
        try:
            if not sep:
                raise ValueError
            i, g = int(idx), float(gb)
            if i < 0 or not g > 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{MEMORY_ENV}: expected INDEX=GB items (e.g. 0=80,1=80), got {item!r}") from None
        sizes[i] = g
    return sizes


def parse_devices(text: str | None) -> list[int]:
    """CUDA_VISIBLE_DEVICES as indexes; unset means device 0."""
    if text is None:
        return [0]
    try:
        devices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{DEVICES_ENV}: the memory oracle needs GPU indexes (e.g. 0,1), got {text!r}") from None
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"{DEVICES_ENV}: the memory oracle needs distinct GPU indexes (e.g. 0,1), got {text!r}")
    return devices


class OutOfMemory(Exception):
    """The memory an engine asked for is not free on `device`."""

    def __init__(self, device: int, local: int, free: int, total: int, requested: int, share: float) -> None:
        self.device, self.local, self.free, self.total = device, local, free, total
        self.requested, self.share = requested, share
        super().__init__(self.boot_message())

    def boot_message(self) -> str:
        """vLLM's startup check (request_memory in vllm/v1/worker/utils.py), verbatim.

        The device is the worker's own (`cuda:N`, N counted within CUDA_VISIBLE_DEVICES)."""
        return (
            f"Free memory on device cuda:{self.local} "
            f"({format_gib(self.free)}/{format_gib(self.total)} GiB) on startup "
            f"is less than desired GPU memory utilization "
            f"({self.share}, {format_gib(self.requested)} GiB). Decrease GPU memory "
            f"utilization or reduce GPU memory used by other processes."
        )

    def wake_message(self, workers: int) -> str:
        """What POST /wake_up answers: the engine core's utility-call failure around the
        cumem allocator's error (wrapped once more by the multiprocess executor when the
        engine has several workers)."""
        err = CUMEM_OOM
        if workers > 1:
            err = f"Worker failed with error '{err}', please check the stack trace above for the root cause"
        return f"Call to wake_up method failed: {err}"


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks (Linux), to tell a reused pid apart; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] == "Z":  # exited; its parent has not reaped it yet
        return -1
    return int(fields[19])


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    now = _proc_start(pid)
    if now == -1:
        return False
    return start is None or now is None or now == start


class Ledger:
    """The ledger file: who holds how many bytes on which device."""

    def __init__(self, path: str | os.PathLike, sizes_gb: dict[int, float] | None = None) -> None:
        self.path = Path(path)
        self.sizes_gb = dict(sizes_gb or {})

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Ledger | None:
        env = os.environ if env is None else env
        path = env.get(LEDGER_ENV)
        if not path:
            return None
        return cls(path, parse_sizes(env.get(MEMORY_ENV)))

    def total(self, device: int) -> int:
        return gib(self.sizes_gb.get(device, DEFAULT_DEVICE_GB))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """The live holders, under the file lock (shared_file): the dead are purged as it is read."""
        with shared_file.locked(self.path, "holders") as holders:
            for pid in [k for k, h in holders.items() if not _alive(int(k), h.get("start"))]:
                del holders[pid]
            yield holders

    def set(self, pid: int, amounts: dict[int, int], *, check: bool, **info) -> None:
        """Make `pid` hold `amounts` (bytes per device, in CUDA_VISIBLE_DEVICES order), with
        `info` (model, state, share) beside it. With `check`, raise OutOfMemory (changing
        nothing) when a device where the holding grows has less free than is asked."""
        with self._locked() as holders:
            key = str(pid)
            mine = {int(d): b for d, b in holders.get(key, {}).get("bytes", {}).items()}
            if check:
                order = list(amounts)
                for device, want in amounts.items():
                    if want <= mine.get(device, 0):
                        continue
                    others = sum(
                        int(h["bytes"].get(str(device), 0)) for k, h in holders.items() if k != key
                    )
                    free = self.total(device) - others
                    if free + SLACK_BYTES < want:
                        raise OutOfMemory(
                            device, order.index(device), max(free, 0), self.total(device), want, info.get("share", 0.0)
                        )
            holders[key] = {
                "start": _proc_start(pid),
                "bytes": {str(d): int(b) for d, b in amounts.items()},
                **info,
            }

    def release(self, pid: int) -> None:
        with self._locked() as holders:
            holders.pop(str(pid), None)

    def held(self, pid: int) -> dict[int, int]:
        """Bytes `pid` holds per device."""
        with self._locked() as holders:
            return {int(d): b for d, b in holders.get(str(pid), {}).get("bytes", {}).items()}

    def snapshot(self) -> dict:
        """The whole ledger in GB: per device total/used/free (devices anyone holds, plus the
        configured ones), and per holder pid its model, state and GB per device."""
        with self._locked() as holders:
            used: dict[int, int] = {}
            for h in holders.values():
                for d, b in h["bytes"].items():
                    used[int(d)] = used.get(int(d), 0) + int(b)
            devices = sorted(set(used) | set(self.sizes_gb))
            return {
                "path": str(self.path),
                "devices": {
                    str(d): {
                        "total_gb": _gb(self.total(d)),
                        "used_gb": _gb(used.get(d, 0)),
                        "free_gb": _gb(self.total(d) - used.get(d, 0)),
                    }
                    for d in devices
                },
                "holders": {
                    k: {**{i: v for i, v in h.items() if i not in ("bytes", "start")},
                        "gb": {d: _gb(int(b)) for d, b in sorted(h["bytes"].items())}}
                    for k, h in sorted(holders.items(), key=lambda kv: int(kv[0]))
                },
            }


def _gb(b: int) -> float:
    return round(b / GiB, 6)


def read_ledger(path: str | os.PathLike | None = None, sizes_gb: dict[int, float] | None = None) -> dict:
    """For tests: the ledger at `path` (default: $HOTSWAP_SIM_GPU_LEDGER) as `Ledger.snapshot()`
    gives it, live holders only. Device sizes: `sizes_gb`, else $HOTSWAP_SIM_GPU_MEMORY_GB."""
    path = path or os.environ[LEDGER_ENV]
    if sizes_gb is None:
        sizes_gb = parse_sizes(os.environ.get(MEMORY_ENV))
    return Ledger(path, sizes_gb).snapshot()


@dataclass
class EngineMemory:
    """One engine's claim on the ledger: its full share while booting/awake, the residual asleep."""

    ledger: Ledger
    devices: list[int]
    share: float
    residual_gb: float
    model: str
    pid: int = 0
    weights_gb: float | None = None  # all its devices together; what a KV release keeps mapped

    def __post_init__(self) -> None:
        self.pid = self.pid or os.getpid()

    def _full(self) -> dict[int, int]:
        return {d: round(self.ledger.total(d) * self.share) for d in self.devices}

    def _set(self, amounts: dict[int, int], state: str, check: bool) -> None:
        self.ledger.set(self.pid, amounts, check=check, model=self.model, state=state, share=self.share)

    def boot(self) -> None:
        """Reserve the full share, or raise OutOfMemory (vLLM's startup check)."""
        self._set(self._full(), "booting", check=True)

    def awake(self) -> None:
        """Booted: the same share, now labelled awake."""
        self._set(self._full(), "awake", check=False)

    def wake(self) -> None:
        """Map the full share back, or raise OutOfMemory and keep holding the residual."""
        self._set(self._full(), "awake", check=True)

    def sleep(self) -> None:
        self._set({d: gib(self.residual_gb) for d in self.devices}, "sleeping", check=False)

    def release_kv(self) -> None:
        """The KV cache unmapped: the weights and the residual stay (never more than the share)."""
        weights = (self.weights_gb or 0.0) / len(self.devices)
        full = self._full()
        self._set({d: min(gib(weights + self.residual_gb), full[d]) for d in self.devices}, "kv_parked", check=False)

    def held_gb(self) -> dict[str, float]:
        return {str(d): _gb(b) for d, b in sorted(self.ledger.held(self.pid).items())}

    def state_json(self) -> dict:
        return {
            "devices": self.devices,
            "share": self.share,
            "residual_gb": self.residual_gb,
            "weights_gb": self.weights_gb,
            "held_gb": self.held_gb(),
            "ledger": self.ledger.snapshot(),
        }
