"""What measuring an engine's host memory adds to its sleep and its wake (issue 23, item 1).

    .venv/bin/python bench/host_memory.py [--cycles 30]

Around every sleep and wake the engine measures what it holds in host RAM for sleep
(engines/memory/host.py): before its first sleep its awake footprint, after a sleep one report,
after a Level-1 wake the release and one report. This starts one simulated engine with its
Level-1 host-memory model (20 MB of weights at real size, engines/sim/host_memory.py), runs
Level-1 sleep/wake cycles against it and times each measuring call, through the worker
extension and through /proc. A benchmark, not a test: the numbers are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import harness as bench  # noqa: E402  (bench/harness.py, the sibling module)
from config.schema import ModelSpec  # noqa: E402
from engines.vllm import VLLMClient  # noqa: E402
from engines.memory import HostMemory  # noqa: E402


class Tree:
    """The sim's process, as engines.process.EngineProcess shows it to the measurement."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @property
    def returncode(self):
        return self.proc.poll()

    def group_pids(self) -> set[int]:
        return {self.proc.pid}


async def cycles(extension: bool, n: int) -> dict[str, list[float]]:
    port = bench.free_port()
    argv = [sys.executable, "-m", "engines.sim", "serve", "bench/m", "--port", str(port), "--sim-boot-s", "0",
            "--sim-weights-gb", "0.02", "--sim-host-bytes-per-gb", "1e9"]
    if extension:
        argv += ["--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension"]
    procs = bench.Processes()
    log = Path(tempfile.mkdtemp(prefix="hotswap-bench-")) / "sim.log"
    times: dict[str, list[float]] = {"awake footprint": [], "after a level-1 sleep": [], "after a level-1 wake": []}
    # (the footprint's row: the first cycle reads, the others return at once; its max is the read)
    try:
        proc = procs.start("sim", argv, log, env={"VLLM_SERVER_DEV_MODE": "1"})
        bench.wait_until_ok(f"http://127.0.0.1:{port}/health", proc, log)
        async with aiohttp.ClientSession() as session:
            client = VLLMClient(f"http://127.0.0.1:{port}", session)
            host, tree = HostMemory(ModelSpec(name="m", model="bench/m")), Tree(proc)
            for _ in range(n):
                started = time.perf_counter()
                await host.before_sleep(client, tree)  # once per boot: the first cycle's is the one that reads
                times["awake footprint"].append(time.perf_counter() - started)
                await client.sleep(1, "wait", timeout=10)
                started = time.perf_counter()
                await host.after_sleep(client, tree, 1)
                times["after a level-1 sleep"].append(time.perf_counter() - started)
                await client.wake_up(timeout=10)
                started = time.perf_counter()
                await host.after_wake(client, tree, 1)
                times["after a level-1 wake"].append(time.perf_counter() - started)
            assert host.source == ("extension" if extension else "proc"), host.as_dict()
    finally:
        procs.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=30)
    args = parser.parse_args()
    logging.getLogger("hotswap").setLevel(logging.ERROR)  # the /proc run warns, once, that its cache stays held
    print(f"/proc holds {sum(1 for p in Path('/proc').iterdir() if p.name.isdigit())} processes\n")
    print("| source | call | median ms | max ms |\n| --- | --- | --- | --- |")
    for extension in (True, False):
        for call, seconds in asyncio.run(cycles(extension, args.cycles)).items():
            print(f"| {'extension' if extension else 'proc'} | {call} | {statistics.median(seconds) * 1e3:.2f} | "
                  f"{max(seconds) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
