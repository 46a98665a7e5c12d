"""The HAProxy front (deploy/multinode/haproxy.py) in front of a real router: it does not hand a node's
loopback trust to outside clients. /admin/* and /ui are refused at the front unless it is rendered
with forward_admin, and then only with the admin key from HAProxy's environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support import eventually, free_port, roster_dict, sim_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "multinode"))
import haproxy  # noqa: E402

HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
pytestmark = pytest.mark.skipif(HAPROXY is None and os.environ.get("HOTSWAP_REQUIRE_TOOLS") != "1",
                                reason="needs haproxy (apt-get install haproxy, or .ci/install-tools.sh)")


@pytest.fixture
def front(tmp_path):
    """start(node_url, forward_admin, env) -> the front's base URL; stopped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(node_port: int, forward_admin: bool = False, env: dict[str, str] | None = None,
              agent_port: int | None = None) -> tuple[str, str]:
        port, stats = free_port(), free_port()
        cfg = tmp_path / f"haproxy{len(procs)}.cfg"
        node = ("node-a", f"127.0.0.1:{node_port}", *([f"127.0.0.1:{agent_port}"] if agent_port else []))
        cfg.write_text(haproxy.render({"a": [node]}, f"127.0.0.1:{port}", stats=f"127.0.0.1:{stats}", forward_admin=forward_admin))
        for value in (env or {}).values():
            assert value not in cfg.read_text(), "a key is read from HAProxy's environment, never written in its config"
        environ = {k: v for k, v in os.environ.items() if k not in ("HOTSWAP_ADMIN_KEY", haproxy.AGENT_KEY_ENV)}
        procs.append(subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], env={**environ, **(env or {})},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


async def get(url: str, method: str = "GET", **kw) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None) if r.content_type == "application/json" else {}


async def up(url: str) -> bool:
    try:
        return (await get(url + "/health"))[0] == 200
    except aiohttp.ClientError:
        return False


async def test_an_outside_client_cannot_reach_a_keyless_nodes_admin_through_the_front(start_router, front):
    router = await start_router(roster_dict(sim_model("a", default=True)))
    url, stats = front(router.port)
    await eventually(lambda: up(url), 15, what="the front forwards")
    for path in ("/admin/status", "/%61dmin/status", "//admin/status", "/ui", "/admin%2fstatus"):
        status, body = await get(url + path)
        assert status == 403 and body["error"]["code"] == "admin_not_forwarded", path
    assert (await get(url + "/admin/sleep?model=a", "POST"))[0] == 403
    assert (await router.engine("a"))["state"] == "awake"
    assert (await get(url + "/haproxy-stats;csv"))[0] == 404, "no stats on the public side"
    async with aiohttp.ClientSession() as s, s.get(stats + "/haproxy-stats;csv") as r:
        assert r.status == 200 and "pxname" in await r.text()
    assert (await get(url + "/v1/models"))[0] == 200, "client routes pass"


async def test_with_forward_admin_the_front_passes_admin_calls_that_carry_the_key(start_router, front):
    roster = roster_dict(sim_model("a", default=True), auth={"admin_key": "${T_ADMIN}"})
    router = await start_router(roster, env={"T_ADMIN": "admin-key"}, admin_key="admin-key")
    url, _ = front(router.port, forward_admin=True, env={"HOTSWAP_ADMIN_KEY": "admin-key"})
    await eventually(lambda: up(url), 15, what="the front forwards")
    assert (await get(url + "/admin/status"))[0] == 403
    assert (await get(url + "/admin/status", headers={"Authorization": "Bearer wrong"}))[0] == 403
    assert (await get(url + "/admin/status", headers={"Authorization": "Bearer admin-key"}))[0] == 200
    assert (await get(url + "/admin/sleep?model=a", "POST", headers={"Authorization": "Bearer admin-key"}))[0] == 200


async def test_with_forward_admin_but_no_key_in_its_environment_the_front_forwards_nothing(start_router, front):
    router = await start_router(roster_dict(sim_model("a", default=True)))
    url, _ = front(router.port, forward_admin=True)
    await eventually(lambda: up(url), 15, what="the front forwards")
    for auth in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer"}):
        assert (await get(url + "/admin/status", headers=auth))[0] == 403, auth


async def test_a_refusal_through_the_front_names_no_node_and_an_answer_to_a_key_does(start_router, front):
    router = await start_router(roster_dict(sim_model("a", default=True), auth={"api_keys": ["${T_CLIENT}"]},
                                            node={"name": "node-a"}), env={"T_CLIENT": "client-key"})
    url, _ = front(router.port)
    await eventually(lambda: up(url), 15, what="the front forwards")
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"model": "a", "prompt": "x"}) as r:
            assert r.status == 401 and "X-Hotswap-Node" not in r.headers, dict(r.headers)
        async with s.get(url + "/v1/models", headers={"Authorization": "Bearer client-key"}) as r:
            assert r.status == 200 and r.headers["X-Hotswap-Node"] == "node-a"
        for probe in ("/health", "/ready"):  # keyless probes: the node names itself to no one there
            async with s.get(url + probe) as r:
                assert r.status == 200 and "X-Hotswap-Node" not in r.headers, (probe, dict(r.headers))


async def _states(stats: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(stats + "/haproxy-stats;csv") as r:
        return {server: state.split()[0] for (backend, server), state in haproxy.server_states(await r.text()).items()
                if backend == "model_a"}


@pytest.mark.parametrize("sent, served", [("agent-key-of-the-fleet", "UP"), ("another-key", "DOWN"), (None, "DOWN")])
async def test_the_fronts_agent_check_carries_the_key_from_its_environment_and_a_wrong_one_learns_nothing(
        start_router, front, sent, served):
    agent = free_port()
    roster = roster_dict(sim_model("a", default=True), node={"agent_port": agent, "agent_key": "${T_AGENT}"})
    router = await start_router(roster, env={"T_AGENT": "agent-key-of-the-fleet"})
    _, stats = front(router.port, env={haproxy.AGENT_KEY_ENV: sent} if sent else {}, agent_port=agent)
    # a is awake: with the key both lines are UP; without it the agent answers as for a name it does not serve.
    await eventually(lambda: _settled(stats, served), 15, what=f"node-a's lines {served}")
    assert ("without the right node.agent_key" in router.log()) == (served == "DOWN")


async def _settled(stats: str, expected: str) -> bool:
    try:
        return await _states(stats) == {"node-a": expected, "node-a:wake": expected}
    except aiohttp.ClientError:
        return False


def test_a_placement_without_agents_renders_no_agent_or_backup_lines_and_one_with_them_renders_both():
    plain = haproxy.render({"m": [("n1", "10.0.0.1:8080"), ("n2", "10.0.0.2:8080")]}, "*:80")
    servers = [line.split() for line in plain.splitlines() if line.strip().startswith("server ")]
    assert all(line[3:] == ["check"] for line in servers) and "allbackups" not in plain
    agents = haproxy.render({"m": [("n1", "10.0.0.1:8080", "10.0.0.1:8081"), ("n2", "10.0.0.2:8080", "10.0.0.9:9")]}, "*:80")
    lines = [line.split() for line in agents.splitlines() if line.strip().startswith("server n")]
    model = [line for line in lines if 'agent-send' in line]
    assert [line[1] for line in model] == ["n1", "n1:wake", "n2", "n2:wake"]
    assert ["backup" in line for line in model] == [False, True, False, True]
    assert "agent-addr" not in model[0] and model[2][model[2].index("agent-addr") + 1] == "10.0.0.9"
    assert "option allbackups" in agents
