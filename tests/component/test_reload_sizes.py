"""What a router says of a model's size after a roster reload gave it one: the operator who set
`weights_gb` because status said the size was unknown must not be told so again."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.support import ask, client, eventually, http, roster_dict, sim_model

TURNS = ("--gpu-memory-utilization", "0.6")  # two of them never fit together: they take turns on GPU 0


async def test_after_a_reload_sets_weights_gb_and_the_engine_reboots_status_no_longer_says_its_size_is_unknown(start_router):
    # b's checkpoint (sim/b) is nowhere on disk and the roster gives no weights_gb: its size is unknown.
    before = roster_dict(sim_model("a", args=TURNS, default=True), sim_model("b", args=TURNS), host={"ram_budget_gb": 8})
    router = await start_router(before)
    assert await ask(client(router), "b") and await ask(client(router), "a")  # b is parked for a
    b = await router.engine("b")
    assert b["state"] == "sleeping" and b["sleep_level"] == 2
    assert "size is unknown" in b["host_memory"]["not_level1_because"], "the operator is told to set weights_gb"

    # The operator sets weights_gb (and a flag, so b restarts from its new entry), then reloads.
    after = roster_dict(sim_model("a", args=TURNS, default=True),
                        sim_model("b", args=(*TURNS, "--sim-token-rate", "4000"), weights_gb=1), host={"ram_budget_gb": 8})
    router.roster_path.write_text(yaml.safe_dump(after))
    status, _, body = await http(router, "POST", "/admin/reload", headers=router.admin_headers)
    assert status == 200 and body["changes"]["restarting"] == {"b": ["weights_gb", "args"]}, body

    await eventually(lambda: _restarted(router), timeout=15, what="b stopped to restart from its new entry")
    assert await ask(client(router), "b")  # b boots again, from its new entry
    b = await router.engine("b")
    assert b["state"] == "awake" and b["restarts_by_reason"] == {"roster": 1} and b["boot_reason"] == "roster"
    assert b["weights_gb"] == 1 and b["host_memory"]["estimated_gb"] is not None
    assert b["host_memory"]["not_level1_because"] is None, "the reason was about the size it had before the reload"
    shown = subprocess.run([sys.executable, "-m", "router.cli", "status", "--url", router.url], capture_output=True,
                           text=True, timeout=30)
    b_line = next(line for line in shown.stdout.splitlines() if line.strip().startswith("b host RAM:"))
    assert "unknown" not in b_line and "estimated 1.35 GB" in b_line, shown.stdout  # (a's size is still unknown, and said)

    assert await ask(client(router), "b") and await ask(client(router), "a")  # its next park is sized: not level 2
    b = await router.engine("b")
    assert b["sleep_level"] in (0, 1) and b["host_memory"]["not_level1_because"] is None


async def _restarted(router) -> bool:
    b = await router.engine("b")
    return b["restarts_by_reason"].get("roster") == 1 and not b["roster_change_pending"]
