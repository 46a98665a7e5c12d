"""Host memory for sleep: reading /proc and the worker extension's answers (engines/memory/host.py),
and the simulator's pinned-memory model (engines/sim/host_memory.py), allocated for real and seen in /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines.memory.host import PROC, Reading, pinned_bytes, proc_reading
from engines.sim.host_memory import LLAMA_8B, HostModel, next_power_of_two, tensor_bytes


def status_file(root: Path, pid: int, rss_kib: int, file_kib: int, shmem_kib: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "status").write_text(
        f"Name:\tpython\nVmRSS:\t {rss_kib} kB\nRssAnon:\t {rss_kib - file_kib - shmem_kib} kB\n"
        f"RssFile:\t {file_kib} kB\nRssShmem:\t {shmem_kib} kB\n")


def test_an_engines_process_tree_is_read_as_its_resident_and_shared_memory_summed(tmp_path):
    status_file(tmp_path, 10, rss_kib=1000, file_kib=100, shmem_kib=300)
    status_file(tmp_path, 11, rss_kib=2000, file_kib=0, shmem_kib=500)
    assert proc_reading({10, 11, 12}, tmp_path) == Reading(PROC, 3000 * 1024, 900 * 1024), "12 exited meanwhile: skipped"
    assert proc_reading({12}, tmp_path) is None, "nothing left to read: the engine is gone"


def test_the_pinned_bytes_of_every_worker_are_summed_and_a_worker_without_cuda_reports_none():
    assert pinned_bytes([{"available": True, "allocated_bytes": 3}, {"available": True, "allocated_bytes": 4}]) == 7
    assert pinned_bytes([{"available": False, "reason": "no CUDA in this worker"}]) is None


def test_the_simulated_weights_have_llama_8b_proportions_and_each_pinned_block_is_a_power_of_two():
    assert sum(LLAMA_8B) == 16_060_522_496
    assert sum(next_power_of_two(t) for t in LLAMA_8B) / sum(LLAMA_8B) == pytest.approx(1.137, abs=0.001), \
        "at full size the rounding costs 1.14 x (qkv_proj 1.33 x, gate_up and down 1.14 x, the embeddings 1.02 x)"
    assert sum(tensor_bytes(0.02, 1e9)) == pytest.approx(20e6, rel=1e-4)
    assert [next_power_of_two(n) for n in (1, 2, 3, 4096, 4097)] == [1, 2, 4, 4096, 8192]


def shmem() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_a_simulated_level1_backup_is_resident_stays_cached_after_the_wake_and_goes_when_the_cache_is_emptied():
    model = HostModel(0.02, 1e9)
    before = shmem()
    model.sleep(2)
    assert model.allocated == 0 and shmem() - before < 1 << 20, "Level 2 backs nothing up"
    model.sleep(1)
    pinned = sum(next_power_of_two(t) for t in model.tensors)
    assert model.stats() == {"available": True, "allocated_bytes": pinned, "active_bytes": pinned, "cached_bytes": 0}
    assert shmem() - before == pytest.approx(pinned, abs=1 << 20), "touched, so resident"
    model.wake([])
    assert model.stats()["cached_bytes"] == pinned and shmem() - before == pytest.approx(pinned, abs=1 << 20), \
        "the woken backup is cached by the allocator, still resident"
    model.sleep(1)
    assert model.allocated == pinned, "the next Level-1 sleep reuses the cached blocks"
    model.wake(["weights"])
    released = model.empty_cache()
    assert released["released_bytes"] == pinned and model.allocated == 0
    assert shmem() - before < 1 << 20, "emptying the cache gives the pages back"


class BrokenClient:
    """An engine whose answers to the host-memory RPCs break the reader (a shape nothing anticipated)."""

    async def collective_rpc(self, method: str, timeout: float):
        return [{"available": True}]  # no allocated_bytes


async def test_a_measurement_that_fails_on_an_unexpected_answer_is_logged_with_its_traceback_and_counted_by_estimate(caplog):
    from config.schema import ModelSpec
    from engines.memory.host import UNMEASURED, HostMemory

    host = HostMemory(ModelSpec(name="m", command=["vllm", "serve", "/m", "--port", "{port}"]))  # it may have the extension
    await host.before_sleep(BrokenClient(), None)
    await host.after_sleep(BrokenClient(), None, 1)
    assert (host.held, host.source, host.level1_copy) == (None, UNMEASURED, True)
    assert host.problem.startswith("its awake footprint could not be taken: internal error: KeyError('allocated_bytes')"), \
        host.problem
    [record, *_] = [r for r in caplog.records if "measuring its host memory" in r.getMessage()]
    assert record.exc_info is not None and "counted by estimate" in record.getMessage()


def test_a_measured_level1_copy_outlives_a_cold_restart_of_the_same_entry_and_not_a_changed_one():
    """mixtral's Level-1 copy measured 71 GB against host.ram_budget_gb=64 and it was stopped; booted cold
    again, it must not be parked at Level 1 by its 63 GB estimate, measured and stopped once more (seen on
    the trace bench: four times in one replay). A changed roster entry (other flags) is measured anew."""
    from config.schema import ModelSpec
    from engines.memory.host import HostMemory

    spec = ModelSpec(name="mixtral", model="/m", weights_gb=47)
    host = HostMemory(spec)
    host.level1 = 71_310_000_000
    host.reset(spec)  # the stop, then the boot
    assert host.level1_gb == 71.31 and host.held is None, "what it holds is the new process's; what a sleep costs is not"
    host.reset(ModelSpec(name="mixtral", model="/m", weights_gb=47, args=["--max-model-len", "8192"]))
    assert host.level1_gb is None
