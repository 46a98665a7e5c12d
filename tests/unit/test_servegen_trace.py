"""The shipped ServeGen trace (bench/traces/servegen-d1-7.jsonl, issue 32 part 4) has the shape the
wake-latency bench reads, and was drawn from days 1-7 only: days 8-14 are kept for an independent check."""

import json
import sys
from pathlib import Path

import pytest

TRACES = Path(__file__).parents[2] / "bench" / "traces"
TRACE = TRACES / "servegen-d1-7.jsonl"
MODELS = {"llama-70b": "chat", "qwen-32b": "chat", "mixtral-8x7b": "chat", "gemma-27b": "chat", "llama-13b": "chat",
          "mistral-7b": "chat", "llama-8b": "chat", "qwen-7b": "chat", "phi-3-mini": "chat", "bge-large": "embeddings"}
FIELDS = {"t", "client", "model", "kind", "prompt_tokens", "output_tokens"}
DAY_S = 86400


def bench_module(name: str):
    """A module of bench/, imported as the bench runs it (bench/ on sys.path, for its `harness`)."""
    sys.path.insert(0, str(TRACES.parent))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(TRACES.parent))


@pytest.fixture(scope="module", name="wake_trace")
def wake_trace_module():
    return bench_module("wake_trace")


@pytest.fixture(scope="module", name="wake_report")
def wake_report_module():
    return bench_module("wake_report")


@pytest.fixture(scope="module")
def trace():
    lines = TRACE.read_text().splitlines()
    return json.loads(lines[0])["header"], [json.loads(line) for line in lines[1:]]


def test_the_trace_is_small_and_of_the_size_asked(trace):
    header, requests = trace
    assert TRACE.stat().st_size < 1_000_000
    assert header["requests"] == len(requests) and 1000 <= len(requests) <= 3000
    assert 600 <= header["stretch"]["seconds"] <= 1200
    assert len({r["client"] for r in requests}) == len(header["clients"]) >= 12


def test_every_request_has_every_field_and_sane_values(trace):
    header, requests = trace
    clients = {c["id"]: c for c in header["clients"]}
    for r in requests:
        assert set(r) == FIELDS, r
        assert isinstance(r["t"], float) and 0 <= r["t"] < header["stretch"]["seconds"] and round(r["t"], 3) == r["t"], r
        assert r["model"] in MODELS and r["kind"] == MODELS[r["model"]], r
        assert r["client"] in clients and clients[r["client"]]["model"] == r["model"], "a client sends to one model"
        assert isinstance(r["prompt_tokens"], int) and isinstance(r["output_tokens"], int), r
        assert r["prompt_tokens"] >= 1, r
        if r["kind"] == "embeddings":
            assert r["output_tokens"] == 0 and r["prompt_tokens"] <= 512, r
        else:
            assert r["output_tokens"] >= 1, r


def test_arrivals_are_sorted(trace):
    _, requests = trace
    ts = [r["t"] for r in requests]
    assert ts == sorted(ts)


def test_only_the_ten_models_each_one_used_and_popularity_is_skewed_with_the_70b_popular(trace):
    header, requests = trace
    assert {m["name"]: m["kind"] for m in header["models"]} == MODELS
    counts = {m: sum(r["model"] == m for r in requests) for m in MODELS}
    assert all(counts.values()), counts
    ranked = sorted(counts, key=counts.get, reverse=True)
    assert counts[ranked[0]] >= 5 * counts[ranked[-1]], counts
    assert "llama-70b" in ranked[:3], ranked


def test_it_used_days_1_to_7_only(trace):
    header, _ = trace
    lo, hi = header["days"]
    assert 1 <= lo <= hi <= 7 and not header["allow_outside_days"]
    stretch = header["stretch"]
    assert (lo - 1) * DAY_S <= stretch["start_s"] < stretch["end_s"] <= hi * DAY_S
    assert stretch["end_s"] - stretch["start_s"] == stretch["seconds"]
    for c in header["clients"]:
        assert (lo - 1) * DAY_S <= c["length_slot_s"] <= stretch["start_s"], c["id"]
        for w in c["windows"]:
            assert stretch["start_s"] <= w["start_s"] < stretch["end_s"] and w["pattern"] in ("Gamma", "Weibull"), c["id"]


