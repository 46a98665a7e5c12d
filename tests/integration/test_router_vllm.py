"""The real router in front of real `vllm serve` engines on CPU, driven with the `openai` SDK.

One router process, one GPU group of three engines, booted once for the module (a CPU
engine takes 35-60 s to boot), built from config/examples/vllm-cpu.yaml:

- tiny-spec: the tiny target with itself as the draft (`num_speculative_tokens: 2`, mean
  acceptance length exactly 3.0 at temperature 0), `draft_restore: reload` (the default);
- tiny-none: the same model with `draft_restore: none`, launched through
  `cpu_launcher_instrumented`, which gives it the worker extension as a test instrument
  (the router rightly loads none into such an engine);
- tiny-plain: a different tiny model without a draft (output-only gate).

Each test starts by putting the group in the state it needs (which engine is awake, the
drafts healthy) and judges counters by their deltas, so the tests stay independent while
sharing the engines. On CPU, sleep is bookkeeping only: `hotswap_discard_draft`, called
straight on a sleeping engine's port, stands in for what Level-2 sleep does to the draft
on GPU. Everything else — endpoints, counters, acceptance, reloads, restarts — is real.
Measurements land in the tier's report (printed at the end of the run, and kept as JSON).
"""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from tests.integration.harness import BOOT_TIMEOUT_S, REPORT, Background, LAUNCHER, poll, progress
from tests.integration.live_router import LiveRouter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "examples" / "vllm-cpu.yaml"
INSTRUMENTED = LAUNCHER.parent / "cpu_launcher_instrumented"
SPEC, NONE, PLAIN = "tiny-spec", "tiny-none", "tiny-plain"
K = 2
FULL = 1.0 + K  # the target drafting for itself accepts every draft token at temperature 0
GATE_TOKENS = 64  # the production default canary length (MAL stays exact: see test_vllm_gate_counters)
PROMPT = "The router wakes the model and"
HEALTHY_CYCLES = int(os.environ.get("HOTSWAP_VLLM_HEALTHY_CYCLES", "25"))  # two wakes each: 50 staged Level-2 wakes
INJECTED = int(os.environ.get("HOTSWAP_VLLM_INJECTED_COLLAPSES", "5"))
RESTART_TIMEOUT_S = BOOT_TIMEOUT_S + 120  # a request whose wake is refused waits for a cold restart

# The access-log lines of vLLM's endpoints in the engine log files, and the line vLLM's own
# target `reload_weights` writes when it finishes (the draft reload does not write it).
ACCESS = re.compile(r'"(GET|POST) (\S+) HTTP/1\.1" (\d+)')
NOISE = {"GET /metrics", "GET /health", "GET /v1/models", "GET /is_sleeping"}
TARGET_RELOADED = "Reloading and processing weights took"
REFUSAL = re.compile(r"gate tiny-none: refused \(mean acceptance length (\d+\.\d+) is below")
WAKE_L2 = ["POST /wake_up?tags=weights", "POST /collective_rpc", "POST /wake_up?tags=kv_cache", "POST /reset_prefix_cache"]


