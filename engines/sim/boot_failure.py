"""How a simulated engine's failed boot ends on stderr: as vLLM's EngineCore traceback does, so a
supervisor (the router) quoting an engine's last log lines shows what vLLM would have said."""

from __future__ import annotations

import os
import sys
import time
from importlib.machinery import PathFinder
from typing import Optional

from .memory import OutOfMemory

LOAD_MODEL_OOM = (
    '  File "vllm/v1/worker/gpu_model_runner.py", line 2512, in load_model\n'
    "    self.model = model_loader.load_model(vllm_config=self.vllm_config, model_config=self.model_config)\n"
    "RuntimeError: simulated boot failure: CUDA out of memory. Tried to allocate 2.00 GiB. "
    "GPU 0 has a total capacity of 79.11 GiB of which 1.12 GiB is free.\n"
)


def memory_check_failure(e: OutOfMemory) -> str:
    """The worker's startup memory check failing, as vLLM's traceback ends."""
    return (
        '  File "vllm/v1/worker/gpu_worker.py", line 255, in init_device\n'
        "    self.requested_memory = request_memory(init_snapshot, self.cache_config)\n"
        '  File "vllm/v1/worker/utils.py", line 383, in request_memory\n'
        "    raise ValueError(\n"
        f"ValueError: {e.boot_message()}\n"
    )


def extension_origin(qualname: str, pythonpath: str) -> tuple[Optional[str], str]:
    """Where a Python whose only extra path is `pythonpath` (hotswap not installed, as in vLLM's own
    environment) imports the module of `qualname` from: (its file, "") or (None, the module not found)."""
    parts = qualname.rpartition(".")[0].split(".")
    search: list[str] = [p for p in pythonpath.split(os.pathsep) if p]
    origin = None
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        spec = PathFinder.find_spec(name, search)
        if spec is None:
            return None, name
        origin, search = spec.origin, list(spec.submodule_search_locations or [])
    return origin, ""


def extension_import_failure(missing: str) -> str:
    """vLLM 0.32's worker failing to import --worker-extension-cls (v1/worker/worker_base.py:297), its
    frames in this Python's environment, as vLLM prints them."""
    packages = f"{sys.prefix}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/vllm"
    return (
        f'  File "{packages}/v1/worker/worker_base.py", line 297, in init_worker\n'
        "    worker_extension_cls = resolve_obj_by_qualname(\n"
        f'  File "{packages}/utils/import_utils.py", line 122, in resolve_obj_by_qualname\n'
        "    module = importlib.import_module(module_name)\n"
        f"ModuleNotFoundError: No module named '{missing}'\n"
    )


def print_boot_failure(root_cause: str = LOAD_MODEL_OOM) -> None:
    ts = time.strftime("%m-%d %H:%M:%S")
    print(
        f"ERROR {ts} [core.py:708] EngineCore failed to start.\n"
        "Traceback (most recent call last):\n"
        '  File "vllm/v1/engine/core.py", line 699, in run_engine_core\n'
        "    engine_core = EngineCoreProc(*args, **kwargs)\n"
        f"{root_cause}"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        file=sys.stderr,
        flush=True,
    )
