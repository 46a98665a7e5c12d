"""engines.memory.hardware: GPUs through NVML (a fake pynvml here: this machine has no GPU) and host RAM."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Optional

import pytest

from engines.memory.hardware import HardwareError, discover_gpus, host_memory_total_gb, process_gpu_memory_gb


class FakeNVMLError(Exception):
    pass


def fake_pynvml(totals: list[int], processes: Optional[dict[int, list[tuple[int, Optional[int]]]]] = None, *,
                fail: Optional[str] = None) -> types.ModuleType:
    """A pynvml with GPUs of `totals` bytes and, per GPU, (pid, usedGpuMemory) pairs; `fail`
    names the call that raises NVMLError. It records init/shutdown so a test can see they pair."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.calls = []

    def call(name, result=None):
        nvml.calls.append(name)
        if name == fail:
            raise FakeNVMLError(f"{name}: Driver Not Loaded")
        return result

    nvml.nvmlInit = lambda: call("nvmlInit")
    nvml.nvmlShutdown = lambda: call("nvmlShutdown")
    nvml.nvmlDeviceGetCount = lambda: call("nvmlDeviceGetCount", len(totals))
    nvml.nvmlDeviceGetHandleByIndex = lambda i: call("nvmlDeviceGetHandleByIndex", i)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: call("nvmlDeviceGetMemoryInfo", types.SimpleNamespace(total=totals[h], free=0, used=0))
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: call(
        "nvmlDeviceGetComputeRunningProcesses",
        [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in (processes or {}).get(h, [])])
    return nvml


def install(monkeypatch, module) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)


# -- discover_gpus --------------------------------------------------------------------------

def test_discover_gpus_reports_each_index_in_gb_and_shuts_nvml_down(monkeypatch):
    nvml = fake_pynvml([150_754_820_096, 85_899_345_920])  # an H200 (143771 MiB) and an 80 GiB card
    install(monkeypatch, nvml)
    gpus = discover_gpus()
    assert gpus is not None and list(gpus) == [0, 1]
    assert gpus[0] == pytest.approx(150.754820096)
    assert gpus[1] == pytest.approx(85.89934592)
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"


def test_no_driver_is_none_not_an_error(monkeypatch):
    nvml = fake_pynvml([1], fail="nvmlInit")
    install(monkeypatch, nvml)
    assert discover_gpus() is None
    assert process_gpu_memory_gb({1}, 0) is None
    assert "nvmlShutdown" not in nvml.calls  # nothing to shut down after a failed init


def test_no_package_is_none(monkeypatch):
    install(monkeypatch, None)  # a None entry in sys.modules makes `import pynvml` raise ImportError
    with pytest.raises(ImportError):
        import pynvml  # noqa: F401
    assert discover_gpus() is None
    assert process_gpu_memory_gb({1}, 0) is None


@pytest.mark.parametrize("call", ["nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo"])
def test_a_failure_part_way_is_none_and_still_shuts_nvml_down(monkeypatch, call):
    nvml = fake_pynvml([10**9], fail=call)
    install(monkeypatch, nvml)
    assert discover_gpus() is None
    assert nvml.calls[-1] == "nvmlShutdown"


def test_a_driver_with_no_gpu_is_none(monkeypatch):
    install(monkeypatch, fake_pynvml([]))
    assert discover_gpus() is None


def test_the_real_package_on_a_machine_without_a_driver_is_none():
    pytest.importorskip("pynvml")
    gpus = discover_gpus()
    assert gpus is None or all(size > 0 for size in gpus.values())  # None here; a dict on a GPU host


# -- process_gpu_memory_gb ------------------------------------------------------------------

def test_process_memory_sums_the_given_pids_on_that_gpu_only(monkeypatch):
    install(monkeypatch, fake_pynvml([10**11, 10**11], {
        0: [(100, 2_000_000_000), (101, 500_000_000), (999, 40_000_000_000)],  # 999 is another engine
        1: [(100, 7_000_000_000)],
    }))
    assert process_gpu_memory_gb({100, 101}, 0) == pytest.approx(2.5)
    assert process_gpu_memory_gb({100, 101}, 1) == pytest.approx(7.0)
    assert process_gpu_memory_gb({555}, 0) == 0.0


def test_process_memory_unknown_when_nvml_cannot_say(monkeypatch):
    install(monkeypatch, fake_pynvml([10**11], {0: [(100, None)]}))
    assert process_gpu_memory_gb({100}, 0) is None
    install(monkeypatch, fake_pynvml([10**11], fail="nvmlDeviceGetComputeRunningProcesses"))
    assert process_gpu_memory_gb({100}, 0) is None


# -- host_memory_total_gb -------------------------------------------------------------------

def test_host_memory_from_memtotal(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       528177152 kB\nMemFree:        1000 kB\nMemAvailable:   2000 kB\n")
    assert host_memory_total_gb(str(meminfo)) == pytest.approx(528177152 * 1024 / 1e9)


def test_host_memory_of_this_machine():
    assert host_memory_total_gb() > 0


@pytest.mark.parametrize("text", ["MemFree: 1000 kB\n", "MemTotal: lots\n", "MemTotal:\n", "MemTotal: 1000 MB\n"])
def test_host_memory_without_a_readable_memtotal_says_what_to_do(tmp_path: Path, text):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text)
    with pytest.raises(HardwareError, match=rf"no readable 'MemTotal: N kB' line in {meminfo}; set host.ram_budget_gb"):
        host_memory_total_gb(str(meminfo))


def test_host_memory_from_a_missing_file_says_what_to_do(tmp_path: Path):
    with pytest.raises(HardwareError, match=r"cannot read host memory from .*/absent \(.*No such file.*\); set host.ram_budget_gb"):
        host_memory_total_gb(str(tmp_path / "absent"))
