"""`hotswap trial` on real `vllm serve` engines on CPU: the operator's command, end to end, on the tier's tiny model.

On CPU sleep is bookkeeping (nothing is freed, a Level-2 sleep loses no draft), so the drill's wake skips the
draft reload and the gate rightly passes it: the report must say that it ran on CPU and that the drill could not
reproduce vLLM #52479 here. The KV park is left out: CPU vLLM refuses its release ("Selective discard is not
supported on CPU", engines/waking/ladder.py). Everything else is real: the staged endpoints, the canary, acceptance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import BOOT_TIMEOUT_S, REPORT, progress

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "examples" / "vllm-cpu.yaml"
SPEC = "tiny-spec"


def roster() -> dict[str, Any]:
    """config/examples/vllm-cpu.yaml's tiny-spec alone, free to use Level 1 and Level 2, with CPU-sized timeouts."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(min_active_s=0, boot_timeout_s=BOOT_TIMEOUT_S,
                        timeouts={"sleep": 30, "stage": 60, "wake_weights": 30, "reload_draft": 60, "reload_weights": 60,
                                  "wake_kv_cache": 30, "reset_prefix_cache": 30, "gate": 60})
    spec = next(m for m in data["models"] if m["name"] == SPEC)
    return {**data, "models": [{**spec, "sleep_level": "auto"}]}


def test_a_trial_on_real_vllm_runs_every_cpu_rung_and_the_drill_and_says_it_ran_on_cpu(vllm_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(roster()))
    md, js = tmp_path / "trial.md", tmp_path / "trial.json"
    progress(f"hotswap trial on {SPEC}: its own router, boot, one cycle through L1 and L2, the drill (reports in {tmp_path})")
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "trial", "--config", str(path), "--levels", "1,2", "--cycles", "1", "--drill",
         "--tokens", "32", "--report", str(md), "--json", str(js), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=360)
    progress(f"hotswap trial exited {done.returncode}; its table:\n{done.stdout}")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    report = json.loads(js.read_text())
    REPORT["trial"] = {"markdown": str(md), "seconds": report["seconds"]}

    assert report["hardware"] == "cpu" and any("sleep is bookkeeping" in n for n in report["notes"])
    versions = report["versions"]  # the engine's own, through the worker extension: vLLM runs in another venv
    assert versions["vllm"].startswith("0.32") and versions["torch"].startswith("2.13") and versions["vllm_source"] == "the engine's worker"
    (spec,) = report["models"]
    assert spec["boot"]["seconds"] > 0 and spec["boot"]["baseline"]["baseline_mal"] == pytest.approx(3.0, abs=0.05)
    assert [(w["level"], w["outcome"]) for w in spec["wakes"]] == [(1, "ok"), (2, "ok")]
    level2 = spec["wakes"][1]
    assert {"wake_weights", "reload_draft", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate"} <= set(level2["wake_phases"])
    assert all(w["verdicts"][0]["result"] == "passed" for w in spec["wakes"])
    drill = spec["drill"]
    assert drill["outcome"] == "not reproduced" and "on CPU" in drill["explanation"], drill
    assert "reload_draft" not in drill["wake"]["wake_phases"]
    assert "hardware: cpu" in md.read_text() and "sleep is bookkeeping" in md.read_text()
