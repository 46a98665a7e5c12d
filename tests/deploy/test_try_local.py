"""deploy/multinode/try-local.sh as CI runs it: three nodes behind HAProxy, one SIGKILLed (or
SIGTERMed: drained) mid-load. The SIGKILL run first parks shared on node-a and checks that the
front sends it only to node-b, where it is awake; both runs check that the front keeps /admin,
/ui and its stats page from outside clients (deploy/multinode/scenario_front.py).

The script itself checks the claims (traffic of the killed node's shared model moves to the
other node, the others keep serving, nothing is lost beyond what was in flight there) and exits
non-zero when one fails; this test runs it and reads its summary. A step that cannot happen says
which step it was and what it saw (deploy/multinode/steps.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "multinode" / "try-local.sh"
HAVE_HAPROXY = bool(shutil.which("haproxy") or Path("/usr/sbin/haproxy").exists())
needs_haproxy = pytest.mark.skipif(
    not HAVE_HAPROXY and os.geteuid() != 0 and os.environ.get("HOTSWAP_REQUIRE_TOOLS") != "1",
    reason="needs haproxy (apt-get install haproxy, or .ci/install-tools.sh), or root to install it")


@needs_haproxy
@pytest.mark.parametrize("sig", ["KILL", "TERM"])
def test_try_local_moves_the_stopped_nodes_traffic_and_loses_nothing_else(tmp_path, sig):
    summary = tmp_path / "summary.json"
    run = subprocess.run(["bash", str(SCRIPT), "--seconds", "6", "--kill-at", "2.5", "--signal", sig, "--summary-json", str(summary)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(summary.read_text())
    assert result["ok"] is True
    lines = result["summary"].splitlines()
    assert lines[0].split()[:5] == ["model", "nodes", "sent", "ok", "failed"]
    claims = [line for line in lines if line.startswith("[")]
    # 8 about the stop, 2 about the admin rule; SIGKILL adds 3 about awake-affinity (scenario_front) and 3 about
    # the fleet's /v1/models and bodies of any size (scenario_peers)
    assert len(claims) == (16 if sig == "KILL" else 10) and all(line.startswith("[PASS]") for line in claims), result["summary"]
    rows = {line.split()[0]: line.split() for line in lines[2:7]}
    assert set(rows) == {"alpha", "beta", "delta", "gamma", "shared"}
    assert rows["shared"][-1] == "node-a:" + rows["shared"][5].split("/")[0]
    if sig == "KILL":  # shared was awake on node-b only: what was in flight there at the kill may be lost
        assert int(rows["shared"][4]) <= result["in_flight_at_kill"].get("shared", 0)
        assert rows["shared"][-2].startswith("node-b:") and "," not in rows["shared"][-2]
        assert any(line.startswith("affinity: shared awake on node-b") for line in lines)
    else:
        assert rows["shared"][4] == "0"
    assert result["requests"] > 100
    assert f"node-b SIG{sig}ed with" in result["summary"] and result["summary"] in run.stdout


@needs_haproxy
def test_a_front_that_dies_at_its_start_fails_the_run_at_once_naming_the_step_and_what_it_saw(tmp_path):
    """`--haproxy /bin/false`: the front exits at once with code 1. The run does not wait out the
    step's deadline (60 s) for servers that will never be UP: it says which step failed and why."""
    run = subprocess.run(["bash", str(SCRIPT), "--haproxy", "/bin/false"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "try-local: HAProxy: every server UP or DRAIN" in run.stderr, run.stderr
    assert "haproxy exited with code 1 (its log is empty)" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "[PASS]" not in run.stdout
