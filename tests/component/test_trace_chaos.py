"""The trace bench's chaos arm (bench/wake_trace.py --smoke: the chaos arm), briefly: the first two minutes of
the trace with its batch client, engines SIGKILLed while they serve, and the report's counts. Issue 55's
target holds: no stream cut, every request answered. It is also wake_trace.py's smoke run (and so
wake_roster's, wake_report's, contention's and replay's): tests/component/test_bench_smoke.py counts it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_chaos_arm_kills_serving_engines_and_cuts_no_stream():
    argv = [sys.executable, "bench/wake_trace.py", "--smoke", "--chaos-seed", "1", "--batch-requests", "24"]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "--chaos-seed 1" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("chaos:") and " kills (" in x)
    kills = int(line.split("chaos:")[1].split()[0])
    assert kills >= 2, line
    resumed = re.search(r"answers resumed: [^;]*engine_failed (\d+)", line)
    assert resumed and int(resumed.group(1)) >= 1, line
    assert "pauses p50" in line and "batch requests answered 24 of 24" in line, line
    assert "the client saw 0 streams cut" in line and "0 requests answered other than 200" in line, line
    assert "cut for good by the router: none (0)" in line, line
    assert "**no stream cut, every request answered**" in out, out[-3000:]
