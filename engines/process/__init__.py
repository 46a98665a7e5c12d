"""One engine process: the argv the router composes, its environment and log file, start and stop, and the
reaper it runs under (`python -P engines/process/reaper.py`, by its file), which takes its process group down with the router."""

from engines.process.engine_process import WORKER_EXTENSION, EngineProcess, compose_argv, free_port, loads_extension, log_file, session_pids

__all__ = ["WORKER_EXTENSION", "EngineProcess", "compose_argv", "free_port", "loads_extension", "log_file", "session_pids"]