def test_the_readme_records_the_stretch_the_commit_and_the_command(trace):
    header, _ = trace
    readme = (TRACES / "README.md").read_text()
    stretch = header["stretch"]
    assert f"{stretch['start_s']}–{stretch['end_s']} s" in readme
    assert header["commit"] in readme and "Apache-2.0" in readme and "days 8–14" in readme
    assert header["command"] in readme
    assert f"{header['requests']} requests" in readme


def test_the_wake_bench_roster_serves_every_model_of_the_trace_on_two_gpus_at_h200_costs(tmp_path, wake_trace):
    """bench/wake_trace.py's roster is one hotswap accepts, places every model of the trace on two GPUs
    with about 2.9 GPUs' worth of shares, and prices each step as an H200 host takes it."""
    from config import parse_roster

    header, reqs = wake_trace.load_trace(TRACE, None)
    assert {r.model for r in reqs} == set(wake_trace.MODELS) == set(MODELS)
    args = wake_trace.parse_args(["--max-hold-s", "20", "--drain-timeout-s", "10"])
    roster = parse_roster(wake_trace.roster(18080, args, tmp_path), "<wake bench>")
    shares = sum(m.gpu_share * len(m.devices) for m in roster.models)
    assert {d for m in roster.models for d in m.devices} == {0, 1} and 2.7 <= shares <= 3.0
    assert roster.swap.demand_tau_s == pytest.approx(30.0) and roster.swap.reuse_horizon_s == pytest.approx(6.0) \
        and roster.swap.max_hold_s == pytest.approx(2.0) and roster.swap.drain_timeout_s == pytest.approx(1.0), \
        "the policy's time constants scale with the trace"
    assert roster.host.page_cache_budget_gb == 96.0
    big = wake_trace.MODELS["llama-70b"]
    assert big.reload_s(bench_module('wake_roster').PAGE_CACHE_GB_S) == pytest.approx(70 / 6.0) and big.steps()["wake"] == pytest.approx(70 / 50.0)
    spec = next(m for m in roster.models if m.name == "llama-70b")
    sim = dict(zip(spec.args[::2], spec.args[1::2]))
    # the sims' disk model, in wall time: 10x faster at time scale 0.1
    assert (sim["--sim-weights-gb"], sim["--sim-disk-gb-per-s"], sim["--sim-page-cache-gb-per-s"]) == ("70", "20", "60")
    assert "reload_weights" not in " ".join(spec.args), "the reload's time is the disk model's, not a fixed delay"
    engine_env = roster.models[0].env
    assert engine_env["HOTSWAP_SIM_PAGE_CACHE"] == str(tmp_path / "page-cache-hotswap.json")
    assert engine_env["HOTSWAP_SIM_PAGE_CACHE_GB"] == "128"


def test_a_long_wait_is_split_into_the_hold_the_victims_drain_the_wake_and_after_promotion(wake_trace):
    """bench/wake_trace.py's `wait_parts`: a request for a parked model arrives while busy engines hold
    the room; 10 s later its wake begins, whose victims drain for 3 s and whose steps take 5 s; its first
    token comes 0.5 s after promotion. One sent during that drain was held for none of it; one whose
    model no wake ended for waited only after promotion (behind its engine's other requests)."""
    spans = [(0.0, 4.0, {"drain": 0.0}), (110.0, 118.0, {"drain": 3.0, "sleep": 1.0, "reload_weights": 4.0})]
    parts = wake_trace.wait_parts(100.0, 118.5, spans)
    assert parts == pytest.approx({"held": 10.0, "drain": 3.0, "wake": 5.0, "after": 0.5})
    assert sum(parts.values()) == pytest.approx(18.5), "the parts are the whole wait"
    assert wake_trace.wait_parts(111.0, 118.5, spans) == pytest.approx({"held": 0.0, "drain": 2.0, "wake": 5.0, "after": 0.5})
    assert wake_trace.wait_parts(50.0, 60.0, spans) == {"after": 10.0}, "the last wake ended before it was sent"