def roster() -> dict[str, Any]:
    """config/examples/vllm-cpu.yaml, with CPU-sized step timeouts and a third engine."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(
        min_active_s=0,
        max_hold_s=5,
        drain_timeout_s=30,
        boot_timeout_s=BOOT_TIMEOUT_S,
        # Each step answers in milliseconds on CPU (the gate in well under a second): these
        # fail a stuck step in bounded time without flaking on a busy 2-core machine.
        timeouts={"sleep": 30, "stage": 60, "wake_weights": 30, "reload_draft": 60, "reload_weights": 60,
                  "wake_kv_cache": 30, "reset_prefix_cache": 30, "gate": 60},
    )
    data["queue"] = {"max_waiting": 64, "max_wait_s": RESTART_TIMEOUT_S}
    data["defaults"]["gate"] = {"max_tokens": GATE_TOKENS}
    models = {m["name"]: m for m in data["models"]}
    assert {SPEC, PLAIN} <= set(models), f"{EXAMPLE} no longer has {SPEC} and {PLAIN}"
    spec = models[SPEC]
    none = {k: v for k, v in spec.items() if k != "default"}
    none.update(name=NONE, draft_restore="none", launcher=[str(INSTRUMENTED)])
    return {**data, "models": [models[PLAIN], none, spec]}


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    live = LiveRouter(roster(), tmp_path_factory.mktemp("router"))
    try:
        status = live.wait_booted(timeout=3 * BOOT_TIMEOUT_S)
        engines = live.engines(status)
        values = live.metrics()
        REPORT["router_boot"] = {
            name: {
                "boot_s": round(live.metric(values, "hotswap_engine_boot_duration_seconds_sum", model=name, group=""), 1),
                "baseline": e["last_verdict"]["reason"],
                "baseline_gate_s": round(e["last_verdict"]["seconds"], 3),
            }
            for name, e in engines.items()
        }
        yield live
    finally:
        live.stop()  # asserts that every engine process it ever ran (restarts included) is gone
        REPORT["router_engine_processes"] = len(live.engine_pids)


# --- helpers ------------------------------------------------------------------------------------


def ask(live: LiveRouter, model: str, max_tokens: int = 16, timeout: float = 120) -> str:
    answer = live.client(timeout).completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert answer.model == model and answer.usage.completion_tokens == max_tokens, answer
    return answer.choices[0].text


def awake(live: LiveRouter, model: str) -> str:
    """Make `model` the awake one (a request does it); returns its answer to PROMPT."""
    text = ask(live, model)
    assert live.awake() == [model]
    return text


def events(lines: list[str]) -> list[str]:
    """vLLM's endpoint calls (access log) and target reloads, in the order the engine logged them."""
    out = []
    for line in lines:
        if TARGET_RELOADED in line:
            out.append("[target reloaded]")
        elif m := ACCESS.search(line):
            call = f"{m.group(1)} {m.group(2)}"
            if call not in NOISE:
                assert m.group(3) == "200", line
                out.append(call)
    return out


def logged(live: LiveRouter, name: str, mark: int, done: str | Callable[[list[str]], bool]) -> list[str]:
    """The engine's events since `mark`, once `done` is among them (or true of them): the router
    pumps the engine's output into the file, so the last lines can trail an answer a little."""
    check = done if callable(done) else (lambda got: done in got)

    def seen() -> list[str] | None:
        got = events(live.log_since(name, mark))
        return got if check(got) else None

    return poll(seen, 30, f"{name} log to show {done!r}", interval=0.1)


def counters(live: LiveRouter, model: str) -> dict[str, float]:
    v = live.metrics()
    out = {r: live.metric(v, "hotswap_gate_verdicts_total", model=model, group="", result=r)
           for r in ("baseline", "passed", "refused", "allowed")}
    out.update({f"restart_{r}": live.metric(v, "hotswap_engine_restarts_total", model=model, group="", reason=r)
                for r in ("gate", "failed", "midlife")})
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def digest(live: LiveRouter, name: str) -> str:
    (value,) = live.rpc(name, "hotswap_draft_digest")
    assert isinstance(value, str) and len(value) == 64, value
    return value


def discard(live: LiveRouter, name: str) -> None:
    """The stand-in for the Level-2 draft loss, on a sleeping engine."""
    assert live.engine(name)["state"] == "sleeping"
    (result,) = live.rpc(name, "hotswap_discard_draft")
    assert result["discarded"] is True and result["tensors"] > 0, result


def phases(live: LiveRouter) -> tuple[dict[str, float], dict[str, Any]]:
    swap = live.last_swap()
    assert swap["result"] == "ok", swap
    return swap["phases"], swap


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(samples), 4), "max": round(max(samples), 4), "n": len(samples)}


