"""What a front (a load balancer over several hotswap nodes) relies on, with a real router process:
/v1/models lists every model with its state and this node's name and labels; /ready stays 200
while the models sleep; on SIGTERM the node drains while it still listens (docs/multi-node.md)."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import aiohttp
import openai
import pytest

from tests.support import ask, client, eventually, http, roster_dict, sim_model

SLOW = ("--sim-token-rate", "40")  # 60 tokens take 1.5 s: a stream that is surely in flight at SIGTERM


async def test_models_carry_state_and_the_nodes_name_and_labels(start_router):
    roster = roster_dict(sim_model("a", default=True), sim_model("b", aliases=["bee"]),
                         node={"name": "gpu-a", "labels": {"zone": "a", "gpu": "h100"}})
    router = await start_router(roster)
    await ask(client(router), "a")
    cards = {m.id: m for m in (await client(router).models.list()).data}
    assert set(cards) == {"a", "b", "bee"}
    assert cards["a"].state == "awake" and cards["b"].state == "sleeping"
    for card in cards.values():
        assert card.node == {"name": "gpu-a", "labels": {"zone": "a", "gpu": "h100"}}
    one = await client(router).models.retrieve("bee")
    assert one.node["name"] == "gpu-a" and one.alias_of == "b"
    assert one.parent is None, "parent is a LoRA adapter's engine (README), not an alias's"
    assert cards["b"].alias_of is None and cards["b"].parent is None


async def test_an_unnamed_node_is_named_after_its_host(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True)))
    _, _, body = await http(router, "GET", "/v1/models")
    assert body["data"][0]["node"] == {"name": socket.gethostname(), "labels": {}}


async def test_ready_stays_200_while_every_model_sleeps(start_router):
    # A front must keep such a node in rotation: the next request wakes a model.
    router = await start_router(roster_dict(sim_model("a", default=True), sim_model("b"), swap={"idle_sleep_s": 0.3}))

    async def all_asleep() -> bool:
        return all(e["state"] == "sleeping" for e in (await router.status())["engines"])

    await eventually(all_asleep, timeout=15, what="every engine parked")
    status, _, body = await http(router, "GET", "/ready")
    assert status == 200 and body["ready"] is True and body["draining"] is False and body["promoted"] == []
    assert sorted(body["serviceable"]) == ["a", "b"]
    assert await ask(client(router), "b")


async def _refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def test_sigterm_drains_while_listening_then_closes_the_port(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True, args=SLOW)))
    stream = await client(router).completions.create(model="a", prompt="x", max_tokens=60, stream=True)
    await stream.__anext__()
    router.proc.send_signal(signal.SIGTERM)

    # While the stream is in flight the node still listens and says it is draining.
    status, headers, body = await eventually(lambda: _ready_draining(router), timeout=5, what="/ready says draining")
    assert body["ready"] is False and body["draining"] is True and int(headers["Retry-After"]) >= 1
    with pytest.raises(openai.APIStatusError) as refused:
        await client(router).completions.create(model="a", prompt="new work", max_tokens=4)
    assert refused.value.status_code == 503 and int(refused.value.response.headers["Retry-After"]) >= 1
    error = refused.value.response.json()["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable" and "retry" in error["message"]
    health, _, _ = await http(router, "GET", "/health")
    assert health == 200  # liveness holds: a drain must not look like a hung process

    rest = [chunk async for chunk in stream]
    assert len(rest) >= 59, "the in-flight stream was cut by the drain"
    await eventually(lambda: _refused(router.port), timeout=10, what="the listener closed after the drain")
    assert await asyncio.to_thread(router.proc.wait, 20) == 0
    assert "drained; closing the listener" in router.log()


async def test_drain_notice_keeps_the_port_open_that_long_with_nothing_in_flight(start_router):
    notice = 1.5
    router = await start_router(roster_dict(sim_model("a", default=True), listen={"drain_notice_s": notice}))
    signalled = time.monotonic()
    router.proc.send_signal(signal.SIGTERM)
    await eventually(lambda: _ready_draining(router), timeout=5, what="/ready says draining")
    await eventually(lambda: _refused(router.port), timeout=10, what="the listener closed")
    assert time.monotonic() - signalled >= notice
    assert await asyncio.to_thread(router.proc.wait, 20) == 0


async def _ready_draining(router):
    try:
        status, headers, body = await http(router, "GET", "/ready")
    except aiohttp.ClientError:
        return None
    return (status, headers, body) if status == 503 and body.get("draining") else None


async def test_a_caller_without_a_key_is_not_told_the_nodes_name(start_router):
    roster = roster_dict(sim_model("a", default=True), auth={"api_keys": ["${T_CLIENT}"], "admin_key": "${T_ADMIN}"},
                         node={"name": "gpu-secret-node"})
    router = await start_router(roster, env={"T_CLIENT": "client-key", "T_ADMIN": "admin-key"}, admin_key="admin-key")
    header = "X-Hotswap-Node"
    for method, path, headers, expected in [
            ("GET", "/v1/models", {}, 401), ("GET", "/v1/models", {"Authorization": "Bearer wrong"}, 401),
            ("POST", "/v1/completions", {}, 401), ("GET", "/admin/status", {}, 401), ("GET", "/metrics", {}, 401),
            ("GET", "/health", {}, 200), ("GET", "/ready", {}, 200)]:
        status, got, _ = await http(router, method, path, headers=headers)
        assert status == expected and header not in got, (method, path, status, got)
    for path, key in [("/v1/models", "client-key"), ("/ready", "client-key"), ("/admin/status", "admin-key")]:
        status, got, _ = await http(router, "GET", path, headers={"Authorization": f"Bearer {key}"})
        assert status == 200 and got[header] == "gpu-secret-node", (path, got)
