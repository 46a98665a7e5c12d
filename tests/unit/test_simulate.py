"""`serve --simulate` as a transformation of the operator's roster (config/simulate.py)."""

from __future__ import annotations

import os

import yaml

from config import parse_roster
from config.simulate import SIM_LAUNCHER, simulate

ROSTER = {
    "swap": {"min_active_s": 7},
    "gpus": [{"index": 0, "memory_gb": 80}, {"index": 1, "memory_gb": 80}],
    "host": {"ram_budget_gb": 32},
    "models": [
        {"name": "a", "model": "/m/a", "port": 9001, "devices": [0, 1], "group": "g", "sleep_level": 1,
         "args": ["--gpu-memory-utilization", 0.7, "--dtype", "bfloat16"]},
        {"name": "b", "command": ["wrap", "--port", "{port}", "--gpu-memory-utilization", "0.3", "--load-format", "dummy"]},
        {"name": "c", "url": "http://gpu-box:8000", "args": ["--gpu-memory-utilization", 0.2],
         "speculative": {"method": "eagle", "model": "/m/c-eagle", "num_speculative_tokens": 1}},
    ],
}


def test_every_engine_becomes_the_simulator_and_the_rest_of_the_roster_stays_as_written():
    roster = parse_roster(yaml.safe_dump(ROSTER), "r.yaml", os.environ)
    sim, notes = simulate(roster, {"a": (12.0, "weights_gb: 12 in the roster"), "b": (None, "a command"), "c": (None, "url")})
    a, b, c = sim.models
    assert [m.launcher for m in sim.models] == [SIM_LAUNCHER] * 3 and all(m.managed and m.command is None for m in sim.models)
    assert a.model == "/m/a" and a.port is None and a.devices == [0, 1] and a.group == "g" and a.sleep_level == 1
    assert a.args == roster.models[0].args and a.gpu_share == 0.7
    assert b.model == "b" and b.args == ["--gpu-memory-utilization", "0.3", "--load-format", "dummy"] and not b.reloads_weights
    assert c.model == "c" and c.url is None and c.gpu_share == 0.2
    assert c.args[-2:] == ["--sim-acceptance", "1.8"]  # the simulator refuses its default 2.6 past 1 + 1 drafted token
    assert sim.swap == roster.swap and sim.gpus == roster.gpus and sim.host == roster.host and sim.source == roster.source
    assert roster.models[0].port == 9001 and roster.models[1].command is not None  # the loaded roster is left alone
    assert "a: weights 12.00 GB (weights_gb: 12 in the roster)" in notes
    assert any(n.startswith("b: weight size unknown: assumed") for n in notes)
    assert any(n.startswith("c: attached by url (http://gpu-box:8000)") for n in notes)


def test_unset_gpus_and_host_budget_are_said_to_come_from_this_machine():
    roster = parse_roster(yaml.safe_dump({"models": [{"name": "a", "model": "/m/a", "weights_gb": 3}]}), "r.yaml", os.environ)
    _, notes = simulate(roster, {"a": (3.0, "weights_gb: 3 in the roster")})
    assert any(n.startswith("gpus: not in the roster") for n in notes)
    assert any(n.startswith("host.ram_budget_gb: not set: half of this machine's RAM") for n in notes)


def test_a_dry_run_leaves_the_real_activity_file_and_fleet_alone():
    written = {"activity": {"path": "/var/lib/hotswap/activity.db"},
               "node": {"name": "gpu-1", "peers": ["http://gpu-2:8080"], "agent_port": 9100},
               "models": [{"name": "a", "model": "/m/a", "weights_gb": 3}]}
    roster = parse_roster(yaml.safe_dump(written), "r.yaml", os.environ)
    sim, notes = simulate(roster, {"a": (3.0, "weights_gb: 3 in the roster")})
    assert sim.activity.path is None and sim.activity.ring == roster.activity.ring
    assert sim.node.peers == [] and sim.node.agent_port is None and sim.node.name == "gpu-1"
    assert any(n.startswith("activity.path (/var/lib/hotswap/activity.db): not written") for n in notes)
    assert any(n.startswith("node.peers and node.agent_port: off") for n in notes)