# --- 1. the proxy ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [SPEC, PLAIN])
def test_chat_completions_and_streams_through_the_router_match_the_engines_direct_answers(router: LiveRouter, model: str) -> None:
    via_text = awake(router, model)
    via, own = router.client(), router.direct(model)  # the engine is awake: direct requests are answered
    assert own.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text == via_text

    messages = [{"role": "user", "content": "Tell me what the old man sees in the quiet city."}]
    chats = [c.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0) for c in (via, own)]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
    assert chats[0].usage.completion_tokens == chats[1].usage.completion_tokens == 20 and chats[0].model == model

    def streamed(c, chat: bool) -> tuple[list[str], Any]:
        if chat:
            stream = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
        else:
            stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            pieces += [(ch.delta.content or "") if chat else ch.text for ch in chunk.choices]
            usage = chunk.usage or usage
        return pieces, usage

    # The text must match; the chunking need not: vLLM coalesces the tokens decoded while its
    # previous chunk was being sent, so chunk boundaries depend on timing even engine-direct.
    for chat in (False, True):
        (via_pieces, via_usage), (own_pieces, own_usage) = streamed(via, chat), streamed(own, chat)
        assert "".join(via_pieces) == "".join(own_pieces), (via_pieces, own_pieces)
        assert len(via_pieces) > 1, f"not an event stream: {via_pieces}"
        assert via_usage.completion_tokens == own_usage.completion_tokens == 12
    assert "".join(streamed(via, False)[0]) == ask(router, model, 12)


# --- 2. swaps through the real endpoints, in the staged order ------------------------------------


