"""`hotswap trial` against simulated engines: every rung, the drill, a refused wake, a failing step, --url.

The trial is run as the operator runs it (`python -m router.cli trial ...`, a real process) and starts its own
router, as it does by default; its JSON report is what the assertions read."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.support import ask, client, eventually, http, roster_dict, sim_model

HOST_BYTES = ["--sim-host-bytes-per-gb", "1e6", "--sim-weights-gb", "2"]  # Level 1 really holds host RAM, 2 MB of it
TRIAL_TIMEOUT_S = 60


async def trial(tmp_path: Path, roster: dict[str, Any], *args: str) -> tuple[int, dict[str, Any], str, str]:
    """Run `hotswap trial` on `roster`: (exit code, the JSON report, stdout, stderr)."""
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(roster))
    report = tmp_path / "trial.json"
    env = {**os.environ, "HOTSWAP_SIM_GPU_LEDGER": str(tmp_path / "gpu-ledger.json")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "trial", "--config", str(path), "--json", str(report),
        "--report", str(tmp_path / "trial.md"), "--log-dir", str(tmp_path / "logs"), "--tokens", "32", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TRIAL_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        raise
    assert report.exists(), err.decode()
    return proc.returncode, json.loads(report.read_text()), out.decode(), err.decode()


def wakes(report: dict[str, Any], model: str) -> list[dict[str, Any]]:
    return next(m for m in report["models"] if m["name"] == model)["wakes"]


def model(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in report["models"] if m["name"] == name)


async def test_a_trial_drives_every_rung_then_the_drill_and_passes(tmp_path):
    roster = roster_dict(
        sim_model("chat", weights_gb=2, args=("--gpu-memory-utilization", "0.3", *HOST_BYTES)),
        sim_model("spec", spec=True, weights_gb=2, args=("--gpu-memory-utilization", "0.4", *HOST_BYTES)),
        sim_model("big", weights_gb=500, args=("--gpu-memory-utilization", "0.2")),
        host={"ram_budget_gb": 64})
    code, report, out, err = await trial(tmp_path, roster, "--cycles", "2", "--drill")
    assert code == 0, err
    assert report["format_version"] == 1 and report["hardware"] == "simulator" and report["failures"] == []
    assert report["router"]["mode"] == "own" and "no client traffic" in report["router"]["isolation"]

    spec = model(report, "spec")
    assert spec["rungs"] == [0, 1, 2] and spec["boot"]["baseline"]["baseline_mal"] > 2
    assert [(w["cycle"], w["level"], w["outcome"]) for w in spec["wakes"]] == [
        (c, level, "ok") for c in (1, 2) for level in (0, 1, 2)]
    by_level = {w["level"]: w for w in spec["wakes"]}
    assert set(by_level[0]["wake_phases"]) == {"wake_kv_cache", "reset_prefix_cache", "gate"}
    assert {"wake_weights", "reload_draft", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate"} \
        <= set(by_level[2]["wake_phases"])
    assert by_level[1]["host_ram_held_gb"] > 0  # measured: the simulator's Level-1 copy in host RAM
    for w in spec["wakes"]:
        assert w["verdicts"][0]["result"] == "passed" and w["verdicts"][0]["acceptance_vs_baseline"] > 0.8
        assert w["gpu"]["source"] == "ledger" and w["gpu"]["freed_gb"] > 0 and w["gpu"]["taken_back_gb"] > 0
        assert w["generation"]["tokens"] == 32 and w["generation"]["vs_baseline"] > 0

    drill = spec["drill"]
    assert drill["outcome"] == "caught", drill
    assert "reload_draft" not in drill["wake"]["wake_phases"] and "restart" in drill["wake"]["wake_phases"]
    assert [v["result"] for v in drill["wake"]["verdicts"]] == ["refused", "passed"]
    assert drill["wake"]["verdicts"][0]["observed_mal"] == 1.0 and drill["wake"]["generation"]["tokens"] == 32

    big = model(report, "big")  # 500 GB of weights do not fit host.ram_budget_gb=64: Level 1 is not driven
    assert "L1" in big["skipped"] and "host RAM" in big["skipped"]["L1"], big["skipped"]
    assert {w["level"] for w in big["wakes"] if w["outcome"] == "ok"} == {0, 2}
    assert model(report, "chat")["drill"] is None  # no draft: nothing to drill

    assert "step 1/" in err and "spec: drill caught" in err  # a progress line per step
    assert "L2 drill" in out and "PASS" in out  # the table, then the verdict
    md = (tmp_path / "trial.md").read_text()
    assert "hardware: simulator" in md and "## Drill" in md and "**spec: caught**" in md
    async with aiohttp.ClientSession() as s:  # the trial's router was stopped with the trial
        try:
            async with s.get(report["router"]["url"] + "/health", timeout=aiohttp.ClientTimeout(total=2)):
                raise AssertionError("the trial's router still answers")
        except aiohttp.ClientConnectionError:
            pass


async def test_a_refused_wake_and_a_failing_step_fail_the_trial(tmp_path):
    roster = roster_dict(
        sim_model("lossy", spec=True, draft_restore="none", sleep_level=2, args=("--gpu-memory-utilization", "0.3")),
        sim_model("broken", sleep_level=2, args=("--gpu-memory-utilization", "0.3", "--sim-fault", "reload_weights=http500")),
        sim_model("strict", spec=True, sleep_level=2, gate={"on_fail": "refuse"}, args=("--gpu-memory-utilization", "0.3")))
    code, report, out, err = await trial(tmp_path, roster, "--cycles", "2", "--drill")
    assert code == 1
    lossy = wakes(report, "lossy")
    assert [w["outcome"] for w in lossy] == ["refused", "refused"]  # every Level-2 wake lost the draft
    assert lossy[0]["gate_story"] == ["refused", "restarted", "passed"]
    broken = model(report, "broken")
    assert [w["outcome"] for w in broken["wakes"]] == ["failed"]  # its first wake failed: the rest of it was not run
    assert "reload_weights" in broken["wakes"][0]["error"] and "L2 cycle 1 failed" in broken["error"]
    assert model(report, "lossy")["drill"] is None  # draft_restore: none has no draft reload to skip
    strict = model(report, "strict")  # gate.on_fail: refuse leaves the drilled engine failed: the trial restarts it
    assert [w["outcome"] for w in strict["wakes"]] == ["ok", "ok"] and strict["drill"]["outcome"] == "caught"
    assert strict["drill"]["wake"]["remediation"] == "cold restart by the trial (gate.on_fail: refuse)"
    assert [v["result"] for v in strict["drill"]["wake"]["verdicts"]] == ["refused", "passed"]
    failures = "\n".join(report["failures"])
    assert "lossy L2 cycle 1: the gate refused the wake" in failures and "broken L2 cycle 1" in failures
    assert "strict" not in failures  # the drill's refusal is the drill working, not a failure
    assert "FAIL" in out


async def test_the_drill_switch_is_admin_only_and_applies_to_one_wake(start_router):
    router = await start_router(roster_dict(sim_model("spec", spec=True, sleep_level=2),
                                            auth={"admin_key": "${TRIAL_ADMIN}", "api_keys": ["${TRIAL_CLIENT}"]}),
                                env={"TRIAL_ADMIN": "adm", "TRIAL_CLIENT": "cli"}, admin_key="adm")
    admin = router.admin_headers
    assert (await http(router, "POST", "/admin/drill?model=spec", headers={"Authorization": "Bearer cli"}))[0] == 401
    status, _, body = await http(router, "POST", "/admin/drill?model=spec", headers=admin)
    assert status == 409 and "a drill wakes an engine asleep at level 2" in body["error"]["message"]
    status, _, body = await http(router, "POST", "/admin/sleep?model=spec&level=1", headers=admin)
    assert status == 409 and body["error"]["code"] == "level_unavailable"  # its sleep_level: 2 rules out level 1
    assert (await http(router, "POST", "/admin/sleep?model=spec&level=7", headers=admin))[0] == 400

    assert (await http(router, "POST", "/admin/sleep?model=spec&level=2", headers=admin))[0] == 200
    status, _, body = await http(router, "POST", "/admin/drill?model=spec", headers=admin)
    assert status == 200 and body["engine"]["gate_story"] == ["refused", "restarted", "passed"]
    assert "reload_draft" not in body["engine"]["last_phases"]

    # The next Level-2 wake is an ordinary one again: the draft is reloaded and the gate passes it.
    assert (await http(router, "POST", "/admin/sleep?model=spec&level=2", headers=admin))[0] == 200
    status, _, body = await http(router, "POST", "/admin/swap?model=spec", headers=admin)
    assert status == 200 and body["engine"]["gate_story"] == ["passed"] and "reload_draft" in body["engine"]["last_phases"]


async def test_a_trial_with_url_holds_its_model_off_client_traffic_and_lets_go_at_the_end(start_router, tmp_path):
    roster = roster_dict(sim_model("spec", spec=True, sleep_level=2, args=("--sim-step-delay", "reload_weights=0.3")),
                         sim_model("other", default=True))
    router = await start_router(roster)
    running = asyncio.create_task(trial(tmp_path, roster, "--url", router.url, "--cycles", "2", "--models", "spec"))

    async def held() -> bool:
        return (await router.engine("spec"))["held_for_s"] is not None

    await eventually(held, timeout=20, what="spec held by the trial")
    status, headers, body = await http(router, "POST", "/v1/completions", json={"model": "spec", "prompt": "hi", "max_tokens": 4})
    assert status == 503 and body["error"]["code"] == "model_held" and int(headers["Retry-After"]) > 0
    assert await ask(client(router), "other")  # the models it does not drive serve as usual

    code, report, _, err = await running
    assert code == 0, err
    assert report["router"]["mode"] == "url" and report["router"]["url"] == router.url
    assert "held for its length" in report["router"]["isolation"]
    assert [(w["level"], w["outcome"]) for w in wakes(report, "spec")] == [(2, "ok"), (2, "ok")]
    assert (await router.engine("spec"))["held_for_s"] is None  # released at the end
    assert await ask(client(router), "spec")
