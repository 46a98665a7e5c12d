"""What the machine has and what an engine holds: GPUs and host RAM (NVML, /proc/meminfo), the host RAM an
engine holds for sleep (measured), and the size of the checkpoint it loads."""

from engines.memory.hardware import HardwareError, discover_gpus, host_memory_total_gb, process_gpu_memory_gb
from engines.memory.host import PRIOR_FACTOR, UNMEASURED, HostMemory
from engines.memory.weights import folder_weights_gb, weights_gb

__all__ = ["PRIOR_FACTOR", "UNMEASURED", "HardwareError", "HostMemory", "discover_gpus", "folder_weights_gb",
           "host_memory_total_gb", "process_gpu_memory_gb", "weights_gb"]