def test_two_real_engines_swap_back_and_forth_through_the_staged_endpoints(router: LiveRouter) -> None:
    reference = {PLAIN: awake(router, PLAIN)}
    reference[SPEC] = awake(router, SPEC)
    assert reference[SPEC] != reference[PLAIN], "two different models must answer differently"
    # Both load the worker extension (each may sleep at Level 2), so each wake stages its checkpoint first.
    spec_wake = ["stage", "wake_weights", "reload_draft", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate"]
    plain_wake = ["stage", "wake_weights", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate"]
    record = REPORT.setdefault("swaps", [])

    for to, frm, wake in [(PLAIN, SPEC, plain_wake), (SPEC, PLAIN, spec_wake)] * 2:
        # Start from quiet logs: `to` was put to sleep by an earlier swap, and that line is in.
        logged(router, to, 0, lambda e: e[-1:] == ["POST /sleep?level=2&mode=wait"])
        marks = {n: router.log_mark(n) for n in (to, frm)}
        before = router.engine(to)
        assert before["state"] == "sleeping" and before["sleep_level"] == 2
        assert ask(router, to) == reference[to], "answers stay correct across swaps"

        steps, swap = phases(router)
        assert (swap["from"], swap["to"]) == ([frm], to)
        assert list(steps) == ["drain", "sleep", *wake], "the router's record of the steps, in the order it ran them"
        assert router.engine(frm)["state"] == "sleeping" and router.engine(to)["last_verdict"]["result"] == "passed"
        record.append({"from": frm, "to": to, "seconds": swap["seconds"], "phases": steps})

        # The engines' own logs: the old one was put to sleep; the new one got the staged wake,
        # then the gate's canary, then (promoted) the client's request.
        assert logged(router, frm, marks[frm], "POST /sleep?level=2&mode=wait")[-1] == "POST /sleep?level=2&mode=wait"
        got = logged(router, to, marks[to], lambda e: e.count("POST /v1/completions") >= 2)
        # First the stage (begun while `frm` drained and slept; the wake's own step found it done or joined it).
        if to == SPEC:
            # Two RPCs between the weights and the kv_cache wake: the first is the draft reload
            # (vLLM's target reload logs nothing before it), the second vLLM's `reload_weights`.
            wake_calls = ["POST /collective_rpc", WAKE_L2[0], "POST /collective_rpc", "[target reloaded]", "POST /collective_rpc",
                          *WAKE_L2[2:]]
        else:
            wake_calls = ["POST /collective_rpc", WAKE_L2[0], "[target reloaded]", "POST /collective_rpc", *WAKE_L2[2:]]
        assert got == [*wake_calls, "POST /v1/completions", "POST /v1/completions"], f"{to}: engine log shows {got}"


# --- 3. draft_restore: none — the collapse is caught, refused, and remediated by a restart ----------


def test_a_lost_draft_is_refused_by_the_gate_and_remediated_by_a_cold_restart(router: LiveRouter) -> None:
    reference = awake(router, NONE)  # healthy: on CPU a sleep alone loses nothing
    assert reference == awake(router, SPEC), "same weights as tiny-spec: same greedy answer"
    digest0 = digest(router, NONE)
    before, engine0 = counters(router, NONE), router.engine(NONE)
    discard(router, NONE)
    assert digest(router, NONE) != digest0

    pending = Background(lambda: ask(router, NONE, timeout=RESTART_TIMEOUT_S))
    # While the engine cold-restarts (tens of seconds), the refusal is what /admin/status shows.
    refused = poll(lambda: (lambda e: e if (e["last_verdict"] or {}).get("result") == "refused" else None)(router.engine(NONE)),
                   RESTART_TIMEOUT_S, "the refused verdict in /admin/status", interval=0.1)["last_verdict"]
    assert refused["baseline_mal"] == pytest.approx(FULL) and refused["observed_mal"] == pytest.approx(1.0), refused
    assert refused["reason"].startswith(f"mean acceptance length 1.00 is below {1 + 0.5 * K:.2f}"), refused
    assert "the draft model looks lost" in refused["reason"] and refused["output_match"] is True, refused
    poll(pending.done, RESTART_TIMEOUT_S, "the request held through the restart to be answered")
    assert pending.error is None, pending.error
    assert pending.result == reference, "answered, correctly, by the restarted engine"

    engine = router.engine(NONE)
    assert engine["state"] == "awake" and engine["pid"] != engine0["pid"], "a new engine process"
    assert engine["restarts_by_reason"].get("gate", 0) == engine0["restarts_by_reason"].get("gate", 0) + 1
    assert engine["last_verdict"]["result"] == "passed" and engine["last_verdict"]["observed_mal"] == pytest.approx(FULL)
    assert engine["baseline_mal"] == pytest.approx(FULL), "judged against the original cold-boot baseline"
    assert digest(router, NONE) == digest0, "the restarted engine's draft is the checkpoint's again"
    assert delta(counters(router, NONE), before) == {"refused": 1, "passed": 1, "restart_gate": 1}
    steps, swap = phases(router)
    assert list(steps) == ["drain", "sleep", "stage", "wake_weights", "reload_weights", "wake_kv_cache", "reset_prefix_cache",
                           "gate", "restart"], steps
    assert "gate tiny-none: refused (mean acceptance length 1.00" in router.proc.log()
    REPORT["none_refused"] = {"verdict": refused, "swap_s": swap["seconds"], "phases": steps}


# --- 4. draft_restore: reload — the wake restores the draft; the gate passes, no restart --------------


def test_a_lost_draft_is_restored_at_wake_and_passes_the_gate_without_a_restart(router: LiveRouter) -> None:
    reference = awake(router, SPEC)
    awake(router, PLAIN)
    digest0 = digest(router, SPEC)  # pre-sleep value (the draft sleeps untouched on CPU)
    before, engine0 = counters(router, SPEC), router.engine(SPEC)
    discard(router, SPEC)
    assert digest(router, SPEC) != digest0

    assert ask(router, SPEC) == reference
    engine = router.engine(SPEC)
    assert engine["state"] == "awake" and engine["pid"] == engine0["pid"] and engine["restarts"] == engine0["restarts"]
    verdict = engine["last_verdict"]
    assert verdict["result"] == "passed" and verdict["observed_mal"] == pytest.approx(FULL), verdict
    assert digest(router, SPEC) == digest0, "the draft is the checkpoint's again"
    assert delta(counters(router, SPEC), before) == {"passed": 1}
    steps, swap = phases(router)
    assert list(steps) == ["drain", "sleep", "stage", "wake_weights", "reload_draft", "reload_weights", "wake_kv_cache",
                           "reset_prefix_cache", "gate"], steps
    REPORT["reload_restored"] = {"verdict": verdict, "swap_s": swap["seconds"], "phases": steps}


# --- repeated cycles: detection rate and false refusals -------------------------------------------


def test_every_injected_collapse_is_caught_and_no_healthy_wake_is_refused(router: LiveRouter) -> None:
    reference = {m: awake(router, m) for m in (SPEC, PLAIN)}
    reference[NONE] = reference[SPEC]
    start = {m: counters(router, m) for m in (SPEC, NONE, PLAIN)}
    wakes: dict[str, list[dict[str, float]]] = {SPEC: [], PLAIN: []}
    swap_s: list[float] = []

    digest0 = digest(router, SPEC)
    # Healthy wake/sleep cycles with draft_restore: reload (tiny-spec), and the plain model's
    # output-only gate on every swap back.
    healthy_mal, healthy_drift = [], []
    for cycle in range(HEALTHY_CYCLES):
        progress(f"healthy wake cycle {cycle + 1} of {HEALTHY_CYCLES} ({SPEC} and {PLAIN} swapped in turn)")
        for model in (SPEC, PLAIN):
            assert ask(router, model) == reference[model]
            steps, swap = phases(router)
            assert swap["to"] == model, swap
            wakes[model].append(steps)  # a false refusal would show in the counters below
            swap_s.append(swap["seconds"])
            verdict = router.engine(model)["last_verdict"]
            healthy_drift.append(verdict["logprob_drift"])  # the logprob check ran on every wake, draft or not
            if model == SPEC:
                healthy_mal.append(verdict["observed_mal"])
    healthy = {m: delta(counters(router, m), start[m]) for m in (SPEC, PLAIN)}
    assert healthy[SPEC] == {"passed": HEALTHY_CYCLES}, f"false refusals or restarts in healthy cycles: {healthy}"
    assert healthy[PLAIN] == {"passed": HEALTHY_CYCLES}, healthy
    assert healthy_mal == [FULL] * HEALTHY_CYCLES, healthy_mal
    assert None not in healthy_drift, healthy_drift
    awake(router, SPEC)
    assert digest(router, SPEC) == digest0, "twenty draft reloads later, still the checkpoint's draft"

    # Injected collapses with draft_restore: none: each one caught by the gate and remediated.
    caught, observed, observed_mal, restart_s = 0, [], [], []
    for injected in range(INJECTED):
        progress(f"injected draft loss {injected + 1} of {INJECTED}: the gate must refuse, then a cold restart")
        awake(router, PLAIN)
        before, logged_before = counters(router, NONE), len(REFUSAL.findall(router.proc.log()))
        discard(router, NONE)
        assert ask(router, NONE, timeout=RESTART_TIMEOUT_S) == reference[NONE]
        steps, _ = phases(router)
        d = delta(counters(router, NONE), before)
        caught += d.get("refused", 0) == 1 and d.get("restart_gate", 0) == 1
        observed_mal += [float(m) for m in REFUSAL.findall(router.proc.log())[logged_before:]]  # one per refusal
        restart_s.append(steps.get("restart", 0.0))
        observed.append(steps.get("gate"))
        engine = router.engine(NONE)
        assert engine["last_verdict"]["observed_mal"] == pytest.approx(FULL) and engine["state"] == "awake", engine
    assert caught == INJECTED, f"caught {caught} of {INJECTED} injected collapses"
    assert observed_mal == [1.0] * INJECTED, observed_mal

    REPORT["cycles"] = {
        "healthy_cycles": HEALTHY_CYCLES,
        "false_refusals": healthy[SPEC].get("refused", 0) + healthy[PLAIN].get("refused", 0),
        "injected": INJECTED,
        "caught": caught,
        "refused_at_mal": observed_mal,
        "healthy_mal": sorted(set(healthy_mal)),
        "healthy_drift": {"wakes": len(healthy_drift), "max": max(healthy_drift),
                          "median": statistics.median(healthy_drift), "exactly_zero": sum(d == 0 for d in healthy_drift)},
        "spec_wake_phases": {p: summary([w[p] for w in wakes[SPEC]]) for p in wakes[SPEC][0]} if wakes[SPEC] else {},
        "plain_wake_phases": {p: summary([w[p] for w in wakes[PLAIN]]) for p in wakes[PLAIN][0]} if wakes[PLAIN] else {},
        "healthy_swap_s": summary(swap_s) if swap_s else {},
        "refused_gate_s": summary([g for g in observed if g is not None]) if INJECTED else {},
        "restart_s": summary(restart_s) if INJECTED else {},
    }
