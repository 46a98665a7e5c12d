"""A node that gets a request for a model it does not serve passes it on to a peer that does
(`node.peers`): what a front that could not read a long body's `model` relies on (docs/multi-node.md).
Two real routers with different models, each the other's peer, over loopback."""

from __future__ import annotations

import anthropic
import openai
import pytest

from router.fleet.peers import HOP_HEADER
from tests.support import RouterProcess, free_port, http, roster_dict, sim_model

KEY = "fleet-key"
ENV = {"FLEET_KEY": KEY}  # the fleet shares its client keys: the peer checks the client's own


def node(name: str, model: str, peers: list[str]) -> dict:
    return roster_dict(sim_model(model), node={"name": name, "peers": peers}, auth={"api_keys": ["${FLEET_KEY}"]})


def sdk(router: RouterProcess, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture
async def pair(start_router):
    """node-a serves alpha, node-b serves beta; each lists the other as its peer."""
    a_port, b_port = free_port(), free_port()
    a = await start_router(node("node-a", "alpha", [f"http://127.0.0.1:{b_port}"]), env=ENV, port=a_port)
    b = await start_router(node("node-b", "beta", [f"http://127.0.0.1:{a_port}"]), env=ENV, port=b_port)
    return a, b


async def test_a_request_for_the_peers_model_is_answered_by_the_peer(pair):
    a, b = pair
    async with sdk(a) as c:
        raw = await c.completions.with_raw_response.create(model="beta", prompt="hello", max_tokens=8, temperature=0)
        assert raw.parse().choices[0].text and raw.headers["x-hotswap-node"] == "node-b"
        assert raw.headers["x-hotswap-passed-on-by"] == "node-a"
        raw = await c.completions.with_raw_response.create(model="alpha", prompt="hello", max_tokens=8, temperature=0)
        assert raw.parse().choices[0].text and raw.headers["x-hotswap-node"] == "node-a"
        assert "x-hotswap-passed-on-by" not in raw.headers


async def test_a_stream_for_the_peers_model_arrives_through_the_node(pair):
    a, _ = pair
    async with sdk(a) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="beta", messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True)
        assert raw.headers["x-hotswap-node"] == "node-b" and raw.headers["content-type"].startswith("text/event-stream")
        chunks = [chunk async for chunk in raw.parse()]
    assert len(chunks) > 2 and "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


async def test_an_anthropic_request_with_its_x_api_key_is_answered_by_the_peer(pair):
    # The anthropic SDK sends its key as x-api-key and writes `model` after `messages`.
    a, _ = pair
    async with anthropic.AsyncAnthropic(base_url=a.url, api_key=KEY, max_retries=0, timeout=30) as c:
        raw = await c.messages.with_raw_response.create(model="beta", max_tokens=8,
                                                        messages=[{"role": "user", "content": "hello"}])
        assert (await raw.parse()).content[0].text and raw.headers["x-hotswap-node"] == "node-b"


async def test_the_peer_checks_the_clients_key(pair):
    a, b = pair
    # node-a takes no key that node-b would not: a wrong key is refused at the first node already.
    async with sdk(a, key="wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.completions.create(model="beta", prompt="hello", max_tokens=8)
    assert KEY not in a.log() and KEY not in b.log()


async def test_a_model_no_node_serves_is_a_404_that_names_no_peer(pair):
    # A client learns that no node has the model, not the fleet's internal addresses: those are
    # the operator's, in /admin/status.
    a, b = pair
    async with sdk(a) as c:
        with pytest.raises(openai.NotFoundError) as caught:
            await c.completions.create(model="nowhere", prompt="hello", max_tokens=8)
    assert caught.value.code == "model_not_found"
    assert "No peer of this node serves it either" in caught.value.message
    assert b.url not in caught.value.message and "127.0.0.1" not in caught.value.message
    peers = (await a.status())["peers"]
    assert [(p["url"], p["node"], p["state"], p["problem"]) for p in peers] == [(b.url, "node-b", "asked", None)]


async def test_a_request_already_passed_on_is_never_passed_on_again(pair):
    # Two nodes that each believe the other has a model cannot bounce it: a forwarded request that
    # reaches a node without its model is that node's own 404, even though its peer has the model.
    a, _ = pair
    status, _, body = await http(a, "POST", "/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 4},
                                 headers={"Authorization": f"Bearer {KEY}", HOP_HEADER: "node-b"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "peers" not in body["error"]["message"]


async def test_a_peer_that_is_down_is_skipped_and_named_to_the_operator_only(start_router):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    b_port = free_port()
    a = await start_router(node("node-a", "alpha", [gone, f"http://127.0.0.1:{b_port}"]), env=ENV)
    await start_router(node("node-b", "beta", []), env=ENV, port=b_port)
    async with sdk(a) as c:
        raw = await c.completions.with_raw_response.create(model="beta", prompt="hello", max_tokens=8)
        assert raw.headers["x-hotswap-node"] == "node-b"
        for _ in range(3):
            with pytest.raises(openai.NotFoundError) as caught:
                await c.completions.create(model="nowhere", prompt="hello", max_tokens=8)
            assert gone not in caught.value.message
    # Logged once while it stays down, however often it is asked; /admin/status says what is wrong.
    assert a.log().count(f"peer {gone}: its /v1/models did not answer") == 1
    down = next(p for p in (await a.status())["peers"] if p["url"] == gone)
    assert down["state"] == "skipped" and "did not answer (ClientConnectorError" in down["problem"], down


async def test_a_request_passed_on_keeps_its_class_and_no_hop_raises_it(start_router):
    keys = {**ENV, "BATCH_KEY": "fleet-batch-key"}
    auth = {"keys": [{"key": "${FLEET_KEY}", "name": "users", "models": ["*"]},
                     {"key": "${BATCH_KEY}", "name": "evals", "models": ["*"], "class": "batch"}]}
    a_port, b_port = free_port(), free_port()
    a = await start_router(roster_dict(sim_model("alpha"), node={"name": "node-a", "peers": [f"http://127.0.0.1:{b_port}"]},
                                       auth=auth), env=keys, port=a_port)
    b = await start_router(roster_dict(sim_model("beta"), node={"name": "node-b", "peers": []}, auth=auth), env=keys,
                           port=b_port)
    asked = [(KEY, "batch"), (keys["BATCH_KEY"], "interactive"), (KEY, None)]
    for key, klass in asked:
        headers = {"Authorization": f"Bearer {key}", **({"X-Hotswap-Class": klass} if klass else {})}
        status, answer_headers, body = await http(a, "POST", "/v1/completions", headers=headers,
                                                  json={"model": "beta", "prompt": "hi", "max_tokens": 4})
        assert status == 200 and answer_headers["X-Hotswap-Node"] == "node-b", body

    async def classes(router: RouterProcess) -> list[tuple[str, str]]:
        status, _, body = await http(router, "GET", "/admin/activity?model=beta")  # loopback: no admin key set
        assert status == 200, body
        return [(r["key_name"], r["class"]) for r in reversed(body["records"])]

    expected = [("users", "batch"), ("evals", "batch"), ("users", "interactive")]
    assert await classes(b) == expected, "the peer serves each request in the class it had where it arrived"
    assert await classes(a) == expected, "and the node that passed it on records that class too"
