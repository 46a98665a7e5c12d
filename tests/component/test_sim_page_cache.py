"""The simulator's disk and page cache (engines/sim/page_cache.py), with real sim processes on loopback:
the boot's load and a cold reload read at --sim-disk-gb-per-s, hotswap_stage_weights makes the checkpoint resident at that
speed, a resident reload reads at --sim-page-cache-gb-per-s; sims share one page cache per host, LRU
within its capacity. The modelled seconds are lower bounds (asyncio sleeps), so a cold read is checked
from below and a resident one against half of it."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from engines.sim.page_cache import CACHE_ENV, CAPACITY_ENV
from tests.support import eventually

pytestmark = pytest.mark.timeout(30)

EXTENSION = ("--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension")
# 1 GB: 0.5 s from the disk, 0.02 s from the page cache
DISK = (*EXTENSION, "--sim-weights-gb", "1", "--sim-disk-gb-per-s", "2", "--sim-page-cache-gb-per-s", "50")
COLD_S = 0.5


@pytest.fixture
def host(tmp_path, start_sim_engine):
    """start(model, capacity_gb=None, *args): a sim on one host's page cache."""

    def start(model: str, capacity_gb: float | None = None, *args: str):
        env = {CACHE_ENV: str(tmp_path / "page-cache.json")}
        if capacity_gb is not None:
            env[CAPACITY_ENV] = str(capacity_gb)
        return start_sim_engine(*args, model=model, env=env)

    return start


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


async def rpc(http, sim, method: str, **kwargs) -> tuple[object, float]:
    started = time.monotonic()
    async with http.post(sim.url + "/collective_rpc", json={"method": method, "kwargs": kwargs}) as r:
        body = await r.json()
        assert r.status == 200, body
    return body["results"][0], time.monotonic() - started


async def resident(http, sim) -> bool:
    async with http.get(sim.url + "/sim/state") as r:
        return (await r.json())["disk"]["resident"]


def drop_page_cache(tmp_path) -> None:
    """The host's page cache emptied, as `echo 1 > /proc/sys/vm/drop_caches` does."""
    (tmp_path / "page-cache.json").write_text(json.dumps({"resident": {}}))


async def test_the_boot_reads_the_checkpoint_and_leaves_it_resident_so_a_second_boot_reads_the_page_cache(http, host):
    first = host("m", None, *DISK)
    assert "sim: loaded 1 GB of weights from disk in " in first.stderr() + first.stdout()
    assert await resident(http, first), "vLLM's load read the files: their pages are in the host's page cache"
    second = host("m", None, *DISK)  # a second engine of the checkpoint, or the same one restarted
    assert "sim: loaded 1 GB of weights from the page cache in " in second.stderr() + second.stdout()


async def test_a_stage_reads_the_disk_once_and_the_reload_after_it_reads_the_page_cache(http, host, tmp_path):
    sim = host("m", None, *DISK)
    drop_page_cache(tmp_path)
    assert not await resident(http, sim)
    _, cold = await rpc(http, sim, "reload_weights")
    assert cold >= COLD_S, "nothing resident: the reload read the disk"
    assert await resident(http, sim), "the reload's reads filled the page cache"

    other = host("other", None, *DISK)  # a second checkpoint, staged from cold
    drop_page_cache(tmp_path)
    look, look_s = await rpc(http, other, "hotswap_stage_weights", read=False)  # a wake's step with no stage running
    assert look["read_bytes"] == 0 and look["resident_before"] == 0.0 and look_s < COLD_S / 2, look
    assert not await resident(http, other), "a look reads nothing in"
    report, staged_s = await rpc(http, other, "hotswap_stage_weights")
    assert report == {"files": 1, "bytes": 10**9, "read_bytes": 10**9, "seconds": pytest.approx(COLD_S, abs=0.2),
                      "resident_before": 0.0}
    assert staged_s >= COLD_S
    _, warm = await rpc(http, other, "reload_weights")
    assert warm < COLD_S / 2, "staged: the reload read the page cache"
    again, again_s = await rpc(http, other, "hotswap_stage_weights")
    assert again["resident_before"] == 1.0 and again["read_bytes"] == 0 and again_s < COLD_S / 2, "resident: only looked"


