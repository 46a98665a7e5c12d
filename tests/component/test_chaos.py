"""Chaos: faults at every step while a bounded mixed load runs. Nothing hangs, nothing is lost.

Every scenario: three models (a and the victim b share group g1; c is alone in g2), a load
of streaming and non-streaming requests across them, one fault aimed at b. Then:
  sent == answered + errored, every error is a well-formed OpenAI error, no request outlives
  its deadline, the models not hit keep answering, and b recovers.
Set HOTSWAP_CHAOS_REPORT=path to append each scenario's counts (docs/reliability.md is built
from them by bench/reliability_report.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from dataclasses import asdict, dataclass, field

import aiohttp
import openai
import pytest

from engines import waking
from tests.support import ask, client, eventually, metric_lines, roster_dict, sim_model

DEADLINE_S = 20  # per request, client side; queue.max_wait_s in the roster is shorter
WAKE_STEPS = waking.phases(2, "reload")


def chaos_roster(b_extra=(), **b_kw) -> dict:
    step_timeouts = {k: 1.5 for k in ("sleep", *WAKE_STEPS)} | {"gate": 3}
    return roster_dict(
        sim_model("a", group="g1", default=True, args=("--sim-token-rate", "2000")),
        sim_model("b", group="g1", spec=True, args=("--sim-token-rate", "2000", *b_extra), **b_kw),
        sim_model("c", group="g2", devices=[1], default=True, args=("--sim-token-rate", "2000")),
        swap={"max_hold_s": 0.5, "drain_timeout_s": 2, "timeouts": step_timeouts},
        queue={"max_wait_s": 10},
    )


@dataclass
class Tally:
    scenario: str
    sent: int = 0
    answered: int = 0
    errored: int = 0
    hung: int = 0
    by_model: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def count(self, model: str, outcome: str, detail: str = "") -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.by_model.setdefault(model, {"answered": 0, "errored": 0, "hung": 0})[outcome] += 1
        if detail:
            self.errors[detail] = self.errors.get(detail, 0) + 1

    def check(self, victims: set[str]) -> None:
        assert self.sent == self.answered + self.errored + self.hung, self
        assert self.hung == 0, f"requests outlived their deadline: {self}"
        for model, counts in self.by_model.items():
            if model not in victims:
                assert counts["errored"] == 0, f"model {model} was hit by a fault aimed at {victims}: {self}"

    def report(self) -> None:
        path = os.environ.get("HOTSWAP_CHAOS_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(asdict(self)) + "\n")


async def one_request(c: openai.AsyncOpenAI, model: str, stream: bool, tally: Tally) -> None:
    tally.sent += 1
    try:
        await asyncio.wait_for(_request(c, model, stream), DEADLINE_S)
    except asyncio.TimeoutError:
        tally.count(model, "hung")
    except openai.APIStatusError as exc:
        assert isinstance(exc.body, dict) and exc.body.get("message"), f"malformed error body: {exc.body!r}"
        tally.count(model, "errored", f"{exc.status_code} {exc.body.get('code')}")
    except openai.APIConnectionError as exc:
        tally.count(model, "errored", f"connection: {type(exc).__name__}")
    except openai.APIError as exc:  # an error event inside an SSE stream
        assert isinstance(exc.body, dict) and exc.body.get("message"), f"malformed stream error: {exc.body!r}"
        tally.count(model, "errored", f"stream {exc.body.get('code')}")
    else:
        tally.count(model, "answered")


async def _request(c: openai.AsyncOpenAI, model: str, stream: bool) -> None:
    if not stream:
        answer = await c.completions.create(model=model, prompt="chaos", max_tokens=16, temperature=0)
        assert answer.choices[0].text and answer.usage.completion_tokens == 16
        return
    chunks = await c.completions.create(model=model, prompt="chaos", max_tokens=24, temperature=0, stream=True)
    texts, finish = [], None
    async for chunk in chunks:
        texts += [ch.text for ch in chunk.choices if ch.text]
        finish = next((ch.finish_reason for ch in chunk.choices if ch.finish_reason), finish)
    assert len(texts) == 24 and finish == "length", "a stream ended short without an error"


async def mixed_load(router, tally: Tally, n: int = 48, models=("a", "b", "c"), spread_s: float = 1.5, during=None) -> None:
    """n requests over `spread_s` seconds, random model and streaming; `during` runs at the midpoint."""
    rng = random.Random(n)
    c = client(router)
    plan = [(rng.choice(models), rng.random() < 0.5) for _ in range(n)]
    tasks = []
    for i, (model, stream) in enumerate(plan):
        tasks.append(asyncio.create_task(one_request(c, model, stream, tally)))
        if during is not None and i == n // 2:
            await during()
        await asyncio.sleep(spread_s / n)  # pacing of the load itself, not a wait for anything
    await asyncio.gather(*tasks)


async def engine_port_and_pid(router, name: str) -> tuple[int, int]:
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/state", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return port, (await r.json())["pid"]


async def inject(router, name: str, step: str, kind: str, times=1) -> None:
    port, _ = await engine_port_and_pid(router, name)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/sim/faults", json={"step": step, "kind": kind, "times": times}) as r:
            assert r.status == 200


async def recovers(router, name: str) -> None:
    async def answered() -> bool:
        try:
            return bool(await ask(client(router), name))
        except openai.APIStatusError:
            return False  # still backing off after repeated failures: ask again

    await eventually(answered, timeout=30, interval=0.2, what=f"{name} answering again")


# -- the matrix -----------------------------------------------------------------------------------

# A stage that fails or hangs fails nothing (its reload reads the disk); one that crashes the engine does.
FATAL = [(step, kind) for step in WAKE_STEPS for kind in ("crash", "hang", "http500") if step != "stage" or kind == "crash"]


@pytest.mark.parametrize("step, kind", FATAL)
async def test_a_fault_at_a_wake_step_under_load(start_router, step, kind):
    router = await start_router(chaos_roster())  # b sleeps: the load's first b request wakes it
    await inject(router, "b", step, kind)
    tally = Tally(f"{kind} at {step}")
    await mixed_load(router, tally)
    tally.check(victims={"b"})
    assert (await router.engine("b"))["restarts"] + (await router.engine("b"))["failures"] >= 1 or tally.by_model["b"]["errored"] >= 1
    await recovers(router, "b")
    tally.report()


@pytest.mark.parametrize("kind", ["hang", "http500"])
async def test_a_failed_or_hung_stage_under_load_fails_no_request(start_router, kind):
    router = await start_router(chaos_roster())  # b sleeps: the load's first b request wakes it
    await inject(router, "b", "stage", kind)
    tally = Tally(f"{kind} at stage")
    await mixed_load(router, tally)
    tally.check(victims=set())  # no model's request may fail, b's included
    b = await router.engine("b")
    assert b["failures"] == 0 and b["restarts"] == 0, b
    assert tally.by_model["b"]["answered"] >= 1
    tally.report()


@pytest.mark.parametrize("kind", ["crash", "hang", "http500"])
async def test_a_fault_at_sleep_under_load(start_router, kind):
    router = await start_router(chaos_roster())
    # b must be awake to be put to sleep: wake it, then the load's a requests force b to sleep.
    await ask(client(router), "b")
    await inject(router, "b", "sleep", kind)
    tally = Tally(f"{kind} at sleep")
    await mixed_load(router, tally, models=("a", "c", "b"))
    tally.check(victims={"b"})
    await recovers(router, "b")
    tally.report()


# The gate reads /metrics around its canary: a broken read must fail the wake with a reason (not
# leave b VERIFYING with a dead scheduler, as a parser error once did), and b recovers by restart.
@pytest.mark.parametrize("kind, reason", [("malformed", "the answer is not Prometheus text"), ("http500", "HTTP 500"),
                                          ("hang", "no answer within")])
async def test_a_broken_metrics_read_at_the_gate_under_load(start_router, kind, reason):
    router = await start_router(chaos_roster())
    await inject(router, "b", "metrics", kind)
    tally = Tally(f"/metrics {kind} at the gate")
    await mixed_load(router, tally)
    tally.check(victims={"b"})
    await _failed_with(router, "b", "gate failed: GET /metrics", reason)
    await recovers(router, "b")
    tally.report()


async def test_a_canary_answer_that_is_not_json_under_load(start_router):
    router = await start_router(chaos_roster())  # b sleeps: its canary after the wake is the first generation
    await inject(router, "b", "generate", "malformed")
    tally = Tally("canary answers malformed JSON")
    await mixed_load(router, tally)
    tally.check(victims={"b"})
    await _failed_with(router, "b", "gate failed: POST /v1/completions", "answer is not JSON")
    await recovers(router, "b")
    tally.report()


async def test_a_stream_cut_mid_way_by_an_engine_whose_core_died_under_load(start_router):
    router = await start_router(chaos_roster(b_extra=("--sim-token-rate", "500")))
    await ask(client(router), "b")
    # vLLM's API server outlives its engine core: streams break, /health answers 500.
    await inject(router, "b", "generate", "cut", times=3)
    await inject(router, "b", "health", "http500", times=None)
    tally = Tally("200 stream cut mid-way (engine core dead)")
    await mixed_load(router, tally, models=("b", "b", "c"))
    tally.check(victims={"b"})
    # The broken streams are resumed on the restarted engine (issue 55), not cut: no client sees an error.
    assert not tally.errors, tally.errors
    assert 'model="b",reason="engine_failed"}' in await metric_lines(router, "hotswap_streams_resumed_total")
    await recovers(router, "b")
    b = await router.engine("b")
    assert b["restarts_by_reason"].get("failed", 0) >= 1
    assert "unhealthy after an answer broke off" in router.log()
    tally.report()


async def test_an_engine_killed_mid_stream_under_load(start_router):
    router = await start_router(chaos_roster(b_extra=("--sim-token-rate", "200")))
    await ask(client(router), "b")
    _, pid = await engine_port_and_pid(router, "b")

    async def kill_b():
        os.kill(pid, signal.SIGKILL)

    tally = Tally("SIGKILL mid-stream")
    await mixed_load(router, tally, models=("b", "b", "c"), during=kill_b)
    tally.check(victims={"b"})
    await recovers(router, "b")
    assert (await router.engine("b"))["restarts_by_reason"].get("failed", 0) >= 1
    tally.report()


async def test_an_engine_that_exits_while_idle(start_router):
    router = await start_router(chaos_roster())  # b sleeps, idle
    _, pid = await engine_port_and_pid(router, "b")
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: _state_is(router, "b", "failed"), what="b noticed dead")
    tally = Tally("engine exits while idle")
    await mixed_load(router, tally)
    tally.check(victims=set())  # nobody was in flight on b: its next request restarts it
    tally.report()


async def test_a_crash_during_boot(start_router, tmp_path):
    # b's launcher crashes its next boot once (a marker file), like an OOM at load time.
    marker = tmp_path / "fail-next-boot"
    command = ["sh", "-c", f"if [ -e {marker} ]; then rm -f {marker}; set -- \"$@\" --sim-fail-boot; fi; "
               f"exec {sys.executable} -m engines.sim serve sim/b \"$@\"", "sh", "--port", "{port}", "--sim-boot-s", "0",
               "--served-model-name", "b", "--speculative-config", '{{"num_speculative_tokens": 3}}',
               "--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension"]
    roster = chaos_roster()
    roster["models"][1] = {"name": "b", "group": "g1", "command": command, "speculative": {"num_speculative_tokens": 3},
                           "env": {"PATH": os.environ["PATH"]}}
    router = await start_router(roster)
    _, pid = await engine_port_and_pid(router, "b")
    marker.touch()
    os.kill(pid, signal.SIGKILL)  # the restart that follows hits the failing boot
    await eventually(lambda: _state_is(router, "b", "failed"), what="b noticed dead")
    tally = Tally("crash during boot")
    await mixed_load(router, tally)
    tally.check(victims={"b"})
    await recovers(router, "b")
    assert not marker.exists()
    tally.report()


async def test_a_slow_boot_under_load_from_the_start(start_router):
    """b takes 4 s to boot and the load starts as soon as the router listens: the models that
    have booted are served meanwhile, b's requests wait for its boot, and none of them errs."""
    router = await start_router(chaos_roster(b_extra=("--sim-boot-s", "4")), booted=False)
    tally = Tally("slow boot (b takes 4 s), load from the start")
    await mixed_load(router, tally)
    tally.check(victims=set())
    assert tally.errored == 0, tally
    log = router.log()
    assert -1 < log.find("c booted in") < log.find("b booted in"), "c (its own GPU) booted while b still booted"
    tally.report()


async def test_router_sigterm_under_load(start_router):
    router = await start_router(chaos_roster())

    async def terminate():
        router.proc.send_signal(signal.SIGTERM)

    tally = Tally("router SIGTERM under load")
    await mixed_load(router, tally, during=terminate)
    tally.check(victims={"a", "b", "c"})  # after SIGTERM new requests are refused: errors, never hangs
    # drain_timeout_s is 2: the router must be gone well within drain + engine stop, not hang
    # (it once did: Python 3.11's wait_for swallowed the scheduler's cancel).
    assert await asyncio.to_thread(router.proc.wait, 10) == 0
    assert tally.answered >= 1
    # requests that came after SIGTERM were refused at once, never left to time out in a queue
    assert not any("model_not_ready" in e for e in tally.errors), tally.errors
    tally.report()


async def _failed_with(router, name: str, *fragments: str) -> None:
    """The victim ended FAILED, and the message it failed with (kept in the swap history) says why."""
    swaps = (await router.status())["swaps"]
    errors = [s["error"] for s in swaps if s["to"] == name and s["result"] == "failed"]
    assert any(all(f in e for f in fragments) for e in errors), errors


async def _state_is(router, name, state) -> bool:
    return (await router.engine(name))["state"] == state
