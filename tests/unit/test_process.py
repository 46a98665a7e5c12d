"""Engine processes: the argv the router composes, and how an engine is stopped (engines.process.reaper)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import engines.process.engine_process
from config import RosterError, parse_roster
from config.argv import ROUTER_OWNED_FLAGS
from config.schema import ModelSpec
from engines.process.engine_process import REAPER_MARGIN_S, ROUTER_FLAG_VALUES, EngineProcess, compose_argv
from engines.process.reaper import command as reaper_command

REPO = Path(__file__).resolve().parents[2]


def spec(**fields) -> ModelSpec:
    return ModelSpec(name="a", model="/m/a", aliases=["alpha"], **fields)


SPECS = {
    "reload": spec(speculative={"num_speculative_tokens": 3}),
    "preserve": spec(speculative={"num_speculative_tokens": 3}, draft_restore="preserve"),
    "none": spec(speculative={"num_speculative_tokens": 3}, draft_restore="none"),
    "no-draft": spec(),
}


def router_flags(model: ModelSpec) -> list[str]:
    """The flags compose_argv puts between the model and the operator's args."""
    argv = compose_argv(model, 9000)
    owned = argv[len(model.launcher) + 1: len(argv) - len(model.args)]
    return [part for part in owned if part.startswith("--")]


def test_every_router_owned_flag_has_a_value_rule_and_every_rule_a_flag():
    assert set(ROUTER_FLAG_VALUES) == set(ROUTER_OWNED_FLAGS)


@pytest.mark.parametrize("name", SPECS)
def test_every_flag_the_router_emits_is_router_owned_and_refused_in_args(name):
    flags = router_flags(SPECS[name].model_copy(update={"args": ["--dtype", "half"]}))
    assert flags and set(flags) <= set(ROUTER_OWNED_FLAGS), flags
    for flag in flags:
        with pytest.raises(RosterError, match=f"{flag} is set by the router"):
            parse_roster(f"models: [{{name: a, model: /m/a, args: [{flag}, x]}}]\n", "roster.yaml", {})


def test_the_specs_cover_each_draft_restore():
    assert "--worker-extension-cls" in router_flags(SPECS["reload"])
    assert "--sleep-preserve-parameter-names" in router_flags(SPECS["preserve"])
    assert "--sleep-preserve-parameter-names" not in router_flags(SPECS["none"])
    assert "--speculative-config" not in router_flags(SPECS["no-draft"])


def test_the_worker_extension_goes_to_engines_that_reload_a_draft_or_stage_a_level2_checkpoint():
    # A Level-2 wake stages its checkpoint through the extension (engines.waking.stage), so any engine
    # that may sleep at Level 2 from a reloadable checkpoint loads it, draft or not.
    for name in ("reload", "none", "no-draft"):
        assert "--worker-extension-cls" in router_flags(SPECS[name]), name
    level1 = spec(sleep_level=1)
    assert "--worker-extension-cls" not in router_flags(level1)
    assert "--worker-extension-cls" in router_flags(spec(sleep_level=1, speculative={"num_speculative_tokens": 3}))
    # auto with a format vLLM cannot reload never sleeps at Level 2: nothing to stage
    assert "--worker-extension-cls" not in router_flags(spec(args=["--load-format", "dummy"]))


def test_speculative_engines_and_only_they_report_acceptance_per_request():
    # vLLM refuses the flag without speculative decoding (vllm/config/vllm.py:1660).
    for name in ("reload", "preserve", "none"):
        argv = compose_argv(SPECS[name], 9000)
        assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary", argv
    assert "--per-request-spec-decode-metrics" not in compose_argv(SPECS["no-draft"], 9000)


def test_a_router_owned_flag_without_a_value_rule_fails_loudly(monkeypatch):
    monkeypatch.setattr(engines.process.engine_process, "ROUTER_OWNED_FLAGS", (*ROUTER_OWNED_FLAGS, "--new-flag"))
    with pytest.raises(RuntimeError, match="--new-flag has no value rule"):
        compose_argv(SPECS["reload"], 9000)


# -- stopping: SIGTERM, then SIGKILL after swap.kill_grace_s ---------------------------------

