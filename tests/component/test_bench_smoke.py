"""Every bench/ script, run as `--smoke` (bench/harness.py `parse`): its own code path end to end on simulated
engines at a size that takes seconds, its report written into a copy of the docs it owns. A script that no
longer runs, or whose report lost its shape or its heading, fails here rather than on the day someone
needs its numbers (issue 56 item 7: none rots)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def peers(section: str) -> None:
    for target in ("direct", "bare", "hotswap"):
        for mode in ("non-stream", "stream"):
            assert re.search(rf"^\| {target} \| {mode} \| 1 \| \d+ \| 0 \|", section, re.M), f"{target} {mode}: no clean row"
    assert "- non-stream, at most 0.9× the bare proxy:" in section and "requests failed" not in section


def swap_overhead(section: str) -> None:
    assert "2 swaps measured (after 1 warm-up swaps)" in section and "gate verdicts: passed." in section
    assert re.search(r"^\| \*\*router: total − Σ phases\*\* \| \d+\.\d\d \|", section, re.M)
    assert re.search(r"^\| reload_weights \| 150 \| \d+\.\d\d \|", section, re.M), "each wake step has its row"


def placement(section: str) -> None:
    for policy in ("group", "lru", "cost-aware"):
        assert re.search(rf"^\| {policy} \| \d+\.\d\d \| \d+\.\d \| [\d.]+× \| \d+% \|.*\| 0 \|$", section, re.M), policy
    assert "**Cost-aware " in section and "First errors" not in section


def reliability_report(section: str) -> None:
    assert "pytest exit code 0." in section
    assert re.search(r"^\| canary answers malformed JSON \| (\d+) \| \d+ \| \d+ \| 0 \|", section, re.M)


# script -> (the docs it writes, its section's heading, extra flags, the section's shape)
SMOKES = {
    "peers.py": ("benchmarks.md", "## Peer proxies: the last generated run", [], peers),
    "swap_overhead.py": ("benchmarks.md", "## Swap path overhead: the last generated run", [], swap_overhead),
    "placement.py": ("benchmarks.md", "## Placement policies: the last generated run", ["--write-docs"], placement),
    "reliability_report.py": ("reliability.md", "<!-- generated:begin (bench/reliability_report.py) -->", [], reliability_report),
}
# Smoked elsewhere (its smoke takes a minute, and it is a test of issue 55's target as well).
ELSEWHERE = {"wake_trace.py": "tests/component/test_trace_chaos.py"}
# Not scripts of their own: what runs each of them.
MODULES = {"harness.py": "every script", "bare_proxy.py": "peers.py", "replay.py": "placement.py and wake_trace.py",
           "wake_roster.py": "wake_trace.py", "wake_report.py": "wake_trace.py", "contention.py": "wake_trace.py"}


def test_every_bench_script_has_a_smoke_run():
    """A new script joins SMOKES (or says where its smoke runs) before it can rot unnoticed."""
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted({*SMOKES, *ELSEWHERE, *MODULES})
    for script, test in ELSEWHERE.items():
        assert f"bench/{script}" in (REPO / test).read_text() and "--smoke" in (REPO / test).read_text(), test


def generated(text: str, heading: str) -> str:
    """The section under `heading`: to the next `## ` heading (benchmarks.md) or the end marker (reliability.md)."""
    start = text.index(heading)
    end = re.compile(r"^## |^<!-- generated:end", re.M).search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


@pytest.mark.parametrize("script", SMOKES)
def test_the_smoke_run_writes_its_own_section_well_formed(script, tmp_path):
    doc, heading, flags, shape = SMOKES[script]
    docs = tmp_path / doc
    shutil.copy(REPO / "docs" / doc, docs)
    before = docs.read_text()
    assert before.count(heading) == 1, f"docs/{doc} has no section {heading!r} for bench/{script} to replace"
    run = subprocess.run([sys.executable, f"bench/{script}", "--smoke", "--docs", str(docs), *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = docs.read_text()
    assert after.count(heading) == 1 and after.count("\n## ") == before.count("\n## "), "its section replaced, not appended"
    section = generated(after, heading)
    assert section != generated(before, heading) and "--smoke" in section, "the section is this run's"
    shape(section)
