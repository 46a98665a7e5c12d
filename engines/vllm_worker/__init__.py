"""Code that runs INSIDE vLLM's worker processes (`--worker-extension-cls engines.vllm_worker.HotswapWorkerExtension`).

Not `engines/vllm/`: importing a module runs its package's `__init__` first, and the worker's path
holds only this checkout's `engines/` (tests/integration/cpu_launcher), so nothing here may import
more than the standard library, torch and vllm (tests/unit/test_layout.py holds it to that).
"""

from engines.vllm_worker.extension import HotswapWorkerExtension

__all__ = ["HotswapWorkerExtension"]