STUBBORN = textwrap.dedent("""
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready %d" % os.getpid(), flush=True)
    while True:
        time.sleep(1)
""")


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for an init that does not reap counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_reaper_sigkills_a_child_that_ignores_sigterm_after_its_grace():
    reaper = subprocess.Popen(
        reaper_command(0.5, [sys.executable, "-c", STUBBORN]),
        cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        line = reaper.stdout.readline()
        assert line.startswith("ready "), line
        child = int(line.split()[1])
        started = time.monotonic()
        reaper.send_signal(signal.SIGTERM)
        reaper.wait(timeout=10)
        took = time.monotonic() - started
        assert reaper.returncode == -signal.SIGKILL  # its own killpg after the grace ends it too
        assert 0.5 <= took < 5, took
        wait_until(lambda: gone(child), 5, "the engine to be gone")
    finally:
        if reaper.poll() is None:
            os.killpg(reaper.pid, signal.SIGKILL)
            reaper.wait()


@pytest.mark.parametrize("argv, message", [
    (["--grace-s", "0", "--", "true"], "--grace-s must be > 0"),
    (["--grace-s", "soon", "--", "true"], "--grace-s needs a number of seconds"),
    (["--grace-s", "1", "--"], "no command given"),
])
def test_the_reaper_refuses_a_bad_command_line(argv, message):
    run = subprocess.run([*reaper_command(1, [])[:3], *argv], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and message in run.stderr


async def test_engine_process_stop_kills_after_the_configured_grace(tmp_path: Path):
    model = ModelSpec(name="stubborn", command=["python", "-c", STUBBORN], port=9)
    process = EngineProcess(model, 9, tmp_path, kill_grace_s=0.5)
    await process.start()
    try:
        deadline = time.monotonic() + 30
        while not any(line.startswith("ready ") for line in process.last_lines()):
            assert time.monotonic() < deadline and process.returncode is None, process.last_lines()
            await asyncio.sleep(0.02)
        # Read once the engine runs: right after the fork, /proc shows the parent's argv until the exec.
        with open(f"/proc/{process.pid}/cmdline", "rb") as f:
            reaper_argv = f.read().decode().split("\0")
        assert reaper_argv[reaper_argv.index("--grace-s") + 1] == "0.5"
        child = int(next(line for line in process.last_lines() if line.startswith("ready ")).split()[1])
        started = time.monotonic()
        code = await process.stop()
        took = time.monotonic() - started
        assert code == -signal.SIGKILL  # the reaper's own SIGKILL, after the grace
        assert 0.5 <= took < 0.5 + REAPER_MARGIN_S, took
        deadline = time.monotonic() + 5
        while not gone(child):
            assert time.monotonic() < deadline, "the engine outlived its stop"
            await asyncio.sleep(0.02)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


@pytest.mark.parametrize(("devices", "visible"), [([0], "0"), ([2, 3], "2,3"), ([3, 1], "3,1")])
def test_the_router_sets_cuda_visible_devices_from_devices_over_its_own_environment(monkeypatch, tmp_path: Path, devices, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # the router's own value must not leak into an engine
    model = ModelSpec(name="a", model="/m/a", devices=devices, env={"HF_HOME": "/models/hf"})
    env = EngineProcess(model, 9000, tmp_path, kill_grace_s=1).env()
    assert env["CUDA_VISIBLE_DEVICES"] == visible
    assert env["HF_HOME"] == "/models/hf"  # spec.env is still merged


SPAWNER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("ready %d %d" % (os.getpid(), child.pid), flush=True)
    time.sleep(60)
""")


async def test_group_pids_are_the_engine_and_everything_it_spawned_for_measuring_its_gpu_memory(tmp_path: Path):
    # vLLM's EngineCore, which holds the GPU memory, is a child of the API server process.
    model = ModelSpec(name="spawner", command=["python", "-c", SPAWNER], port=9)
    process = EngineProcess(model, 9, tmp_path, kill_grace_s=0.5)
    await process.start()
    try:
        deadline = time.monotonic() + 30
        while not any(line.startswith("ready ") for line in process.last_lines()):
            assert time.monotonic() < deadline and process.returncode is None, process.last_lines()
            await asyncio.sleep(0.02)
        engine, child = map(int, next(l for l in process.last_lines() if l.startswith("ready ")).split()[1:])
        pids = process.group_pids()
        assert {process.pid, engine, child} <= pids, (process.pid, engine, child, pids)
        assert os.getpid() not in pids, "nothing outside the engine's session"
    finally:
        await process.stop()
