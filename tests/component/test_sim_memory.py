"""The simulator's GPU memory oracle (engines/sim/memory.py), with real sim processes on loopback.

Several sims share one ledger file; each holds its `--gpu-memory-utilization` share of
its devices while booting/awake and `--sim-sleep-residual-gb` while asleep, and fails
as vLLM does when the memory is not free: at boot vLLM's startup check and exit 1, at
wake a 500 with the cumem allocator's out-of-memory error (the engine stays asleep).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from tests.support import eventually

from engines.sim.flags import parse_args
from engines.sim.memory import (
    CUMEM_OOM,
    GiB,
    LEDGER_ENV,
    MEMORY_ENV,
    EngineMemory,
    Ledger,
    OutOfMemory,
    parse_devices,
    parse_sizes,
    read_ledger,
)

pytestmark = pytest.mark.timeout(30)

WAKE_OOM = f"Call to wake_up method failed: {CUMEM_OOM}"


def boot_oom(local: int, free: float, total: float, share: float, asked: float) -> str:
    return (
        f"ValueError: Free memory on device cuda:{local} ({free}/{total} GiB) on startup is less than desired "
        f"GPU memory utilization ({share}, {asked} GiB). Decrease GPU memory utilization or reduce GPU memory "
        "used by other processes."
    )


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    """A fresh ledger path; the test process's own env stays without the oracle."""
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    return tmp_path / "gpu-ledger.json"


@pytest.fixture
def start(start_sim_engine, ledger):
    """start(share, devices="0", memory=None, **kw): a sim on the test's ledger."""

    def go(share: float, devices: str = "0", memory: str | None = None, *args: str, **kw):
        env = {LEDGER_ENV: str(ledger), "CUDA_VISIBLE_DEVICES": devices}
        if memory is not None:
            env[MEMORY_ENV] = memory
        return start_sim_engine("--gpu-memory-utilization", str(share), *args, env=env, **kw)

    return go


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


async def call(http, sim, method, path, params=None):
    async with http.request(method, sim.url + path, params=params) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text else None)


async def held(http, sim) -> dict[str, float]:
    status, body = await call(http, sim, "GET", "/sim/state")
    assert status == 200, body
    return body["gpu_memory"]["held_gb"]


def holdings(ledger, sizes=None) -> dict[int, dict[str, float]]:
    """{pid: {device: GB}} straight from the ledger file."""
    return {int(pid): h["gb"] for pid, h in read_ledger(ledger, sizes).get("holders", {}).items()}


def failed_boot(sim) -> str:
    assert sim.wait_exit() == 1, sim.stdout()
    assert "Uvicorn running" not in sim.stdout()
    return sim.stderr()


# ---- processes ------------------------------------------------------------------------


async def test_an_engine_that_does_not_fit_fails_to_boot_with_vllms_message(start, ledger, http):
    a = start(0.5)
    assert await held(http, a) == {"0": 40.0}
    b = start(0.6, wait=False)
    err = failed_boot(b)
    assert boot_oom(0, 40.0, 80.0, 0.6, 48.0) in err
    assert "RuntimeError: Engine core initialization failed. See root cause above." in err
    assert holdings(ledger) == {a.pid: {"0": 40.0}}  # the failed engine holds nothing


async def test_sleep_frees_down_to_the_residual_and_a_wake_that_does_not_fit_answers_oom(start, ledger, http):
    a = start(0.5, "0", None, "--sim-sleep-residual-gb", "1.5")
    assert (await call(http, a, "POST", "/sleep", {"level": "1"}))[0] == 200
    assert holdings(ledger) == {a.pid: {"0": 1.5}}
    b = start(0.6)  # 48 GB fits next to the residual
    assert holdings(ledger) == {a.pid: {"0": 1.5}, b.pid: {"0": 48.0}}

    for params in ({}, {"tags": "weights"}, {"tags": "kv_cache"}):
        status, body = await call(http, a, "POST", "/wake_up", params)
        assert status == 500
        assert body == {"error": {"message": WAKE_OOM, "type": "InternalServerError", "param": None, "code": 500}}
        assert (await call(http, a, "GET", "/is_sleeping"))[1] == {"is_sleeping": True}
        assert holdings(ledger)[a.pid] == {"0": 1.5}
    assert "Invocation of wake_up method failed" in a.stdout()

    # Once the other engine is gone, the same staged wake succeeds; its first tag maps the whole share.
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait_exit() == 0
    status, body = await call(http, a, "POST", "/wake_up", {"tags": "weights"})
    assert (status, body["status"]) == (200, "sleeping")
    assert holdings(ledger) == {a.pid: {"0": 40.0}}
    status, body = await call(http, a, "POST", "/wake_up", {"tags": "kv_cache"})
    assert (status, body["status"]) == (200, "awake")
    assert holdings(ledger) == {a.pid: {"0": 40.0}}


