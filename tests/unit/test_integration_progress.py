"""The real-vLLM tier's progress lines reach the terminal while pytest captures everything else."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_long_integration_step_says_so_on_the_terminal_without_dash_s(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "from tests.integration.harness import progress\n\n"
        "def test_slow():\n"
        "    print('captured: only shown when the test fails')\n"
        "    progress('booting tiny-spec')\n"
    )
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.integration.conftest",
                          str(tmp_path / "test_slow.py")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^\[vllm tier \d+m\d\ds\] booting tiny-spec$", run.stdout, re.MULTILINE), run.stdout
    assert "captured:" not in run.stdout  # capture was on: the line got past it, not around it
