"""`hotswap trial`'s pure parts: --levels, the ledger's GPU memory, and the report's renderings."""

import json

import pytest

from router.trial import parse_levels
from router.trial.machine import ledger_held_gb
from router.trial.report import FORMAT_VERSION, HEADER, GpuMemory, ModelTrial, Report, Verdict, Wake, markdown, table


def test_levels_are_read_as_the_ladder_names_them():
    assert parse_levels("kv,1,2") == (0, 1, 2) and parse_levels("2, KV") == (0, 2) and parse_levels("1,1") == (1,)
    with pytest.raises(ValueError, match="unknown rung '3'"):
        parse_levels("1,3")
    with pytest.raises(ValueError, match="no rung"):
        parse_levels(",")


def test_the_ledger_counts_an_engines_share_of_each_device_it_holds():
    status = {"placement": {"devices": [{"index": 0, "memory_gb": 80, "engines": {"a": "awake 0.4", "b": "sleeping 0.0125"}},
                                        {"index": 1, "memory_gb": None, "engines": {"a": "awake 0.4"}}]}}
    assert ledger_held_gb(status, "a") == 32.0 and ledger_held_gb(status, "b") == 1.0
    assert ledger_held_gb(status, "c") is None


def report() -> Report:
    refused = Verdict(result="refused", reason="MAL 1.00 | below 1.80", baseline_mal=2.6, observed_mal=1.0,
                      acceptance_vs_baseline=0.0)
    wake = Wake(cycle=1, level=2, outcome="refused", sleep_s=0.5, wake_s=12.0, wake_phases={"reload_weights": 9.5, "gate": 0.4},
                gpu=GpuMemory(source="nvml", awake_gb=70.0, asleep_gb=1.5, woken_gb=70.5), verdicts=[refused],
                gate_story=["refused", "restarted", "passed"])
    model = ModelTrial(name="chat", draft=True, draft_restore="reload", sleep_level_policy="auto", rungs=[2], wakes=[wake])
    return Report(started_at="2026-12-07T00:00:00+00:00", command="hotswap trial", roster="r.yaml",
                  router={"mode": "own", "url": "http://127.0.0.1:1", "isolation": "own"}, hardware="gpu", models=[model],
                  failures=["chat L2 cycle 1: the gate refused the wake"])


def test_the_json_carries_its_format_version_and_the_memory_freed_and_taken_back():
    data = json.loads(report().dump_json())
    assert data["format_version"] == FORMAT_VERSION == 1
    gpu = data["models"][0]["wakes"][0]["gpu"]
    assert gpu["freed_gb"] == 68.5 and gpu["taken_back_gb"] == 69.0
    assert Report.model_validate(data) == report()  # a report reads back as it was written


def test_the_table_and_markdown_show_each_wake_and_why_the_trial_failed():
    text = table(report())
    assert "reload_weights" in text.splitlines()[0] and "refused > restarted > passed" in text and "68.50/69.00 (nvml)" in text
    md = markdown(report())
    assert "**FAIL**" in md and "- chat L2 cycle 1: the gate refused the wake" in md
    row = next(line for line in md.splitlines() if line.startswith("| chat | L2 |"))
    assert row.count("|") == len(HEADER) + 1 and "1.00/2.60" in row  # one cell per column, whatever the cells say