async def test_level_2_sleeps_to_the_residual_and_level_0_keeps_the_share(start, ledger, http):
    a = start(0.25)
    assert (await call(http, a, "POST", "/sleep", {"level": "0"}))[0] == 200
    assert await held(http, a) == {"0": 20.0}  # level 0 only pauses scheduling
    assert (await call(http, a, "POST", "/wake_up"))[0] == 200
    assert (await call(http, a, "POST", "/sleep", {"level": "2"}))[0] == 200
    assert await held(http, a) == {"0": 1.0}  # the default residual
    assert (await call(http, a, "POST", "/wake_up"))[0] == 200
    assert await held(http, a) == {"0": 20.0}


async def test_a_sigkilled_holder_frees_its_memory_without_any_cleanup(start, ledger, http):
    a = start(0.9)
    assert start(0.2, wait=False).wait_exit() == 1  # 8 GB free: does not fit
    os.kill(a.pid, signal.SIGKILL)
    # Not reaped on purpose: a zombie holds no GPU memory either.
    await eventually(lambda: holdings(ledger) == {}, timeout=5, what="the killed engine's memory purged")
    b = start(0.9)
    assert holdings(ledger) == {b.pid: {"0": 72.0}}


async def test_every_device_of_an_engine_is_charged_and_checked(start, ledger, http):
    sizes = "0=80,1=40"
    a = start(0.5, "0,1", sizes)
    assert holdings(ledger, {0: 80, 1: 40}) == {a.pid: {"0": 40.0, "1": 20.0}}
    state = (await call(http, a, "GET", "/sim/state"))[1]["gpu_memory"]
    assert state["devices"] == [0, 1] and state["share"] == 0.5
    assert state["ledger"]["devices"] == {
        "0": {"total_gb": 80.0, "used_gb": 40.0, "free_gb": 40.0},
        "1": {"total_gb": 40.0, "used_gb": 20.0, "free_gb": 20.0},
    }

    # Device 1 is short: the worker names it by its own index (cuda:0 within CUDA_VISIBLE_DEVICES=1).
    assert boot_oom(0, 20.0, 40.0, 0.6, 24.0) in failed_boot(start(0.6, "1", sizes, wait=False))
    c = start(0.5, "0", sizes)  # takes the 40 left on device 0
    # Device 1 has room for 4 GB, device 0 (the second visible one) has none.
    assert boot_oom(1, 0.0, 80.0, 0.1, 8.0) in failed_boot(start(0.1, "1,0", sizes, wait=False))

    assert (await call(http, a, "POST", "/sleep", {"level": "1"}))[0] == 200
    assert holdings(ledger, {0: 80, 1: 40})[a.pid] == {"0": 1.0, "1": 1.0}
    d = start(0.6, "1", sizes)  # 24 of the 39 free on device 1
    # A's wake still fits device 0 (40 free) but no longer device 1 (16 free);
    # with two workers vLLM's multiprocess executor wraps the error.
    status, body = await call(http, a, "POST", "/wake_up")
    assert status == 500
    assert body["error"]["message"] == (
        f"Call to wake_up method failed: Worker failed with error '{CUMEM_OOM}', "
        "please check the stack trace above for the root cause"
    )
    assert holdings(ledger, {0: 80, 1: 40}) == {
        a.pid: {"0": 1.0, "1": 1.0}, c.pid: {"0": 40.0}, d.pid: {"1": 24.0},
    }


