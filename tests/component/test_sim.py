"""The simulated vLLM engine (engines/sim), exercised as a real process over loopback.

These tests pin the behaviour the router's own component tests rely on: vLLM's
endpoint shapes, sleep/wake semantics (including the Level-2 draft collapse), the
promotion-gate signals (acceptance counters, deterministic text) and the fault knobs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from http.client import HTTPConnection

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from engines.sim import lm
from engines.sim.flags import build_parser, parse_args

pytestmark = pytest.mark.timeout(30)

SPEC = [
    "--speculative-config",
    json.dumps({"num_speculative_tokens": 3, "model": "sim-draft", "method": "eagle"}),
    "--worker-extension-cls",
    "engines.vllm_worker.HotswapWorkerExtension",
]
FAST = ["--sim-token-rate", "100000"]
CANARY = "The quick brown fox jumps over the lazy dog"
MAL_TOL = 0.05


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        yield s


# ---- helpers ------------------------------------------------------------------------


async def call(http, sim, method, path, *, json_body=None, params=None, headers=None):
    async with http.request(method, sim.url + path, json=json_body, params=params, headers=headers) as r:
        text = await r.text()
        try:
            body = json.loads(text) if text else None
        except json.JSONDecodeError:
            body = text
        return r.status, body


async def dev(http, sim, path, params=None, json_body=None):
    status, body = await call(http, sim, "POST", path, params=params, json_body=json_body)
    assert status == 200, (path, status, body)
    return body


async def rpc(http, sim, method):
    return (await dev(http, sim, "/collective_rpc", json_body={"method": method, "args": [], "kwargs": {}}))["results"]


async def complete(http, sim, prompt=CANARY, max_tokens=64, **extra):
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    status, resp = await call(http, sim, "POST", "/v1/completions", json_body=body)
    assert status == 200, resp
    return resp


async def scrape(http, sim) -> dict:
    async with http.get(sim.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def canary(http, sim, prompt=CANARY, max_tokens=64):
    """(text, mean acceptance length) from counter deltas around one generation."""
    before = await scrape(http, sim)
    text = (await complete(http, sim, prompt, max_tokens))["choices"][0]["text"]
    after = await scrape(http, sim)
    drafts = metric(after, "vllm:spec_decode_num_drafts_total") - metric(before, "vllm:spec_decode_num_drafts_total")
    acc = metric(after, "vllm:spec_decode_num_accepted_tokens_total") - metric(
        before, "vllm:spec_decode_num_accepted_tokens_total"
    )
    assert drafts > 0, "the canary did not move the spec-decode counters"
    return text, 1 + acc / drafts


async def staged_l2_cycle(http, sim, *, reload_draft=False):
    """The router's Level-2 sleep and staged wake (DESIGN.md), minus the gate."""
    assert await dev(http, sim, "/sleep", {"level": "2", "mode": "wait"}) == {"status": "sleeping", "level": 2}
    assert (await dev(http, sim, "/wake_up", {"tags": "weights"}))["status"] == "sleeping"
    if reload_draft:
        assert (await rpc(http, sim, "hotswap_reload_draft"))[0]["reloaded"] is True
    assert await rpc(http, sim, "reload_weights") == [None]
    assert (await dev(http, sim, "/wake_up", {"tags": "kv_cache"}))["status"] == "awake"
    assert await dev(http, sim, "/reset_prefix_cache") == {"success": True}


async def state(http, sim) -> dict:
    status, body = await call(http, sim, "GET", "/sim/state")
    assert status == 200
    return body


async def poll(predicate, timeout=5.0, interval=0.01):
    deadline = time.monotonic() + timeout
    while True:
        result = await predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(interval)


async def pending_after(task, seconds) -> bool:
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return not done


def is_junk(text: str) -> bool:
    return not any(w in lm.WORDS for w in text.split())


# ---- boot, argv, shutdown -------------------------------------------------------------


