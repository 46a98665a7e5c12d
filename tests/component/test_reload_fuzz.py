"""Reload fuzzed with random valid and invalid rosters on one live router: the router's loader is
the oracle (a roster it refuses must change nothing and be answered with exactly its errors;
one it accepts must be in force, whole, the moment the reload returns), and the router is never
left half-applied."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from config import RosterError, parse_roster
from tests.support import RouterProcess, roster_dict, sim_model, until

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NAMES = ["m0", "m1", "m2", "m3"]
ALIASES = ["x0", "x1", "m0"]  # "m0" as an alias collides with the model of that name: an invalid roster


def model(name: str, aliases: list[str], rate: str, ratio: float, level) -> dict:
    return sim_model(name, aliases=aliases, sleep_level=level, gate={"min_acceptance_ratio": ratio, "max_tokens": 16},
                     args=("--gpu-memory-utilization", "0.2", "--sim-token-rate", rate))


models = st.builds(model, st.sampled_from(NAMES), st.lists(st.sampled_from(ALIASES), max_size=2, unique=True),
                   st.sampled_from(["5000", "4000"]),  # engine-side: a restart
                   st.sampled_from([0.5, 0.3]),  # router-side: in place
                   st.sampled_from(["auto", 2, 2, 3]))  # 3 is refused
rosters = st.lists(models, min_size=1, max_size=4, unique_by=lambda m: m["name"]).map(lambda ms: roster_dict(*ms))
typo = st.sampled_from([None, "modle", "gruop"])


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    r = RouterProcess(roster_dict(sim_model("m0", args=("--gpu-memory-utilization", "0.2"))), tmp_path_factory.mktemp("reload-fuzz"),
                      env={"HOTSWAP_SIM_GPU_LEDGER": str(tmp_path_factory.mktemp("ledger") / "gpu.json")})
    asyncio.run(r.wait_ready())
    yield r
    assert r.stop() == 0, r.log()


def call(router: RouterProcess, method: str, path: str) -> tuple[int, dict]:
    request = urllib.request.Request(router.url + path, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def served_names(router: RouterProcess) -> set[str]:
    return {card["id"] for card in call(router, "GET", "/v1/models")[1]["data"]}


@SETTINGS
@given(roster=rosters, typo=typo)
def test_every_reload_is_applied_whole_or_not_at_all(router, roster, typo):
    if typo:
        roster["models"][0][typo] = "x"
    text = yaml.safe_dump(roster)
    router.roster_path.write_text(text)
    before = served_names(router)
    try:
        expected = parse_roster(text, str(router.roster_path))
    except RosterError as refused:
        status, body = call(router, "POST", "/admin/reload")
        assert status == 422 and body["errors"] == [str(i) for i in refused.issues], body
        assert served_names(router) == before
        return
    status, body = call(router, "POST", "/admin/reload")
    assert status == 200, body
    assert served_names(router) == {n for m in expected.models for n in m.names}

    def settled() -> bool:
        engines = {e["name"]: e for e in call(router, "GET", "/admin/status")[1]["engines"]}
        return set(engines) == {m.name for m in expected.models} and all(
            e["state"] in ("awake", "sleeping") and not e["roster_change_pending"] and not e["retiring"] for e in engines.values())

    until(settled, timeout=30, what="the reload carried out: added booted, removed stopped, changed restarted")
    engines = {e["name"]: e for e in call(router, "GET", "/admin/status")[1]["engines"]}
    for spec in expected.models:
        assert engines[spec.name]["aliases"] == spec.aliases and engines[spec.name]["sleep_level_policy"] == spec.sleep_level
    assert "Traceback" not in router.log()
