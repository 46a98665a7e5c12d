"""HAProxy's agent-check against a real router (node.agent_port): the front connects, sends a model's
name, reads one line. Its answer follows the model as it sleeps and wakes (router.fleet.agent)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import pytest
import yaml

from tests.support import ask, client, eventually, free_port, http, roster_dict, sim_model


async def agent(port: int, line: str) -> str:
    """What HAProxy's agent-check does: connect, send the agent-send line, read the reply, close."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(line.encode())
        return (await asyncio.wait_for(reader.readline(), 5)).decode()
    finally:
        writer.close()


def words(reply: str) -> list[str]:
    return reply.partition("#")[0].split()


async def test_the_agent_answers_ready_where_the_model_is_awake_and_drain_once_it_is_parked(start_router):
    port = free_port()
    router = await start_router(roster_dict(sim_model("a", default=True), sim_model("b"), node={"agent_port": port}))
    await ask(client(router), "a")
    assert words(await agent(port, "a\n")) == ["up", "ready", "100%"]
    assert words(await agent(port, "b\n")) == ["up", "drain"], "b sleeps: its primary line takes no traffic"
    backup = words(await agent(port, "b backup\n"))
    assert backup[:2] == ["up", "ready"] and 1 <= int(backup[2].rstrip("%")) <= 100

    status, _, _ = await http(router, "POST", "/admin/sleep?model=a")
    assert status == 200
    await eventually(lambda: _is(router, "a", "sleeping"), 15, what="a parked")
    assert words(await agent(port, "a\n")) == ["up", "drain"]

    await ask(client(router), "b")  # b wakes (and a stays parked)
    assert words(await agent(port, "b\n")) == ["up", "ready", "100%"]
    assert words(await agent(port, "nobody\n"))[0] == "down"


async def test_a_line_that_is_not_haproxys_gets_down_and_a_silent_client_is_let_go(start_router):
    port = free_port()
    router = await start_router(roster_dict(sim_model("a", default=True), node={"agent_port": port}))
    assert words(await agent(port, "x" * 5000 + "\n"))[0] == "down"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing: closed after the read timeout
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert words(await agent(port, "a\n")) == ["up", "ready", "100%"], "the agent still answers"
    assert "Traceback" not in router.log()


async def test_a_node_draining_for_shutdown_answers_drain_and_its_agent_goes_with_it(start_router):
    port = free_port()
    router = await start_router(roster_dict(sim_model("a", default=True), node={"agent_port": port},
                                            listen={"drain_notice_s": 2}))
    assert words(await agent(port, "a\n")) == ["up", "ready", "100%"]
    router.proc.send_signal(signal.SIGTERM)
    await eventually(lambda: _answers(port, "a backup\n", ["drain"]), 5, what="the agent says drain while draining")
    assert words(await agent(port, "a\n")) == ["drain"]
    assert await asyncio.to_thread(router.proc.wait, 20) == 0
    with pytest.raises(ConnectionRefusedError):  # the agent stopped with the router
        await agent(port, "a\n")


async def _answers(port: int, line: str, expected: list[str]) -> bool:
    return words(await agent(port, line)) == expected


async def _is(router, name: str, state: str) -> bool:
    return (await router.engine(name))["state"] == state


def test_an_agent_port_in_use_is_a_clear_startup_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "roster.yaml"
        path.write_text(yaml.safe_dump(roster_dict(sim_model("a"), node={"agent_port": port})))
        run = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", str(free_port()),
                              "--log-dir", str(tmp_path / "engines")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert f"cannot listen for HAProxy's agent-check on 127.0.0.1:{port} (node.agent_port)" in run.stderr


async def test_with_an_agent_key_the_agent_answers_only_the_front_that_sends_it(start_router):
    port = free_port()
    router = await start_router(roster_dict(sim_model("a", default=True), sim_model("b"),
                                            node={"agent_port": port, "agent_key": "${T_AGENT_KEY}"}),
                                env={"T_AGENT_KEY": "fleet-agent-key"})
    await ask(client(router), "a")
    assert words(await agent(port, "fleet-agent-key a\n")) == ["up", "ready", "100%"]
    assert words(await agent(port, "fleet-agent-key b backup\n"))[:2] == ["up", "ready"]
    unknown = await agent(port, "fleet-agent-key nobody\n")
    for line in ("a\n", "a backup\n", "wrong-key a\n", "fleet-agent-keyX a\n", "\n"):
        assert await agent(port, line) == unknown == "down #not served on this node\n", line
    assert "fleet-agent-key" not in router.log()


async def test_a_reload_that_moves_the_agent_port_says_it_needs_a_restart_and_the_agent_stays(start_router):
    port = free_port()
    roster = roster_dict(sim_model("a", default=True), node={"agent_port": port})
    router = await start_router(roster)
    router.roster_path.write_text(yaml.safe_dump({**roster, "node": {"agent_port": free_port()}}))
    status, _, body = await http(router, "POST", "/admin/reload")
    assert status == 200, body
    assert body["summary"] == ["! node.agent_port: NOT applied: the agent's port needs a router restart (still on the old one)"]
    assert words(await agent(port, "a\n")) == ["up", "ready", "100%"], "still on the port it was started with"