def test_a_request_arriving_while_other_models_streams_fill_its_gpu_is_counted_blocked_until_they_end(wake_report):
    m = sys.modules["wake_roster"].Model  # the bench's own module, imported with it
    models = {"a": m("a", (0,), 0.6, 1, 10), "b": m("b", (0,), 0.6, 1, 10), "c": m("c", (1,), 0.6, 1, 10),
              "small": m("small", (0,), 0.3, 1, 10)}
    r = sys.modules["wake_roster"].Req
    trace = [r(0, 0.0, "a", "chat", 100),  # a streams until 10 s
             r(1, 5.0, "b", "chat", 10),  # b does not fit beside it: blocked until 10 s
             r(2, 5.0, "c", "chat", 10),  # another GPU
             r(3, 6.0, "a", "chat", 10),  # its own model's stream is no obstacle
             r(4, 7.0, "small", "chat", 10),  # 0.6 + 0.3 fits
             r(5, 20.0, "b", "chat", 10)]  # the stream has ended
    got = wake_report.contention.blocked(trace, models, range(len(trace)))
    assert [(b.request, round(b.clear_s, 6)) for b in got] == [(1, 5.0)]


def test_rounds_are_pooled_per_arm_over_the_requests_each_round_answered_in_every_arm(wake_report):
    result = wake_report.Result
    first = {"hotswap": result("hotswap", waits={0: 1.0, 1: 3.0}), "lru": result("lru", waits={0: 2.0, 1: 4.0})}
    second = {"hotswap": result("hotswap", waits={0: 5.0, 1: 7.0}), "lru": result("lru", waits={0: 6.0})}  # lru lost 1
    got = wake_report.pooled([first, second], {0, 1})
    assert (got["hotswap"]["mean"], got["lru"]["mean"]) == (3.0, 4.0), "round 2 counts request 0 only"
    assert got["hotswap"]["within"] == pytest.approx(1 / 3)
    text = wake_report.verdict(got)
    assert "within 2 s: 33%" in text and "never worse than LRU" in text, text


def test_the_batch_arm_sets_the_traces_waits_beside_hotswaps_and_reports_the_floods_own(wake_trace, wake_report):
    args = wake_trace.parse_args(["--arms", "hotswap,batch", "--batch-requests", "2", "--batch-model", "qwen-7b"])
    flood = sys.modules["wake_roster"].batch_flood([sys.modules["wake_roster"].Req(0, 30.0, "llama-8b", "chat", 8)],
                                                   "qwen-7b", 2, 60.0, 16)
    assert [(r.i, r.t, r.model, r.batch) for r in flood] == [(1, 90.0, "qwen-7b", True), (2, 90.0, "qwen-7b", True)]
    result = wake_report.Result
    rounds = [{"hotswap": result("hotswap", waits={0: 1.0}),
               "batch": result("batch", waits={0: 1.05, 1: 40.0}, batch_job_s=55.0)}]
    text = wake_report.batch_verdict(rounds, wake_report.pooled(rounds, {0}), 1, args, {0})
    assert "mean 1.05×" in text and "(within the target of 1.10×)" in text, text
    assert "Batch requests answered: 1 of 2; each one's time to its answer, from when its worker sent it: mean 40.0 s" in text
    assert "sent by 16 workers" in text and "first request to last answer: 55 s" in text, text
    assert "Mean interactive wait with ÷ without, each round: 1.05." in text
    with pytest.raises(SystemExit):
        wake_trace.parse_args(["--arms", "batch"])  # nothing to set it against
    assert wake_report.section(["batch", "hotswap"]) == wake_report.BATCH_SECTION, "issue 33's run has a section of its own"
    assert wake_report.section(["hotswap", "lru", "batch"]) == wake_report.SECTION


def test_a_wake_for_batch_requests_alone_is_the_batchs_and_the_users_of_the_model_it_parked_are_counted(wake_trace):
    """gemma is woken twice: at t=10 for the batch alone (it parks qwen), at t=40 with a user waiting
    too (it parks llama). The qwen user sent at 12 waited for qwen's next wake (20-30): the batch's
    doing. The qwen user at 5 was sent before the park began; the llama user waited for the second."""
    req = sys.modules["wake_roster"].Req
    trace = [req(0, 0, "qwen", "chat", 8), req(1, 0, "qwen", "chat", 8), req(2, 0, "gemma", "chat", 8),
             req(3, 0, "llama", "chat", 8), req(4, 0, "gemma", "chat", 8, batch=True)]
    sent = {0: (5.0, 6.0), 1: (12.0, 30.0), 2: (35.0, 45.0), 3: (41.0, 60.0), 4: (8.0, 50.0)}
    moves = [("gemma", ["qwen"], 10.0, 15.0), ("qwen", ["x"], 20.0, 30.0), ("gemma", ["llama"], 40.0, 45.0),
             ("llama", [], 50.0, 60.0)]
    assert wake_trace.batch_harm(trace, sent, moves, "gemma") == (1, [1])
