"""Staged weights through the real router and simulated engines (issue 32, part 1): a Level-2 wake
stages its checkpoint while its victim sleeps, its reload then reads the page cache; a stage that
fails leaves the reload to read the disk and the wake succeeds. The sims model the disk and the page
cache (engines/sim/page_cache.py): a 2 GB checkpoint at 2 GB/s cold (1 s), 6 GB/s resident."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engines.engine import State
from engines.process import WORKER_EXTENSION
from tests.support import ask, client, eventually, roster_dict, sim_model

DISK = ("--sim-disk-gb-per-s", "2", "--sim-weights-gb", "2")  # a cold reload: 1 s; from the page cache: 0.33 s
COLD_S = 1.0


def roster(tmp_path: Path) -> dict:
    cache = {"HOTSWAP_SIM_PAGE_CACHE": str(tmp_path / "page-cache.json")}  # the host's page cache, shared
    # a's sleep takes 1.5 s: long enough for b's stage (1 s from disk) to finish while a sleeps
    a = sim_model("a", default=True, args=("--gpu-memory-utilization", "0.6", "--sim-step-delay", "sleep=1.5"), env=cache)
    b = sim_model("b", sleep_level=2, args=("--gpu-memory-utilization", "0.6", *DISK), env=cache)
    return roster_dict(a, b)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def post(url: str, body: dict) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()


async def test_a_staged_wake_reloads_from_the_page_cache_and_a_failed_stage_never_fails_the_wake(start_router, tmp_path):
    router = await start_router(roster(tmp_path))
    b = await router.engine("b")
    assert b["state"] == "sleeping" and b["sleep_level"] == 2, "b booted first and was parked for the default, a"
    sim = f"http://127.0.0.1:{b['port']}"
    assert json.loads(get(sim + "/sim/state"))["disk"]["resident"], "b's boot read its checkpoint"
    drop_page_cache(tmp_path)  # as if the host had needed the memory since

    # 1. Both of b's stages fail (the one begun while a sleeps, the wake's own): the wake goes on, from disk.
    post(sim + "/sim/faults", {"step": "stage", "kind": "http500", "times": 2})
    c = client(router)
    assert await ask(c, "b")
    unstaged = (await router.status())["last_swap"]
    assert unstaged["to"] == "b" and unstaged["result"] == "ok", unstaged
    assert list(unstaged["phases"])[:4] == ["drain", "sleep", "stage", "wake_weights"], unstaged["phases"]
    assert unstaged["phases"]["reload_weights"] >= COLD_S, "no stage: the reload read the disk"
    assert router.log().count("engine b: staging its checkpoint failed (") == 1, "said once, with the reason"
    assert "injected http500 at step stage" in router.log()

    # 2. a takes the GPU back; then b again: its checkpoint is staged while a sleeps, the reload reads RAM.
    assert await ask(c, "a")
    assert json.loads(get(sim + "/sim/faults")) == [], "both faults fired"
    drop_page_cache(tmp_path)  # as if the host had needed the memory since: b's pages are gone
    assert await ask(c, "b")
    staged = (await router.status())["last_swap"]
    assert staged["to"] == "b" and staged["result"] == "ok", staged
    assert staged["phases"]["reload_weights"] < COLD_S / 2, f"read from the page cache: {staged['phases']}"
    assert staged["seconds"] < unstaged["seconds"], (staged, unstaged)
    assert "engine b: staged 1 files, 2.00 GB (2.00 GB read, 0% resident before)" in router.log()
    steps = [e["step"] for e in json.loads(get(sim + "/sim/log")) if e["step"] in ("sleep", "stage", "reload_weights")]
    since_parked = steps[len(steps) - steps[::-1].index("sleep"):]
    assert since_parked == ["stage", "reload_weights"], "one stage for the wake: the one begun while a slept"

    metrics = {(s.name, s.labels.get("model"), s.labels.get("phase")): s.value
               for f in text_string_to_metric_families(get(router.url + "/metrics")) for s in f.samples}
    assert metrics[("hotswap_swap_phase_duration_seconds_count", "b", "stage")] == 2
    assert metrics[("hotswap_stage_failures_total", "b", None)] == 1, "the failed stage is counted"
    assert ("hotswap_swap_phase_failures_total", "b", "stage") not in metrics, "apart from the failed steps, which page"
    assert not any(v for (name, model, _), v in metrics.items() if name == "hotswap_swap_phase_failures_total" and model == "b")


def drop_page_cache(tmp_path: Path) -> None:
    (tmp_path / "page-cache.json").write_text(json.dumps({"resident": {}}))


async def test_within_the_page_cache_budget_a_parked_model_is_staged_ahead_of_its_next_request(start_router, tmp_path):
    # One 2 GB checkpoint fits the host's page cache: waking a pushes b's pages out. b was asked for,
    # so once a is awake the router stages b again in the background, within host.page_cache_budget_gb.
    cache = {"HOTSWAP_SIM_PAGE_CACHE": str(tmp_path / "page-cache.json"), "HOTSWAP_SIM_PAGE_CACHE_GB": "2.5"}
    models = [sim_model(n, default=n == "a", sleep_level=2, weights_gb=2, env=cache,
                        args=("--gpu-memory-utilization", "0.6", *DISK)) for n in ("a", "b")]
    router = await start_router(roster_dict(*models, host={"page_cache_budget_gb": 4}))
    c = client(router)
    assert await ask(c, "b") and await ask(c, "a")
    b = await router.engine("b")
    sim = f"http://127.0.0.1:{b['port']}"

    def staged_ahead() -> bool:
        return bool(re.search(r"engine b: staged 1 files, 2\.00 GB \(2\.00 GB read, 0% resident before\) in [\d.]+ s "
                              r"\(ahead\)", router.log())) and json.loads(get(sim + "/sim/state"))["disk"]["resident"]

    await eventually(staged_ahead, timeout=10, what="b staged in the background")
    status = await router.status()
    assert status["placement"]["host"]["staged_gb"] == 2.0 and status["placement"]["host"]["page_cache_budget_gb"] == 4
    from router.cli.status import render

    page = render(status)  # what `hotswap status` prints of it
    assert "page cache staged ahead: 2.00 of 4.00 GB (host.page_cache_budget_gb)" in page
    assert re.search(r"^  b +sleeping +\S+ +2 \(staged\)", page, re.M), page
    assert await ask(c, "b")
    swap = (await router.status())["last_swap"]
    assert swap["to"] == "b" and swap["phases"]["reload_weights"] < COLD_S / 2, swap["phases"]
    assert swap["phases"]["stage"] < COLD_S / 2, "the wake's stage only looked: the pages were there"


async def stage_calls(engine) -> int:
    """The stages the engine was asked for (each answered, or refused when it has no extension)."""
    async with engine.session.get(f"http://127.0.0.1:{engine.port}/sim/log") as resp:
        return sum(e.get("method") == "hotswap_stage_weights" for e in await resp.json(content_type=None))


async def test_a_sleep_level_reload_changes_staging_with_the_next_process_not_before_it(engine_factory):
    # sleep_level: 1 -> auto, applied in place by a reload: the process started without the worker
    # extension keeps running without it; it stages once a restart composes its argv from the new entry.
    engine = engine_factory(sim_model("b", sleep_level=1))
    await engine.boot()
    assert WORKER_EXTENSION not in engine.process.argv and not engine.stager.enabled
    engine.adopt(engine.spec.model_copy(update={"sleep_level": "auto"}))  # what a reload applies in place
    await engine.sleep(2)
    await engine.wake()
    assert await stage_calls(engine) == 0, "its process has no extension: asking would be refused"
    await engine.restart("gate")  # any restart boots from the entry in force
    assert WORKER_EXTENSION in engine.process.argv and engine.stager.enabled
    await engine.sleep(2)
    await engine.wake()
    assert await stage_calls(engine) == 1 and "stage" in engine.last_phases and engine.stager.failure is None

    # The reverse, auto -> 1: the next process has no extension, and no stage is sent to it. A Level-1
    # sleeper still reaches Level 2 when host RAM is needed (a demotion).
    engine.adopt(engine.spec.model_copy(update={"sleep_level": 1}))
    await engine.restart("gate")
    assert WORKER_EXTENSION not in engine.process.argv and not engine.stager.enabled
    await engine.sleep(1)
    await engine.demote()
    await engine.wake()
    assert engine.state is State.AWAKE
    assert await stage_calls(engine) == 0 and "stage" not in engine.last_phases and engine.stager.failure is None
