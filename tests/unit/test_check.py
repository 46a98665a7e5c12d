"""`hotswap check` tells what `serve` will do with a roster: the placement per GPU, the level each model sleeps at
under the host budget, and serve's own warnings, where the roster is to be changed."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from config import load_roster
from router.scheduling import level1_weights

REPO = Path(__file__).resolve().parents[2]

ROSTER = """\
gpus: [{index: 0, memory_gb: 80}, {index: 1, memory_gb: 80}]
host: {ram_budget_gb: 30}
defaults: {launcher: [python, -m, engines.sim, serve]}
models:
  - name: chat
    model: /m/chat
    weights_gb: 16                           # 21.6 GB at level 1: fits the budget alone, not beside code
    args: [--gpu-memory-utilization, 0.5]
  - name: code
    model: /m/code
    weights_gb: 14
    args: [--gpu-memory-utilization, 0.5]
  - name: embed
    model: /m/embed                          # size unknown, but pinned: never parked, so nothing to warn of
    pin: true
    args: [--gpu-memory-utilization, 0.1]
  - name: big
    model: /m/big
    devices: [1]
    weights_gb: 40                           # 54 GB at level 1: over the budget
  - name: notes
    model: /m/notes                          # line 21: size unknown
    devices: [1]
    args: [--gpu-memory-utilization, 0.05]
"""


def check(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    path = tmp_path / "roster.yaml"
    path.write_text(ROSTER)
    run = subprocess.run([sys.executable, "-m", "router.cli", "check", *flags, "--config", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    return run, path


def summary(run: subprocess.CompletedProcess) -> list[str]:
    """The placement `check` tells, from the YAML comments its resolved roster ends in."""
    return [line[2:] for line in run.stdout.splitlines() if line.startswith("# ")]


def test_check_shows_who_is_awake_together_who_takes_turns_and_the_level_each_sleeps_at(tmp_path):
    run, path = check(tmp_path)
    assert run.returncode == 0, run.stderr
    assert [m["name"] for m in yaml.safe_load(run.stdout)["models"]] == ["chat", "code", "embed", "big", "notes"]
    assert summary(run) == [
        "GPU 0 (80 GB, from gpus:): chat 0.5, code 0.5, embed 0.1 (--gpu-memory-utilization); at most 2 awake at once",
        "  awake together: chat + embed; code + embed",
        "  take turns: chat / code (with the others asleep, the two need 1.10 of it)",
        "GPU 1 (80 GB, from gpus:): big 0.9, notes 0.05 (--gpu-memory-utilization); at most 2 awake at once",
        "  awake together: big + notes",
        "When parked (host RAM for level-1 sleepers: 30.00 GB, host.ram_budget_gb):",
        "  chat   level 1: about 21.60 GB of host RAM (estimated: 16.00 GB checkpoint x 1.35)",
        "         or level 2 when code sleeps at level 1 too: host RAM for level 1: it would hold 21.60 GB (estimated: "
        "16.00 GB checkpoint x 1.35) beside 18.90 GB the others hold for sleep, over host.ram_budget_gb=30; the router "
        "keeps at level 1 those most likely to be asked for again",
        "  code   level 1: about 18.90 GB of host RAM (estimated: 14.00 GB checkpoint x 1.35)",
        "         or level 2 when chat sleeps at level 1 too: host RAM for level 1: it would hold 18.90 GB (estimated: "
        "14.00 GB checkpoint x 1.35) beside 21.60 GB the others hold for sleep, over host.ram_budget_gb=30; the router "
        "keeps at level 1 those most likely to be asked for again",
        "  embed  never parked: pin: true, always awake",
        "  big    level 2: host RAM for level 1: it would hold 54.00 GB (estimated: 40.00 GB checkpoint x 1.35) beside "
        "0.00 GB the others hold for sleep, over host.ram_budget_gb=30",
        "  notes  level 2: its weights' size is unknown (notes: set weights_gb), so level 1 cannot be sized",
    ]
    assert run.stderr.splitlines() == [
        f"{path}:21:5: models[4].weights_gb: weight size unknown, so it sleeps at level 2: model '/m/notes' is not a "
        "local directory (nor a Hugging Face id); set weights_gb",
        f"{path}: 1 warning; the roster is valid",
    ]


def test_the_size_warning_is_the_one_serve_logs_at_start(tmp_path, caplog):
    run, path = check(tmp_path)
    printed = run.stderr.splitlines()[0].split("models[4].weights_gb: ", 1)[1]
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        level1_weights(load_roster(path).models)  # as `serve` sizes the roster at start
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [f"notes: {printed}"]


def test_check_prints_the_resolved_roster_on_stdout_for_scripts(tmp_path):
    run, _ = check(tmp_path)
    assert run.returncode == 0
    resolved = yaml.safe_load(run.stdout)
    assert [m["name"] for m in resolved["models"]] == ["chat", "code", "embed", "big", "notes"]
    assert resolved["models"][1]["launcher"] == ["python", "-m", "engines.sim", "serve"], "defaults applied"
    assert "1 warning; the roster is valid" in run.stderr


def test_without_gpu_sizes_the_summary_says_residuals_are_not_counted(tmp_path):
    path = tmp_path / "roster.yaml"
    path.write_text(textwrap.dedent("""\
        defaults: {launcher: [python, -m, engines.sim, serve], weights_gb: 1, sleep_level: 2}
        models:
          - {name: a, model: /m/a, group: one}
          - {name: b, model: /m/b, group: one, args: [--gpu-memory-utilization, 0.3]}
        """))
    run = subprocess.run([sys.executable, "-m", "router.cli", "check", "--config", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = summary(run)
    if "NVML" in lines[0]:
        pytest.skip("this machine has a GPU, whose size NVML tells")
    assert lines[:3] == [
        "GPU 0 (size unknown, so a sleeper's residual is not counted: set gpus:): a 0.9, b 0.3 (--gpu-memory-utilization); "
        "at most 1 awake at once",
        "  awake together: none, one at a time",
        "  take turns: a / b (group 'one')",
    ]