async def test_without_a_ledger_nothing_is_modelled(start_sim_engine, ledger, http):
    a = start_sim_engine("--gpu-memory-utilization", "0.9")
    b = start_sim_engine("--gpu-memory-utilization", "0.9")  # would never fit with the oracle on
    for sim in (a, b):
        status, body = await call(http, sim, "GET", "/sim/state")
        assert body["gpu_memory"] is None
        assert "ignores vLLM arguments it does not model: --gpu-memory-utilization 0.9" in sim.stdout()
    assert (await call(http, a, "POST", "/sleep", {"level": "1"}))[0] == 200
    assert (await call(http, a, "POST", "/wake_up"))[0] == 200
    assert not ledger.exists()


# ---- the ledger itself ----------------------------------------------------------------


def test_env_parsing():
    assert parse_sizes("0=80, 1=141.5") == {0: 80.0, 1: 141.5}
    assert parse_sizes(None) == {} and parse_sizes("") == {}
    for bad in ("0:80", "a=80", "0=0", "0=-1", "-1=80"):
        with pytest.raises(ValueError, match=MEMORY_ENV):
            parse_sizes(bad)
    assert parse_devices(None) == [0]
    assert parse_devices("2,0") == [2, 0]
    for bad in ("", "GPU-1234", "0,0", "-1"):
        with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
            parse_devices(bad)


@pytest.mark.parametrize(
    "env,argv",
    [
        ({MEMORY_ENV: "0:80"}, []),
        ({"CUDA_VISIBLE_DEVICES": "GPU-1"}, []),
        ({}, ["--gpu-memory-utilization", "1.5"]),
        ({}, ["--gpu-memory-utilization", "lots"]),
        ({}, ["--sim-sleep-residual-gb", "-1"]),
    ],
)
def test_bad_oracle_settings_are_refused_at_startup(monkeypatch, tmp_path, env, argv):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "l.json"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        parse_args(["serve", "m", *argv])
    assert e.value.code == 2


def test_the_share_flag_is_ignored_without_a_ledger(monkeypatch):
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    args, unknown = parse_args(["serve", "m", "--gpu-memory-utilization", "lots"])
    assert args.gpu_memory is None and unknown == ["--gpu-memory-utilization", "lots"]


def test_decimal_shares_that_add_up_to_the_whole_device_fit(tmp_path):
    # Holders must be live processes: this one, and children that only sleep.
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        led = Ledger(tmp_path / "l.json")
        for pid, share in zip([os.getpid(), kids[0].pid, kids[1].pid], (0.1, 0.2, 0.7)):
            EngineMemory(led, [0], share, 1.0, "m", pid=pid).boot()
        assert led.snapshot()["devices"]["0"]["free_gb"] == pytest.approx(0.0, abs=1e-6)
        with pytest.raises(OutOfMemory) as e:
            EngineMemory(led, [0], 0.01, 1.0, "m", pid=kids[2].pid).boot()
        assert (e.value.free, e.value.total, e.value.requested) == (0, 80 * GiB, round(0.01 * 80 * GiB))
        assert kids[2].pid not in {int(p) for p in led.snapshot()["holders"]}
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_dead_and_reused_pids_are_purged(tmp_path):
    path = tmp_path / "l.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"holders": {
        str(dead.pid): {"bytes": {"0": 80 * GiB}, "start": None, "state": "awake"},
        str(os.getpid()): {"bytes": {"0": 80 * GiB}, "start": 1, "state": "awake"},  # another process, long gone
    }}))
    assert read_ledger(path, {})["holders"] == {}
    assert json.loads(path.read_text()) == {"holders": {}}  # written back purged


CONTENDER = """
import sys
from engines.sim.memory import EngineMemory, Ledger, OutOfMemory
print("ready", flush=True)
sys.stdin.readline()  # all start together
try:
    EngineMemory(Ledger(sys.argv[1]), [0], 0.3, 1.0, "m").boot()
    print("ok", flush=True)
except OutOfMemory:
    print("oom", flush=True)
sys.stdin.read()  # hold the memory until told to go
"""


def test_concurrent_boots_never_overcommit(tmp_path):
    path = str(tmp_path / "l.json")
    procs = [
        subprocess.Popen([sys.executable, "-c", CONTENDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * len(procs)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = sorted(p.stdout.readline().strip() for p in procs)
        assert results == ["ok"] * 3 + ["oom"] * 5  # 3 x 24 GB of 80
        assert read_ledger(path, {})["devices"]["0"]["used_gb"] == pytest.approx(72.0)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=10)
    assert read_ledger(path, {})["holders"] == {}