async def test_port_is_bound_only_after_boot_and_unknown_vllm_flags_are_ignored(start_sim_engine, http):
    t0 = time.monotonic()
    sim = start_sim_engine(
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.5", "--enable-prefix-caching",
        "--served-model-name", "alpha", "beta", "--enable-sleep-mode",
        boot_s=0.5, wait=False,
    )  # fmt: skip
    await poll(lambda: _stdout_has(sim, "vLLM API server version"))  # the process is up and booting
    assert sim.health_status() is None  # booting: nothing listens yet
    sim.wait_healthy()
    assert time.monotonic() - t0 >= 0.5
    out = sim.stdout()
    assert "Uvicorn running on http://127.0.0.1:%d" % sim.port in out
    assert "--dtype float32 --enforce-eager --gpu-memory-utilization 0.5 --enable-prefix-caching" in out
    status, models = await call(http, sim, "GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == ["alpha", "beta"]


def test_every_simulator_knob_says_in_help_what_it_models():
    """The simulator's flags are its documentation: a --sim-* flag without a help text is a knob nobody can find."""
    silent = [a.option_strings[0] for a in build_parser()._actions
              if any(o.startswith("--sim-") for o in a.option_strings) and not (a.help or "").strip()]
    assert not silent, f"--sim-* flags without a help text: {silent}"


def test_argv_parsing_matches_vllm_serve():
    args, unknown = parse_args(["serve", "/models/x", "--dtype", "float32", "--port", "9"])
    assert (args.model, args.port, args.host, unknown) == ("/models/x", 9, "127.0.0.1", ["--dtype", "float32"])
    args, unknown = parse_args(["serve", "--dtype", "float32", "--model", "m", "--sleep-preserve-parameter-names", "draft.*"])
    assert (args.model, unknown, args.sleep_preserve_parameter_names) == ("m", ["--dtype", "float32"], ["draft.*"])
    args, _ = parse_args(["serve", "m", "--sim-fault", "metrics=malformed", "--sim-fault", "generate=cut"])
    assert args.sim_fault == [("metrics", "malformed"), ("generate", "cut")]
    args, _ = parse_args(["serve", "m", "--speculative-config", '{"num_speculative_tokens": 2}',
                          "--per-request-spec-decode-metrics", "summary", "--sim-prompt-acceptance", "a=b=1.5"])
    assert (args.per_request_spec_decode_metrics, args.sim_prompt_acceptance) == ("summary", [("a=b", 1.5)])
    for bad in (
        ["serve"],
        ["serve", "m", "--speculative-config", "{nope"],
        ["serve", "m", "--speculative-config", '{"num_speculative_tokens": 2}', "--sim-acceptance", "3.5"],
        ["serve", "m", "--sim-fault", "wake=explode"],
        ["serve", "m", "--sim-fault", "boot=cut"],  # boot has no HTTP answer to break
        ["serve", "m", "--sim-step-delay", "nostep=1"],
        ["serve", "m", "--per-request-spec-decode-metrics", "summary"],  # vLLM refuses it without a draft too
        ["serve", "m", "--speculative-config", '{"num_speculative_tokens": 2}', "--sim-prompt-acceptance", "x=3.5"],
        ["serve", "m", "--sim-prompt-acceptance", "no-value"],
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2, bad


def test_fail_boot_exits_1_with_the_error_on_stderr(start_sim_engine):
    sim = start_sim_engine("--sim-fail-boot", boot_s=0.05, wait=False)
    assert sim.wait_exit() == 1
    assert "RuntimeError: simulated boot failure: CUDA out of memory" in sim.stderr()
    assert "Uvicorn running" not in sim.stdout()


async def test_sigterm_exits_0_quickly_even_with_a_request_hanging(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    await dev(http, sim, "/sleep", {"level": "1"})
    hanging = asyncio.create_task(complete(http, sim))
    await poll(lambda: _waiting(http, sim, 1))
    t0 = time.monotonic()
    os.kill(sim.pid, signal.SIGTERM)
    assert await asyncio.to_thread(sim.wait_exit) == 0
    assert time.monotonic() - t0 < 1.0
    hanging.cancel()
    await asyncio.gather(hanging, return_exceptions=True)


async def _stdout_has(sim, text):
    return text in sim.stdout()


async def _waiting(http, sim, n):
    return (await state(http, sim))["waiting"] == n


async def _running(http, sim, n):
    return (await state(http, sim))["running"] == n


# ---- OpenAI surface ---------------------------------------------------------------------


async def test_openai_endpoints_have_vllm_shapes(shared_sim_engine, http):
    sim = shared_sim_engine
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200 and await r.read() == b""
    status, models = await call(http, sim, "GET", "/v1/models")
    assert status == 200 and models["object"] == "list"
    (card,) = models["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent")} == {
        "id": "sim-model", "object": "model", "owned_by": "vllm", "root": "sim-model", "parent": None,
    }  # fmt: skip
    assert isinstance(card["created"], int) and card["max_model_len"] > 0

    c = await complete(http, sim, "one two three", max_tokens=5)
    assert c["object"] == "text_completion" and c["id"].startswith("cmpl-") and c["model"] == "sim-model"
    assert c["choices"][0]["finish_reason"] == "length" and len(c["choices"][0]["text"].split()) == 5
    assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": None}
    # Deterministic at temperature 0: same prompt, same text.
    assert (await complete(http, sim, "one two three", max_tokens=5))["choices"][0]["text"] == c["choices"][0]["text"]
    default = (await complete(http, sim, "one two three", max_tokens=None))  # vLLM's default max_tokens here
    assert default["usage"]["completion_tokens"] == 16

    status, chat = await call(http, sim, "POST", "/v1/chat/completions", json_body={
        "model": "sim-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, "temperature": 0,
    })  # fmt: skip
    assert status == 200 and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant" and len(chat["choices"][0]["message"]["content"].split()) == 4
    assert chat["usage"]["completion_tokens"] == 4

    status, err = await call(http, sim, "POST", "/v1/completions", json_body={"model": "x", "prompt": "a"})
    assert status == 404 and err == {
        "error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    }
    async with http.post(sim.url + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    status, err = await call(http, sim, "POST", "/v1/completions", json_body={"model": "sim-model", "prompt": "a", "n": 2})
    assert status == 400


async def _sse(http, sim, path, body):
    """[(arrival time, payload)] of a stream, with the [DONE] marker as the string."""
    events = []
    async with http.post(sim.url + path, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[6:]
                events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    return events


async def test_streams_send_one_token_per_chunk_as_produced_then_usage_and_done(start_sim_engine, http):
    sim = start_sim_engine("--sim-token-rate", "50")
    body = {"model": "sim-model", "prompt": CANARY, "max_tokens": 10, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = await _sse(http, sim, "/v1/completions", body)
    assert events[-1][1] == "[DONE]"
    usage = events[-2][1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    tokens = [e for _, e in events[:-2]]
    assert len(tokens) == 10 and all(t["object"] == "text_completion" for t in tokens)
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 9 + ["length"]
    text = "".join(t["choices"][0]["text"] for t in tokens)
    assert text == (await complete(http, sim, CANARY, 10))["choices"][0]["text"]
    # 10 tokens at 50/s: chunks spread over ~0.2 s, so they were not buffered to the end.
    assert events[-3][0] - events[0][0] > 0.1

    chat = await _sse(http, sim, "/v1/chat/completions", {
        "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True,
    })  # fmt: skip
    assert chat[-1][1] == "[DONE]"
    chunks = [e for _, e in chat[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "length"  # no usage chunk unless asked


async def test_the_openai_sdk_talks_to_it(shared_sim_engine):
    sim = shared_sim_engine
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused")
    try:
        assert [m.id for m in (await client.models.list()).data] == ["sim-model"]
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
        )
        assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content
        stream = await client.completions.create(model="sim-model", prompt="x y", max_tokens=4, temperature=0, stream=True)
        assert len([c async for c in stream]) == 4
        emb = await client.embeddings.create(model="sim-model", input=["a b", "c"])  # SDK asks for base64
        again = await client.embeddings.create(model="sim-model", input="a b", encoding_format="float")
        assert len(emb.data) == 2 and len(emb.data[0].embedding) == lm.EMBEDDING_DIM
        assert emb.data[0].embedding == pytest.approx(again.data[0].embedding, abs=1e-6)
        assert emb.data[0].embedding != pytest.approx(emb.data[1].embedding, abs=1e-3)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x")
    finally:
        await client.close()


# ---- metrics ------------------------------------------------------------------------------


async def test_metrics_use_vllm_names_and_labels(shared_sim_engine, http):
    sim = shared_sim_engine
    before = await scrape(http, sim)
    await complete(http, sim, max_tokens=8)
    m = await scrape(http, sim)
    labels = {"model_name": "sim-model", "engine": "0"}
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert (name, frozenset(labels.items())) in m, name

    def delta(name, **labels):
        return metric(m, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:prompt_tokens_total") == len(CANARY.split())
    drafts = delta("vllm:spec_decode_num_drafts_total")
    assert drafts > 0 and delta("vllm:spec_decode_num_draft_tokens_total") == 3 * drafts
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert sum(per_pos) == delta("vllm:spec_decode_num_accepted_tokens_total") > 0
    assert per_pos == sorted(per_pos, reverse=True)  # position p is only reached if p-1 was accepted
    assert metric(m, "vllm:engine_sleep_state", sleep_state="awake") == 1


async def test_sleep_state_gauge_follows_the_level(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    states = ("awake", "weights_offloaded", "discard_all")

    async def gauge():
        m = await scrape(http, sim)
        return [metric(m, "vllm:engine_sleep_state", sleep_state=s) for s in states]

    assert await gauge() == [1, 0, 0]
    await dev(http, sim, "/sleep", {"level": "1"})
    assert await gauge() == [0, 1, 0]
    await dev(http, sim, "/wake_up")
    await dev(http, sim, "/sleep", {"level": "2"})
    assert await gauge() == [0, 0, 1]


async def test_spec_counters_exist_only_with_a_speculative_config_and_stats(start_sim_engine, http):
    plain = start_sim_engine(*FAST)
    names = {n for n, _ in await scrape(http, plain)}
    assert "vllm:generation_tokens_total" in names and not any("spec_decode" in n for n in names)
    quiet = start_sim_engine(*FAST, *SPEC, "--disable-log-stats")
    await complete(http, quiet, max_tokens=4)
    assert not any(n.startswith("vllm:") for n, _ in await scrape(http, quiet))


async def test_counters_lag_the_response_by_the_configured_time(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC, "--sim-metrics-lag-s", "0.4")
    await complete(http, sim, max_tokens=16)
    done = time.monotonic()
    m = await scrape(http, sim)
    assert metric(m, "vllm:spec_decode_num_drafts_total") == 0 and metric(m, "vllm:generation_tokens_total") == 0

    async def moved():
        return metric(await scrape(http, sim), "vllm:spec_decode_num_drafts_total") > 0

    await poll(moved)
    assert time.monotonic() - done >= 0.35


# ---- dev API, auth --------------------------------------------------------------------------


async def test_dev_endpoints_are_404_without_dev_mode(start_sim_engine, http):
    sim = start_sim_engine(*FAST, dev_mode=False)
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache")]:  # fmt: skip
        status, body = await call(http, sim, method, path, json_body={"method": "reload_weights"})
        assert status == 404, path
    assert (await call(http, sim, "GET", "/v1/models"))[0] == 200
    assert (await call(http, sim, "GET", "/sim/state"))[0] == 200


async def test_api_key_guards_v1_but_not_the_dev_api(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--api-key", "sekret")
    assert (await call(http, sim, "GET", "/v1/models"))[0] == 401
    assert (await call(http, sim, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}))[0] == 401
    assert (await call(http, sim, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"}))[0] == 200
    assert (await call(http, sim, "GET", "/health"))[0] == 200
    assert (await call(http, sim, "GET", "/metrics"))[0] == 200
    assert await dev(http, sim, "/sleep") == {"status": "sleeping", "level": 1}
    assert (await call(http, sim, "GET", "/is_sleeping")) == (200, {"is_sleeping": True})


async def test_generation_sent_while_asleep_hangs_until_fully_awake(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    expected = (await complete(http, sim))["choices"][0]["text"]
    await dev(http, sim, "/sleep", {"level": "1"})
    assert (await call(http, sim, "GET", "/health"))[0] == 200
    assert (await call(http, sim, "GET", "/is_sleeping"))[1] == {"is_sleeping": True}
    task = asyncio.create_task(complete(http, sim))
    assert await pending_after(task, 0.3)
    await poll(lambda: _waiting(http, sim, 1))
    assert metric(await scrape(http, sim), "vllm:num_requests_waiting") == 1
    assert (await dev(http, sim, "/wake_up", {"tags": "weights"}))["status"] == "sleeping"
    assert await pending_after(task, 0.2)  # weights alone do not resume scheduling
    assert (await dev(http, sim, "/wake_up", {"tags": "kv_cache"}))["status"] == "awake"
    result = await asyncio.wait_for(task, 5)
    assert result["choices"][0]["text"] == expected  # Level 1 kept the weights
    assert (await call(http, sim, "GET", "/is_sleeping"))[1] == {"is_sleeping": False}


async def test_sleep_modes_abort_wait_keep(start_sim_engine, http):
    sim = start_sim_engine("--sim-token-rate", "400")
    body = {"model": "sim-model", "prompt": "p", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    # abort: in-flight requests end with an error, streamed or not.
    plain = asyncio.create_task(call(http, sim, "POST", "/v1/completions", json_body=body))
    streamed = asyncio.create_task(_sse(http, sim, "/v1/completions", {**body, "stream": True}))
    await poll(lambda: _running(http, sim, 2))
    await dev(http, sim, "/sleep", {"level": "1", "mode": "abort"})
    status, err = await asyncio.wait_for(plain, 5)
    assert status == 500 and "abort" in err["error"]["message"]
    events = await asyncio.wait_for(streamed, 5)
    assert events[-1][1] == "[DONE]" and "error" in events[-2][1]
    await dev(http, sim, "/wake_up")

    # wait: the sleep answers only after the in-flight request completed normally.
    short = {**body, "max_tokens": 40}
    inflight = asyncio.create_task(call(http, sim, "POST", "/v1/completions", json_body=short))
    await poll(lambda: _running(http, sim, 1))
    await dev(http, sim, "/sleep", {"level": "1", "mode": "wait"})
    assert inflight.done()
    status, resp = inflight.result()
    assert status == 200 and resp["usage"]["completion_tokens"] == 40
    await dev(http, sim, "/wake_up")

    # keep: the request freezes mid-decode and finishes after the wake.
    paused = asyncio.create_task(call(http, sim, "POST", "/v1/completions", json_body=short))
    await poll(lambda: _running(http, sim, 1))
    await dev(http, sim, "/sleep", {"level": "1", "mode": "keep"})
    assert await pending_after(paused, 0.25)  # 40 tokens at 400/s would be done by now
    await dev(http, sim, "/wake_up")
    status, resp = await asyncio.wait_for(paused, 5)
    assert status == 200 and resp["usage"]["completion_tokens"] == 40


# ---- the engine model: the Level-2 draft collapse -------------------------------------------


async def test_level2_wake_loses_the_draft_silently_until_it_is_reloaded(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    text0, mal0 = await canary(http, sim)
    assert mal0 == pytest.approx(2.6, abs=MAL_TOL)
    digest0 = (await rpc(http, sim, "hotswap_draft_digest"))[0]

    await staged_l2_cycle(http, sim)
    text1, mal1 = await canary(http, sim)
    assert mal1 == 1.0
    assert text1 == text0  # verification keeps the output right: the bug is silent
    assert (await rpc(http, sim, "hotswap_draft_digest"))[0] != digest0
    st = await state(http, sim)
    assert (st["target"], st["draft"], st["sleeping"]) == ("loaded", "discarded", False)

    assert await rpc(http, sim, "hotswap_reload_draft") == [{"reloaded": True, "tensors": 12}]
    text2, mal2 = await canary(http, sim)
    assert (text2, (await rpc(http, sim, "hotswap_draft_digest"))[0]) == (text0, digest0)
    assert mal2 == pytest.approx(2.6, abs=MAL_TOL)

    # The staged wake with the draft restore never collapses.
    await staged_l2_cycle(http, sim, reload_draft=True)
    assert (await canary(http, sim))[1] == pytest.approx(2.6, abs=MAL_TOL)


async def test_acceptance_follows_the_configured_value(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC, "--sim-acceptance", "3.4")
    assert (await canary(http, sim))[1] == pytest.approx(3.4, abs=MAL_TOL)


async def test_a_discarded_draft_halves_the_decode_rate(start_sim_engine, http):
    sim = start_sim_engine("--sim-token-rate", "1000", *SPEC)
    body = {"model": "sim-model", "prompt": CANARY, "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}

    async def timed():
        # Decode time only: first to last token chunk, without request overheads.
        events = await _sse(http, sim, "/v1/completions", body)
        return events[-2][0] - events[0][0]

    healthy = await timed()
    await rpc(http, sim, "hotswap_discard_draft")
    broken = await timed()
    assert broken > 1.5 * healthy, (healthy, broken)


@pytest.mark.parametrize(("pattern", "mal"), [("draft.*", 2.6), ("draft.lm_head.*", 1.0)])
async def test_preserving_draft_parameters_keeps_acceptance_across_level2(start_sim_engine, http, pattern, mal):
    sim = start_sim_engine(*FAST, *SPEC, "--sleep-preserve-parameter-names", pattern)
    text0, _ = await canary(http, sim)
    await staged_l2_cycle(http, sim)
    text1, mal1 = await canary(http, sim)
    assert text1 == text0
    assert mal1 == pytest.approx(mal, abs=MAL_TOL)  # only a selection covering the whole draft keeps it


async def test_level1_keeps_target_and_draft(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    text0, _ = await canary(http, sim)
    await dev(http, sim, "/sleep", {"level": "1"})
    assert metric(await scrape(http, sim), "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    assert (await dev(http, sim, "/wake_up"))["status"] == "awake"
    text1, mal1 = await canary(http, sim)
    assert text1 == text0 and mal1 == pytest.approx(2.6, abs=MAL_TOL)
    st = await state(http, sim)
    assert (st["target"], st["draft"]) == ("loaded", "loaded")


async def test_target_not_reloaded_after_level2_gives_garbage(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    text0, _ = await canary(http, sim)
    assert not is_junk(text0)
    await dev(http, sim, "/sleep", {"level": "2"})
    await dev(http, sim, "/wake_up")  # weights and KV cache back, contents never reloaded
    text1, mal1 = await canary(http, sim)
    assert is_junk(text1) and not text1.startswith(text0[:20])
    assert mal1 == 1.0
    assert (await state(http, sim))["target"] == "discarded"
    await rpc(http, sim, "reload_weights")
    assert (await canary(http, sim))[0] == text0


async def test_output_is_the_same_across_restarts(start_sim_engine, http):
    # Booted side by side: only the outputs matter here, not the order.
    a, b, other = (start_sim_engine(*FAST, model=m, wait=False) for m in ("sim-model", "sim-model", "other-model"))
    for sim in (a, b, other):
        sim.wait_healthy()
    assert (await complete(http, a))["choices"][0]["text"] == (await complete(http, b))["choices"][0]["text"]
    status, resp = await call(http, other, "POST", "/v1/completions",
                              json_body={"prompt": CANARY, "max_tokens": 64, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert status == 200 and resp["model"] == "other-model"
    assert resp["choices"][0]["text"] != (await complete(http, a))["choices"][0]["text"]


async def test_collective_rpc_methods(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    status, err = await call(http, sim, "POST", "/collective_rpc", json_body={"method": "no_such_method"})
    assert status == 500 and err["error"]["code"] == 500 and "no_such_method" in err["error"]["message"]
    # As vLLM's uvicorn after the exception: that connection is closed unannounced, and the request
    # it carries next is never answered (a POST, which aiohttp does not retry by itself).
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await call(http, sim, "POST", "/reset_prefix_cache")
    assert await rpc(http, sim, "hotswap_discard_draft") == [{"discarded": 12}]  # a new connection
    assert (await state(http, sim))["draft"] == "discarded"

    bare = start_sim_engine(*FAST, *SPEC[:2])  # no --worker-extension-cls
    assert await rpc(http, bare, "reload_weights") == [None]
    for method in ("hotswap_reload_draft", "hotswap_draft_digest"):
        status, err = await call(http, bare, "POST", "/collective_rpc", json_body={"method": method},
                                 headers={"Connection": "close"})  # as the router sends them
        assert status == 500, method


async def test_a_load_format_vllm_cannot_reload_fails_reload_weights_and_the_drafts_as_vllm_does(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC, "--load-format", "tensorizer")
    await dev(http, sim, "/sleep", {"level": "2"})
    await dev(http, sim, "/wake_up", {"tags": "weights"})
    for method in ("hotswap_reload_draft", "reload_weights"):
        status, err = await call(http, sim, "POST", "/collective_rpc", json_body={"method": method})
        assert status == 500 and "NotImplementedError: Model reloading with `tensorizer` format" in err["error"]["message"], err
    plain = start_sim_engine(*FAST, "--load-format", "safetensors")
    assert await rpc(http, plain, "reload_weights") == [None]


async def test_reset_prefix_cache_answers_false_n_times_after_each_wake(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--sim-reset-prefix-false", "2")

    async def answers(n):
        return [(await dev(http, sim, "/reset_prefix_cache"))["success"] for _ in range(n)]

    assert await answers(1) == [True]
    for _ in range(2):
        await dev(http, sim, "/sleep", {"level": "1"})
        await dev(http, sim, "/wake_up")
        assert await answers(3) == [False, False, True]


async def test_call_log_records_the_wake_order_and_queries(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    await complete(http, sim, max_tokens=2)
    await staged_l2_cycle(http, sim, reload_draft=True)
    status, entries = await call(http, sim, "GET", "/sim/log")
    assert [e["step"] for e in entries] == [
        "generate", "sleep", "wake_weights", "reload_draft", "reload_weights", "wake_kv_cache", "reset_prefix_cache",
    ]  # fmt: skip
    assert entries[0]["path"] == "/v1/completions" and entries[0]["model"] == "sim-model"
    assert entries[1]["query"] == {"level": "2", "mode": "wait"}
    assert entries[2]["query"] == {"tags": ["weights"]}
    assert (entries[3]["method"], entries[4]["method"]) == ("hotswap_reload_draft", "reload_weights")
    assert [e["t"] for e in entries] == sorted(e["t"] for e in entries)


# ---- faults ------------------------------------------------------------------------------------


async def test_cli_fault_http500_answers_500_and_does_not_act(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--sim-fault", "wake_weights=http500", "--sim-fault", "generate=http500")
    await dev(http, sim, "/sleep", {"level": "2"})
    status, err = await call(http, sim, "POST", "/wake_up", params={"tags": "weights"})
    assert status == 500 and err["error"]["code"] == 500
    assert (await state(http, sim))["weights_awake"] is False
    assert (await dev(http, sim, "/wake_up", {"tags": "kv_cache"}))["status"] == "sleeping"
    status, _ = await call(http, sim, "POST", "/v1/completions", json_body={"prompt": "x"})
    assert status == 500


async def test_fault_hang_never_answers_but_the_server_lives(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--sim-fault", "reload_weights=hang")
    task = asyncio.create_task(call(http, sim, "POST", "/collective_rpc", json_body={"method": "reload_weights"}))
    assert await pending_after(task, 0.3)
    assert (await call(http, sim, "GET", "/health"))[0] == 200
    entries = (await call(http, sim, "GET", "/sim/log"))[1]
    assert entries[-1]["step"] == "reload_weights"  # called, never answered
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_fault_crash_kills_the_process_at_once(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--sim-fault", "sleep=crash")
    with pytest.raises(aiohttp.ClientError):
        await call(http, sim, "POST", "/sleep", params={"level": "2"})
    assert await asyncio.to_thread(sim.wait_exit) == 1
    assert "injected crash at step sleep" in sim.stderr()


async def test_runtime_faults_fire_the_given_number_of_times(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    status, _ = await call(http, sim, "POST", "/sim/faults", json_body={"step": "nope", "kind": "crash"})
    assert status == 400
    fault = {"step": "reset_prefix_cache", "kind": "http500", "times": 2}
    assert (await call(http, sim, "POST", "/sim/faults", json_body=fault))[0] == 200
    assert (await call(http, sim, "GET", "/sim/faults"))[1] == [fault]
    statuses = [(await call(http, sim, "POST", "/reset_prefix_cache"))[0] for _ in range(3)]
    assert statuses == [500, 500, 200]
    assert (await call(http, sim, "GET", "/sim/faults"))[1] == []
    await call(http, sim, "POST", "/sim/faults", json_body={"step": "generate", "kind": "http500"})
    assert (await call(http, sim, "POST", "/v1/completions", json_body={"prompt": "x"}))[0] == 500
    assert (await call(http, sim, "DELETE", "/sim/faults"))[1] == {"cleared": 1}
    assert (await call(http, sim, "POST", "/v1/completions", json_body={"prompt": "x"}))[0] == 200


async def test_step_delay_slows_that_step_only(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--sim-step-delay", "wake_kv_cache=0.5")
    await dev(http, sim, "/sleep")
    t0 = time.monotonic()
    await dev(http, sim, "/wake_up", {"tags": "weights"})
    plain = time.monotonic() - t0
    t0 = time.monotonic()
    await dev(http, sim, "/wake_up", {"tags": "kv_cache"})
    delayed = time.monotonic() - t0
    assert delayed >= 0.5 and plain < delayed - 0.2, (plain, delayed)


async def test_a_level1_sleep_copying_weights_out_takes_its_own_delay_and_a_level2_sleep_does_not(start_sim_engine, http):
    sim = start_sim_engine(*FAST, "--sim-step-delay", "sleep_level1=0.5")
    t0 = time.monotonic()
    await dev(http, sim, "/sleep", {"level": "2"})
    level2 = time.monotonic() - t0
    await dev(http, sim, "/wake_up")
    t0 = time.monotonic()
    await dev(http, sim, "/sleep", {"level": "1"})
    level1 = time.monotonic() - t0
    assert level1 >= 0.5 and level2 < level1 - 0.2, (level1, level2)


async def test_crash_mid_stream_after_n_chunks(start_sim_engine, http):
    sim = start_sim_engine("--sim-token-rate", "1000", "--sim-crash-mid-stream", "3")
    received = []
    with pytest.raises(aiohttp.ClientError):
        async with http.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    received.append(line)
            raise AssertionError("the stream ended cleanly: no crash")
    assert len(received) == 3 and b"[DONE]" not in b"".join(received)
    assert await asyncio.to_thread(sim.wait_exit) == 1


async def add_fault(http, sim, step, kind, times):
    status, body = await call(http, sim, "POST", "/sim/faults", json_body={"step": step, "kind": kind, "times": times})
    assert status == 200, body


async def fired(http, sim, kind) -> list[dict]:
    return [e for e in (await call(http, sim, "GET", "/sim/log"))[1] if e.get("fault") == kind]


async def _stream_until_broken(http, sim, path, body):
    """(data payloads as strings, the error that ended the read or None)."""
    data = []
    async with http.post(sim.url + path, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        try:
            async for line in r.content:
                if line.startswith(b"data: "):
                    data.append(line[6:].decode().strip())
        except aiohttp.ClientError as e:
            return data, e
    return data, None


async def test_fault_http500_and_hang_at_metrics(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    await add_fault(http, sim, "metrics", "http500", 1)
    status, err = await call(http, sim, "GET", "/metrics")
    assert status == 500 and err["error"]["code"] == 500
    assert "vllm:generation_tokens_total" in {n for n, _ in await scrape(http, sim)}  # fired once, then gone

    await add_fault(http, sim, "metrics", "hang", 1)
    hung = asyncio.create_task(scrape(http, sim))
    assert await pending_after(hung, 0.3)
    assert await scrape(http, sim) and (await call(http, sim, "GET", "/health"))[0] == 200
    hung.cancel()
    await asyncio.gather(hung, return_exceptions=True)
    # Scrapes are not logged, but their faults are.
    assert [(e["step"], e["fault"]) for e in (await call(http, sim, "GET", "/sim/log"))[1]] == [
        ("metrics", "http500"), ("metrics", "hang"),
    ]  # fmt: skip


async def test_fault_malformed_metrics_is_a_200_that_a_prometheus_parser_rejects(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    await add_fault(http, sim, "metrics", "malformed", 2)
    for _ in range(2):
        async with http.get(sim.url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        with pytest.raises(ValueError):
            list(text_string_to_metric_families(text))
    assert "vllm:generation_tokens_total" in {n for n, _ in await scrape(http, sim)}
    assert len(await fired(http, sim, "malformed")) == 2
    assert (await call(http, sim, "GET", "/health"))[0] == 200


async def test_fault_malformed_generate_answers_200_with_a_body_that_is_not_json(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    await add_fault(http, sim, "generate", "malformed", 4)
    completion = {"model": "sim-model", "prompt": "x", "max_tokens": 4}
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for path, body, prefix in (("/v1/completions", completion, '{"id": "cmpl-'),
                               ("/v1/chat/completions", chat, '{"id": "chatcmpl-')):  # fmt: skip
        async with http.post(sim.url + path, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
            raw = await r.text()
        assert raw == prefix
        with pytest.raises(json.JSONDecodeError):
            json.loads(raw)
        # A stream is well framed and ends with [DONE]; its one event does not parse.
        data, error = await _stream_until_broken(http, sim, path, {**body, "stream": True})
        assert error is None and data == [prefix, "[DONE]"]

    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    try:
        await add_fault(http, sim, "generate", "malformed", 2)
        with pytest.raises(json.JSONDecodeError):
            await client.completions.create(model="sim-model", prompt="x", max_tokens=4)
        stream = await client.chat.completions.create(model="sim-model", messages=chat["messages"], max_tokens=4, stream=True)
        with pytest.raises(json.JSONDecodeError):
            [c async for c in stream]
        # Fired six times, acted never, and gone: the next request is served.
        assert len(await fired(http, sim, "malformed")) == 6
        assert metric(await scrape(http, sim), "vllm:generation_tokens_total") == 0
        assert (await client.completions.create(model="sim-model", prompt="x", max_tokens=4)).usage.completion_tokens == 4
    finally:
        await client.close()


async def test_fault_malformed_at_a_dev_step_is_a_200_that_is_not_json_and_does_not_act(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    await add_fault(http, sim, "sleep", "malformed", 1)
    async with http.post(sim.url + "/sleep", params={"level": "1"}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
        with pytest.raises(json.JSONDecodeError):
            await r.json()
    assert (await call(http, sim, "GET", "/is_sleeping"))[1] == {"is_sleeping": False}
    assert await dev(http, sim, "/sleep", {"level": "1"}) == {"status": "sleeping", "level": 1}
    assert [e["step"] for e in await fired(http, sim, "malformed")] == ["sleep"]


async def test_fault_cut_drops_a_stream_after_half_its_chunks_and_the_server_lives(start_sim_engine, http):
    sim = start_sim_engine("--sim-token-rate", "5000")
    await add_fault(http, sim, "generate", "cut", 3)
    body = {"model": "sim-model", "prompt": CANARY, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}
    data, error = await _stream_until_broken(http, sim, "/v1/completions", body)
    # No terminating chunk: aiohttp sees an incomplete body, not a clean end of stream.
    assert isinstance(error, aiohttp.ClientPayloadError)
    chunks = [json.loads(d) for d in data]
    assert len(chunks) == 5 and all(c["choices"][0]["finish_reason"] is None for c in chunks)

    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    data, error = await _stream_until_broken(http, sim, "/v1/chat/completions", chat)
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert len(data) == 2 and "[DONE]" not in data  # the role chunk and the one token: at least one

    # A generation that stops (EOS) before half its max_tokens is cut before its last token.
    data, error = await _stream_until_broken(http, sim, "/v1/completions", {**body, "max_tokens": 1000, "ignore_eos": False})
    assert isinstance(error, aiohttp.ClientPayloadError)
    natural = lm.natural_length("sim-model", CANARY)
    assert len(data) == natural - 1 and all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data)

    assert len(await fired(http, sim, "cut")) == 3
    await poll(lambda: _running(http, sim, 0))  # the cut generations were aborted
    data, error = await _stream_until_broken(http, sim, "/v1/completions", body)
    assert error is None and data[-1] == "[DONE]" and len(data) == 11
    assert sim.proc.poll() is None and (await call(http, sim, "GET", "/health"))[0] == 200


async def test_fault_cut_closes_the_connection_without_an_answer(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    await add_fault(http, sim, "generate", "cut", 1)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await call(http, sim, "POST", "/v1/completions", json_body={"prompt": "x"})
    await add_fault(http, sim, "reload_draft", "cut", 1)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await call(http, sim, "POST", "/collective_rpc", json_body={"method": "hotswap_reload_draft"})
    # aiohttp retries an idempotent GET once after a disconnect: one cut goes unseen.
    await add_fault(http, sim, "metrics", "cut", 2)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await scrape(http, sim)
    assert await scrape(http, sim)
    assert [e["step"] for e in await fired(http, sim, "cut")] == ["generate", "reload_draft", "metrics", "metrics"]

    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    retrying = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=1)
    try:
        await add_fault(http, sim, "generate", "cut", 3)
        with pytest.raises(openai.APIConnectionError):
            await client.completions.create(model="sim-model", prompt="x", max_tokens=4)
        with pytest.raises(openai.APIConnectionError):
            stream = await client.completions.create(model="sim-model", prompt="x", max_tokens=4, stream=True)
            [c async for c in stream]
        # The SDK retries a connection error: the third and last cut is absorbed.
        assert (await retrying.completions.create(model="sim-model", prompt="x", max_tokens=4)).usage.completion_tokens == 4
        assert (await call(http, sim, "GET", "/sim/faults"))[1] == []
    finally:
        await client.close()
        await retrying.close()
    assert sim.proc.poll() is None and (await call(http, sim, "GET", "/health"))[0] == 200


# ---- bad input ---------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_fields = ["model", "prompt", "messages", "max_tokens", "temperature", "n", "stream", "stream_options",
           "ignore_eos", "seed", "input", "encoding_format", "max_completion_tokens",
           "query", "documents", "queries", "text_1", "text_2", "texts", "tokens", "top_n", "embedding_types",
           "max_output_tokens", "instructions", "system", "previous_response_id", "background", "store"]  # fmt: skip
# The pooling, tokenizer and Responses routes share the OpenAI error shape; /v1/messages* has Anthropic's.
_openai_paths = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank", "/score",
                 "/v2/embed", "/pooling", "/classify", "/tokenize", "/detokenize"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(path="/v1/completions", body={"prompt": "x", "stream": True, "stream_options": [1]})
@example(path="/v1/chat/completions", body={"messages": [{"role": 1, "content": {"a": 1}}]})
@example(path="/v1/chat/completions", body={"messages": [{"role": "user", "content": [1, "x"]}]})
@example(path="/v1/completions", body={"prompt": "x", "seed": {"a": 1}, "temperature": 0.5})
@example(path="/v1/completions", body={"prompt": [[1, "a"]]})
@example(path="/v1/embeddings", body={"input": [1.5]})
@example(path="/v1/embeddings", body={"input": [[]]})
@given(
    path=st.sampled_from(_openai_paths + ["/v1/messages", "/v1/messages/count_tokens"]),
    body=st.dictionaries(st.sampled_from(_fields), _json, max_size=6) | _json,
)
def test_bad_requests_get_a_4xx_in_the_error_shape_never_a_500(shared_sim_engine, path, body):
    conn = HTTPConnection("127.0.0.1", shared_sim_engine.port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    assert resp.status < 500, (resp.status, raw[:300])
    if resp.status >= 400 and path.startswith("/v1/messages"):
        answer = json.loads(raw)
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, answer
    elif resp.status >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == resp.status


# ---- logprobs: the numbers a GPU host gets wrong with the tokens unchanged ----------------------


async def test_logprobs_come_in_vllms_shapes_and_a_second_greedy_canary_agrees_to_the_bit(start_sim_engine, http):
    sim = start_sim_engine(*FAST)
    first, second = [await complete(http, sim, max_tokens=8, logprobs=0) for _ in range(2)]
    lp = first["choices"][0]["logprobs"]
    assert lp["tokens"] == second["choices"][0]["logprobs"]["tokens"] and "".join(lp["tokens"]) == first["choices"][0]["text"]
    assert len(lp["token_logprobs"]) == 8 and all(v <= 0 for v in lp["token_logprobs"]) and lp["top_logprobs"] is None
    assert lp["token_logprobs"] == second["choices"][0]["logprobs"]["token_logprobs"]
    assert (await complete(http, sim, max_tokens=8))["choices"][0]["logprobs"] is None, "not asked for, not sent"
    status, body = await call(http, sim, "POST", "/v1/chat/completions", json_body={
        "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 1})
    assert status == 200 and len(body["choices"][0]["logprobs"]["content"]) == 4, body
    status, body = await call(http, sim, "POST", "/v1/completions", json_body={"model": "sim-model", "prompt": "x", "logprobs": 21})
    assert status == 400 and "greater than max allowed: 20" in body["error"]["message"], body


@pytest.mark.parametrize("flag, value", [("--sim-wake-logprob-shift", "-0.5"), ("--sim-wake-logprob-noise", "1.0")])
async def test_a_wake_fault_moves_the_logprobs_and_leaves_the_tokens(start_sim_engine, http, flag, value):
    sim = start_sim_engine(*FAST, flag, value)
    before = (await complete(http, sim, logprobs=0))["choices"][0]["logprobs"]
    await dev(http, sim, "/sleep", params={"level": "1"})
    await dev(http, sim, "/wake_up")
    after = (await complete(http, sim, logprobs=0))["choices"][0]["logprobs"]
    assert after["tokens"] == before["tokens"]
    moved = [abs(a - b) for a, b in zip(after["token_logprobs"], before["token_logprobs"])]
    assert sum(moved) / len(moved) > 0.2, moved


async def test_jitter_moves_logprobs_only_beside_other_requests(start_sim_engine, http):
    sim = start_sim_engine("--sim-logprob-jitter", "0.01", "--sim-token-rate", "500")
    alone = [(await complete(http, sim, max_tokens=16, logprobs=0))["choices"][0]["logprobs"]["token_logprobs"] for _ in range(2)]
    assert alone[0] == alone[1]
    busy, _ = await asyncio.gather(complete(http, sim, max_tokens=16, logprobs=0),
                                   complete(http, sim, prompt="other traffic", max_tokens=64))
    moved = [abs(a - b) for a, b in zip(busy["choices"][0]["logprobs"]["token_logprobs"], alone[0])]
    assert 0 < max(moved) <= 0.01, moved


async def test_a_perturbed_target_keeps_its_tokens_until_reload_weights_rewrites_it(start_sim_engine, http):
    sim = start_sim_engine(*FAST, *SPEC)
    before = (await complete(http, sim, logprobs=0))["choices"][0]["logprobs"]
    body = lambda *args: {"method": "hotswap_perturb_target", "args": list(args), "kwargs": {}}  # noqa: E731
    (perturbed,) = (await dev(http, sim, "/collective_rpc", json_body=body(1.5)))["results"]
    assert perturbed["digest_after"] != perturbed["digest_before"] and not perturbed["restored"]
    after = (await complete(http, sim, logprobs=0))["choices"][0]["logprobs"]
    assert after["tokens"] == before["tokens"] and after["token_logprobs"] != before["token_logprobs"]
    status, refused = await call(http, sim, "POST", "/collective_rpc", json_body=body(-1))
    assert status == 500 and "scale must be > 0" in refused["error"]["message"]
    await rpc(http, sim, "reload_weights")
    assert (await rpc(http, sim, "hotswap_target_digest")) == [perturbed["digest_before"]]
    assert (await complete(http, sim, logprobs=0))["choices"][0]["logprobs"] == before


async def test_past_max_num_seqs_requests_wait_in_the_engines_queue_and_run_as_slots_free(start_sim_engine, http):
    sim = start_sim_engine("--sim-token-rate", "400", "--max-num-seqs", "1")
    first = asyncio.create_task(complete(http, sim, max_tokens=200))
    await poll(lambda: _running(http, sim, 1))
    second = asyncio.create_task(complete(http, sim, max_tokens=8))
    await poll(lambda: _waiting(http, sim, 1))
    assert metric(await scrape(http, sim), "vllm:num_requests_waiting") == 1
    assert await pending_after(second, 0.1), "the one slot is taken: the second waits for it"
    await asyncio.wait_for(first, 5)
    assert (await asyncio.wait_for(second, 5))["usage"]["completion_tokens"] == 8
    assert (await state(http, sim))["waiting"] == 0
