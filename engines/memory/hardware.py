"""What the machine has: GPUs and their memory (through NVML), and host RAM (from /proc/meminfo).

Sizes are in GB of 1e9 bytes, the unit of every `*_gb` key in the roster. (NVML reports an
H200 "141 GB" card as about 150.7 GB in this unit: the box's number is nearer GiB.)

NVML comes from the `nvidia-ml-py` package (`import pynvml`). Without the package, a driver
or a visible GPU, the GPU functions answer None and the caller falls back (`gpus:` in the
roster, or each device taken as 1.0 of itself); they never raise for a missing GPU.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

log = logging.getLogger(__name__)

GB = 1e9
MEMINFO = "/proc/meminfo"


class HardwareError(RuntimeError):
    """The machine could not tell us something we cannot run without (host RAM)."""


@contextmanager
def _nvml() -> Iterator[Optional[Any]]:
    """The initialised pynvml module, or None when NVML cannot be used here (said at debug level)."""
    try:
        import pynvml
    except ImportError:
        log.debug("NVML unavailable: the nvidia-ml-py package is not installed")
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable: %s", exc)
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def discover_gpus() -> Optional[dict[int, float]]:
    """GPU index (NVML's numbering, as nvidia-smi shows it) → total memory in GB; None when
    NVML is unavailable (no package, no driver, no GPU) or fails part-way."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            gpus = {}
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                gpus[index] = nvml.nvmlDeviceGetMemoryInfo(handle).total / GB
        except nvml.NVMLError as exc:
            log.warning("NVML failed while listing GPUs: %s", exc)
            return None
        return gpus or None


def process_gpu_memory_gb(pids: set[int], index: int) -> Optional[float]:
    """GPU memory in GB that the processes `pids` hold on GPU `index` (0.0 when none of them is
    there); None when NVML is unavailable, fails, or cannot say how much a process uses (some
    containers and drivers report no per-process figure).

    Pass every process of the engine (vLLM's GPU work runs in child processes). NVML reports
    host PIDs: from inside a container with its own PID namespace nothing matches.
    """
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError as exc:
            log.warning("NVML failed reading the processes on GPU %d: %s", index, exc)
            return None
        used = 0
        for proc in running:
            if proc.pid not in pids:
                continue
            if proc.usedGpuMemory is None:  # NVML_VALUE_NOT_AVAILABLE
                return None
            used += proc.usedGpuMemory
        return used / GB


def host_memory_total_gb(meminfo: str | os.PathLike[str] = MEMINFO) -> float:
    """The host's RAM in GB, from MemTotal in /proc/meminfo (HardwareError when unreadable).

    This is the machine's RAM, not a container's memory limit: under a cgroup limit, set
    `host.ram_budget_gb` in the roster.
    """
    try:
        text = Path(meminfo).read_text()
    except OSError as exc:
        raise HardwareError(f"cannot read host memory from {meminfo} ({exc}); set host.ram_budget_gb in the roster") from None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "MemTotal":
            parts = value.split()
            try:
                kib = int(parts[0])
            except (IndexError, ValueError):
                break
            unit = parts[1] if len(parts) > 1 else "kB"
            if unit != "kB":
                break
            return kib * 1024 / GB
    raise HardwareError(f"no readable 'MemTotal: N kB' line in {meminfo}; set host.ram_budget_gb in the roster")
