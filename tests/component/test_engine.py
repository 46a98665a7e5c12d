"""An engine's lifecycle against real simulated vLLM processes over loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from engines import waking
from engines.engine import Engine, EngineFailed, Observer, State
from engines.process.engine_process import compose_argv
from tests.support import HOST_MEMORY_RPCS, dev_steps, eventually, pid_alive, sim_model, sim_roster

WAKE_L2 = waking.phases(2, "reload")


class Recorder(Observer):
    def __init__(self) -> None:
        self.states: list[tuple[str, str]] = []
        self.steps: list[tuple[str, bool]] = []

    def state_changed(self, engine, old, new):
        self.states.append((old.value, new.value))

    def step_done(self, engine, phase, seconds, ok):
        self.steps.append((phase, ok))


@pytest.fixture
async def make_engine(tmp_path: Path):
    engines: list[Engine] = []
    async with aiohttp.ClientSession() as session:

        async def make(model: dict, **sections) -> Engine:
            roster = sim_roster(model, **sections)
            engine = Engine(roster.models[0], roster.swap, session, tmp_path, Recorder())
            engines.append(engine)
            return engine

        yield make
        for engine in engines:
            await engine.stop()


async def sim(engine: Engine, method: str, path: str, **kw):
    async with engine.session.request(method, f"http://127.0.0.1:{engine.port}{path}", **kw) as resp:
        return await resp.json(content_type=None)


async def dev_calls(engine: Engine) -> list[str]:
    return dev_steps(await sim(engine, "GET", "/sim/log"))


async def test_a_level2_wake_stages_then_calls_the_five_steps_in_order(make_engine):
    engine = await make_engine(sim_model("a", spec=True))
    await engine.boot()
    assert engine.state is State.AWAKE and engine.served_name == "a"
    await engine.sleep()
    assert (engine.state, engine.sleep_level) == (State.SLEEPING, 2)
    await engine.wake()
    assert engine.state is State.AWAKE
    assert await dev_calls(engine) == ["sleep", *WAKE_L2]
    assert WAKE_L2[0] == "stage", "the router loads the worker extension, so the checkpoint is staged first"
    assert [p for p, ok in engine.observer.steps if ok][-len(WAKE_L2) - 1:] == [*WAKE_L2, "gate"]
    assert set(engine.last_phases) == {*WAKE_L2, "gate"}
    assert engine.observer.states[-4:] == [("draining", "sleeping"), ("sleeping", "waking"), ("waking", "verifying"), ("verifying", "awake")]


async def test_without_a_draft_to_reload_the_wake_skips_the_draft_step(make_engine):
    engine = await make_engine(sim_model("a", spec=True, draft_restore="preserve"))
    await engine.boot()
    await engine.sleep()
    await engine.wake()
    assert await dev_calls(engine) == ["sleep", "stage", "wake_weights", "reload_weights", "wake_kv_cache", "reset_prefix_cache"]
    assert "--sleep-preserve-parameter-names" in engine.process.argv


async def test_a_level1_wake_is_one_wake_up_and_a_prefix_reset(make_engine):
    engine = await make_engine(sim_model("a", sleep_level=1))
    await engine.boot()
    await engine.sleep()
    await engine.wake()
    calls = [c for c in await sim(engine, "GET", "/sim/log") if c.get("method") not in HOST_MEMORY_RPCS]
    # the canary runs twice at boot (the baseline, and its replay for the engine's own logprob
    # spread) and once after the wake, before promotion
    assert [c["step"] for c in calls] == ["generate", "generate", "sleep", "wake", "reset_prefix_cache", "generate"]
    assert calls[2]["query"] == {"level": "1", "mode": "wait"}


async def test_reset_prefix_cache_is_retried_while_vllm_answers_false(make_engine):
    engine = await make_engine(sim_model("a", args=("--sim-reset-prefix-false", "3")))
    await engine.boot()
    await engine.sleep()
    await engine.wake()
    assert (await dev_calls(engine)).count("reset_prefix_cache") == 4
    assert engine.state is State.AWAKE


async def test_sleep_waits_for_in_flight_requests_then_sleeps_in_wait_mode(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    assert engine.try_lease()
    sleeping = asyncio.create_task(engine.sleep())
    await eventually(lambda: engine.state is State.DRAINING, what="draining")
    assert not engine.try_lease(), "a draining engine must not take new traffic"
    await asyncio.sleep(0)  # let the sleep task run; it must still be waiting for the lease
    assert not sleeping.done()
    engine.release()
    await asyncio.wait_for(sleeping, 5)
    assert (await sim(engine, "GET", "/sim/log"))[-1]["query"]["mode"] == "wait"


async def test_a_drain_that_outlasts_its_deadline_sleeps_in_abort_mode(make_engine):
    engine = await make_engine(sim_model("a"), swap={"drain_timeout_s": 0.2})
    await engine.boot()
    assert engine.try_lease()
    await engine.sleep()
    assert (await sim(engine, "GET", "/sim/log"))[-1]["query"] == {"level": "2", "mode": "abort"}


@pytest.mark.parametrize("kind", ["crash", "hang", "http500"])
@pytest.mark.parametrize("step", [*(p for p in WAKE_L2 if p != "stage"), "sleep"])
async def test_a_fault_at_any_step_leaves_the_engine_failed_naming_the_step(make_engine, step, kind):
    engine = await make_engine(sim_model("a", spec=True), swap={"timeouts": {step: 1}})
    await engine.boot()
    await sim(engine, "POST", "/sim/faults", json={"step": step, "kind": kind})
    with pytest.raises(EngineFailed) as failed:
        if step != "sleep":
            await engine.sleep()
        await engine.sleep() if step == "sleep" else await engine.wake()
    assert engine.state is State.FAILED
    message = str(failed.value)
    assert message.startswith(f"engine a: {step} failed: ") and engine.failure == message
    expected = {"hang": "no answer within 1 s", "http500": "HTTP 500", "crash": "process exited with code 1"}[kind]
    assert expected in message, message
    assert (step, False) in engine.observer.steps


@pytest.mark.parametrize("kind", ["hang", "http500", "malformed"])
async def test_a_failed_or_timed_out_stage_never_fails_the_wake(make_engine, kind):
    engine = await make_engine(sim_model("a", spec=True), swap={"timeouts": {"stage": 1}})
    await engine.boot()
    await engine.sleep()
    await sim(engine, "POST", "/sim/faults", json={"step": "stage", "kind": kind})
    await engine.wake()
    assert engine.state is State.AWAKE, engine.failure
    assert ("stage", False) in engine.observer.steps, "the stage is reported, as failed"
    assert await dev_calls(engine) == ["sleep", *WAKE_L2], "every step after it ran"
    assert engine.stager.failure and not engine.stager.staged


async def test_an_engine_that_dies_while_staging_fails_at_the_step_after_it(make_engine):
    engine = await make_engine(sim_model("a", spec=True))
    await engine.boot()
    await engine.sleep()
    await sim(engine, "POST", "/sim/faults", json={"step": "stage", "kind": "crash"})
    with pytest.raises(EngineFailed) as failed:
        await engine.wake()
    assert str(failed.value).startswith("engine a: wake_weights failed: "), failed.value


async def test_an_engine_that_dies_while_awake_is_noticed_at_once(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    sim_pid = (await sim(engine, "GET", "/sim/state"))["pid"]
    os.kill(sim_pid, signal.SIGKILL)
    await eventually(lambda: engine.state is State.FAILED, what="FAILED after the crash")
    assert "process died unexpectedly in state awake" in engine.failure
    assert "code 137" in engine.failure


async def test_a_failed_boot_quotes_the_engines_last_log_lines(make_engine):
    engine = await make_engine(sim_model("a", args=("--sim-fail-boot",)))
    with pytest.raises(EngineFailed) as failed:
        await engine.boot()
    assert engine.state is State.FAILED
    assert "engine a: exited during boot (process exited with code 1); last log lines:" in str(failed.value)
    assert "simulated boot failure" in str(failed.value)
    assert "simulated boot failure" in engine.process.log_path.read_text()


async def test_a_boot_that_never_gets_healthy_times_out(make_engine):
    engine = await make_engine(sim_model("a", args=("--sim-boot-s", "30")), swap={"boot_timeout_s": 0.5})
    with pytest.raises(EngineFailed, match=r"not healthy within boot_timeout_s=0.5 s"):
        await engine.boot()
    assert engine.progress.boot_deadline is None, "a FAILED engine must not show a boot deadline"


async def test_a_missing_launcher_is_reported_not_raised_raw(make_engine):
    engine = await make_engine(sim_model("a", launcher=["/nonexistent/vllm", "serve"]))
    with pytest.raises(EngineFailed) as failed:
        await engine.boot()
    assert str(failed.value) == (
        "engine a: exited during boot (process exited with code 127); last log lines:\n"
        "  hotswap: cannot start engine command '/nonexistent/vllm': No such file or directory"
    )


async def test_restart_brings_a_failed_engine_back(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    first = engine.process.pid
    await sim(engine, "POST", "/sim/faults", json={"step": "sleep", "kind": "http500"})
    with pytest.raises(EngineFailed):
        await engine.sleep()
    await engine.restart("test")
    assert engine.state is State.AWAKE and engine.process.pid != first


def test_argv_is_launcher_then_what_the_router_owns_then_the_operators_args():
    roster = sim_roster({"name": "a", "model": "sim/a", "port": 9123, "args": ["--dtype", "half"],
                         "speculative": {"num_speculative_tokens": 3}})
    assert compose_argv(roster.models[0], 9123) == [
        "vllm", "serve", "sim/a", "--host", "127.0.0.1", "--port", "9123", "--served-model-name", "a",
        "--enable-sleep-mode", "--speculative-config", '{"num_speculative_tokens":3}',
        "--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension",
        "--per-request-spec-decode-metrics", "summary", "--dtype", "half",
    ]


def test_a_command_override_is_used_as_written_with_placeholders_filled():
    roster = sim_roster({"name": "a", "command": "my-engine --listen 127.0.0.1:{port} --served {name}"})
    assert compose_argv(roster.models[0], 9200) == ["my-engine", "--listen", "127.0.0.1:9200", "--served", "a"]


SUPERVISOR = textwrap.dedent("""
    import asyncio, sys, aiohttp
    from pathlib import Path
    from engines.engine import Engine
    from tests.support import sim_model, sim_roster

    async def main():
        roster = sim_roster(sim_model("a"))
        async with aiohttp.ClientSession() as session:
            engine = Engine(roster.models[0], roster.swap, session, Path(sys.argv[1]))
            await engine.boot()
            async with session.get(f"http://127.0.0.1:{engine.port}/sim/state") as r:
                print((await r.json())["pid"], engine.process.pid, engine.port, flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())