async def test_sims_share_the_hosts_page_cache_and_the_least_recently_read_checkpoint_is_evicted(http, host, tmp_path):
    a, b = host("a", 1.5, *DISK), host("b", 1.5, *DISK)  # room for one 1 GB checkpoint
    await rpc(http, a, "hotswap_stage_weights")
    assert await resident(http, a) and not await resident(http, b)
    await rpc(http, b, "hotswap_stage_weights")
    assert await resident(http, b) and not await resident(http, a), "b's pages pushed a's out"
    _, cold = await rpc(http, a, "reload_weights")
    assert cold >= COLD_S
    cache = json.loads((tmp_path / "page-cache.json").read_text())
    assert set(cache["resident"]) == {"a"}, cache


async def test_two_cold_reloads_at_once_share_the_hosts_disk_and_each_takes_twice_as_long(http, host, tmp_path):
    """A stage ahead and another engine's cold reload read one device: neither gets the whole disk."""
    a, b = host("a", None, *DISK), host("b", None, *DISK)
    drop_page_cache(tmp_path)
    (_, a_s), (_, b_s) = await asyncio.gather(rpc(http, a, "reload_weights"), rpc(http, b, "reload_weights"))
    # alone each takes COLD_S; begun d seconds apart, each takes 2 * COLD_S - d
    assert min(a_s, b_s) >= 1.5 * COLD_S, (a_s, b_s)
    assert json.loads((tmp_path / "page-cache.disk.json").read_text()) == {"readers": {}}, "both readers signed off"


async def test_two_engines_of_one_checkpoint_share_its_pages(http, host):
    first, second = host("same", None, *DISK), host("same", None, *DISK)
    await rpc(http, first, "hotswap_stage_weights")
    _, warm = await rpc(http, second, "reload_weights")
    assert warm < COLD_S / 2


async def test_a_reload_sent_while_a_stage_reads_waits_for_it_as_vllm_runs_one_utility_call_at_a_time(http, host, tmp_path):
    sim = host("m", None, *DISK)
    drop_page_cache(tmp_path)
    stage = asyncio.create_task(rpc(http, sim, "hotswap_stage_weights"))

    async def reading() -> bool:
        async with http.get(sim.url + "/sim/log") as r:
            return any(e["step"] == "stage" for e in await r.json())

    await eventually(reading, what="the stage under way")
    _, reload_s = await rpc(http, sim, "reload_weights")
    report, _ = await stage
    assert report["read_bytes"] == 10**9
    assert reload_s >= COLD_S - 0.1, "it waited for the stage, then read the page cache"


async def test_without_the_disk_model_the_reload_takes_its_step_delay_and_a_stage_costs_nothing(http, start_sim_engine):
    sim = start_sim_engine(*EXTENSION, "--sim-step-delay", "reload_weights=0.3")
    _, reload_s = await rpc(http, sim, "reload_weights")
    assert reload_s >= 0.3
    report, stage_s = await rpc(http, sim, "hotswap_stage_weights")
    assert report["resident_before"] == 1.0 and report["read_bytes"] == 0 and stage_s < 0.3
    async with http.get(sim.url + "/sim/state") as r:
        assert (await r.json())["disk"] is None


async def test_the_stage_is_an_extension_method_and_takes_faults_like_any_step(http, start_sim_engine):
    plain = start_sim_engine()
    async with http.post(plain.url + "/collective_rpc", json={"method": "hotswap_stage_weights"}) as r:
        assert r.status == 500 and "has no attribute 'hotswap_stage_weights'" in (await r.text())
    sim = start_sim_engine(*EXTENSION, "--sim-fault", "stage=http500")
    async with http.post(sim.url + "/collective_rpc", json={"method": "hotswap_stage_weights"}) as r:
        assert r.status == 500 and "injected http500 at step stage" in (await r.text())


def test_the_disk_model_needs_the_weights_size(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "engines.sim", "serve", "not-a-dir", "--sim-disk-gb-per-s", "2"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--sim-disk-gb-per-s needs the weights' size" in done.stderr
