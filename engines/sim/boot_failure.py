"""How a simulated engine's failed boot ends on stderr: as vLLM's EngineCore traceback does, so a
supervisor (the router) quoting an engine's last log lines shows what vLLM would have said."""

from __future__ import annotations

import sys
import time

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