""")


async def test_no_engine_outlives_a_supervisor_killed_with_sigkill(tmp_path: Path):
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        line = await asyncio.wait_for(asyncio.to_thread(supervisor.stdout.readline), 30)
        sim_pid, reaper_pid, port = map(int, line.split())
        assert pid_alive(sim_pid) and pid_alive(reaper_pid)
        supervisor.kill()
        await eventually(lambda: not pid_alive(sim_pid) and not pid_alive(reaper_pid), what="engine and reaper gone")
    finally:
        supervisor.kill()
        supervisor.wait()


async def test_a_draft_reload_that_a_worker_did_not_do_fails_the_step(make_engine):
    # The roster says there is a draft, but this engine (a `command` the router adds nothing to)
    # has none: its worker answers reloaded=false, and the wake must not go on as if restored.
    command = ["python", "-m", "engines.sim", "serve", "sim/a", "--port", "{port}", "--sim-boot-s", "0",
               "--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension"]
    engine = await make_engine({"name": "a", "command": command, "speculative": {"num_speculative_tokens": 3},
                                "gate": {"enabled": False}})
    await engine.boot()
    await engine.sleep()
    with pytest.raises(EngineFailed, match=r"engine a: reload_draft failed: POST /collective_rpc hotswap_reload_draft: "
                                           r"not every worker reloaded its draft: \[\{'reloaded': False"):
        await engine.wake()


# -- failures are loud and contained ------------------------------------------------------------

async def test_a_death_while_awake_stops_leases_and_is_logged_once_with_code_and_last_lines(make_engine, caplog):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    os.kill((await sim(engine, "GET", "/sim/state"))["pid"], signal.SIGKILL)
    await eventually(lambda: engine.state is State.FAILED, what="FAILED after the crash")
    assert not engine.try_lease(), "a dead engine must not be leased"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "engine a" in r.getMessage()]
    assert len(errors) == 1, errors
    assert "process died unexpectedly in state awake (process exited with code 137); last log lines:" in errors[0]


async def test_a_death_while_asleep_is_logged_too(make_engine, caplog):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    await engine.sleep()
    os.kill((await sim(engine, "GET", "/sim/state"))["pid"], signal.SIGKILL)
    await eventually(lambda: engine.state is State.FAILED, what="FAILED after the crash")
    assert any("process died unexpectedly in state sleeping (process exited with code 137)" in r.getMessage()
               for r in caplog.records if r.levelname == "ERROR")


async def test_a_failed_engine_is_never_promoted_by_a_late_transition(make_engine, caplog):
    # The race the table closes: the process dies (the watch marks FAILED) while a boot or wake
    # is finishing; its final `AWAKE` must not resurrect the engine.
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    os.kill((await sim(engine, "GET", "/sim/state"))["pid"], signal.SIGKILL)
    await eventually(lambda: engine.state is State.FAILED, what="FAILED after the crash")
    failure = engine.failure
    with pytest.raises(EngineFailed):
        engine._enter(State.AWAKE)
    assert engine.state is State.FAILED and engine.failure == failure, "the first failure's message is kept"
    assert "transition failed -> awake is not allowed" in caplog.text


async def test_a_transition_outside_the_table_fails_the_engine_as_an_internal_error(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    with pytest.raises(EngineFailed, match="engine a: internal error: transition awake -> waking is not allowed"):
        await engine.wake()  # an awake engine has nothing to wake: a caller's defect, not a state to invent
    assert engine.state is State.FAILED


async def test_metrics_that_are_not_prometheus_text_fail_the_gate_with_a_reason(make_engine):
    engine = await make_engine(sim_model("a", spec=True, args=("--sim-fault", "metrics=malformed")))
    with pytest.raises(EngineFailed, match=r"engine a: gate failed: GET /metrics: the answer is not Prometheus text"):
        await engine.boot()
    assert engine.state is State.FAILED


async def test_a_step_cut_off_by_its_own_deadline_names_the_call_it_was_waiting_on(make_engine):
    # The gate's step deadline and its /metrics read's timeout can be equal: whichever fires first,
    # the message names the read (a CI run once got a bare "no answer within 3 s").
    engine = await make_engine(sim_model("a", spec=True))
    await engine.boot()
    await engine.client.health()  # answered: no longer outstanding
    await sim(engine, "POST", "/sim/faults", json={"step": "metrics", "kind": "hang"})
    with pytest.raises(EngineFailed) as failed:
        await engine.climb.step("gate", lambda _: engine.client.metrics(timeout=60), timeout=0.3)
    assert str(failed.value) == "engine a: gate failed: GET /metrics: no answer within 0.3 s"


async def test_an_unexpected_exception_in_a_step_is_contained_to_the_engine(make_engine, monkeypatch, caplog):
    engine = await make_engine(sim_model("a", spec=True))
    await engine.boot()
    await engine.sleep()

    def broken(exposition: str):
        raise RuntimeError("a defect in the counter reader")

    monkeypatch.setattr("engines.gate.canary.read_counters", broken)
    with pytest.raises(EngineFailed, match=r"engine a: gate failed: internal error: RuntimeError\('a defect in the counter reader'\)"):
        await engine.wake()
    assert engine.state is State.FAILED and ("gate", False) in engine.observer.steps
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "unexpected error in step gate" in tracebacks[0].getMessage()


async def test_a_restart_of_the_awake_engine_drains_before_the_process_goes(make_engine):
    engine = await make_engine(sim_model("a"))
    await engine.boot()
    first_pid = engine.process.pid
    assert engine.try_lease()  # a request in flight
    restart = asyncio.create_task(engine.restart("admin"))
    await eventually(lambda: engine.state is State.DRAINING, what="draining")
    assert not engine.try_lease(), "no new lease while draining for a restart"
    assert engine.process.pid == first_pid and engine.process.returncode is None, "the in-flight request still has its engine"
    engine.release()
    await asyncio.wait_for(restart, 15)
    assert engine.state is State.AWAKE and engine.process.pid != first_pid
    assert engine.last_phases.get("boot") is not None


async def test_an_engine_whose_port_another_engine_answers_fails_its_boot(make_engine, start_sim_engine):
    # Two engines given the same free port: the one that loses the bind must not pass its boot
    # (and record its baseline) on the other one's answers.
    squatter = start_sim_engine(model="other")
    engine = await make_engine(sim_model("a", port=squatter.port, args=("--sim-boot-s", "2")))
    with pytest.raises(EngineFailed, match=rf"engine a: boot failed: port {squatter.port} is answered by an engine "
                                           r"serving \['other'\], not 'a'"):
        await engine.boot()
    assert engine.gate.baseline is None
