"""Peers that misbehave, and clients that send what cannot be passed on: a node answers every
request as it would without them (a peer's model from a healthy peer, an unknown model's 404
at once), never a 500, and tells only its operator what went wrong where (log, /admin/status).
A real router process; the misbehaving peers are small servers in the test."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import RouterProcess, eventually, free_port, roster_dict, sim_model

KEY = "fleet-key"
ENV = {"FLEET_KEY": KEY}
AUTH = {"Authorization": f"Bearer {KEY}"}


def node(name: str, model: str, peers: list[str], keyed: bool = True) -> dict:
    return roster_dict(sim_model(model), node={"name": name, "peers": peers},
                       **({"auth": {"api_keys": ["${FLEET_KEY}"]}} if keyed else {}))


class FakePeer:
    """A peer whose /v1/models says whatever the test sets, and which answers any completion itself."""

    def __init__(self, listing: Any, drops: bool = False) -> None:
        self.listing = listing
        self.drops = drops  # it closes the connection of a request passed on to it, without a byte of answer
        self.passed_on = 0
        self.url = ""
        self._runner: web.AppRunner

    async def start(self) -> "FakePeer":
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.listing), content_type="application/json")

    async def _complete(self, request: web.Request) -> web.Response:
        self.passed_on += 1
        if self.drops:
            assert request.transport is not None
            request.transport.close()
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": "from the fake peer"}]},
                                 headers={"X-Hotswap-Node": "fake"})

    async def stop(self) -> None:
        await self._runner.cleanup()


class BlackHole:
    """A peer whose host takes connections and never answers a byte: what a hung node or a half-open
    network path looks like from here. It counts the connections it was offered."""

    def __init__(self) -> None:
        self.connections = 0
        self._held: list[asyncio.StreamWriter] = []
        self.url = ""

    async def start(self) -> "BlackHole":
        self._server = await asyncio.start_server(self._hold, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._held.append(writer)

    async def stop(self) -> None:
        self._server.close()
        for writer in self._held:
            writer.close()


@pytest.fixture
async def servers():
    made: list[Any] = []

    async def make(server):
        made.append(await server.start())
        return made[-1]

    yield make
    for server in made:
        await server.stop()


async def post(router: RouterProcess, model: str, headers=AUTH) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.post(router.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4}, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_a_peer_whose_listing_is_garbage_is_skipped_until_it_answers_a_well_formed_one(start_router, servers):
    no_list = await servers(FakePeer({"data": 5}))
    bad_field = await servers(FakePeer({"object": "list", "data": [{"id": "gamma", "wake_estimate_s": "soon"}]}))
    b_port = free_port()
    a = await start_router(node("node-a", "alpha", [no_list.url, bad_field.url, f"http://127.0.0.1:{b_port}"]), env=ENV)
    await start_router(node("node-b", "beta", []), env=ENV, port=b_port)

    for _ in range(3):  # the healthy peer's model is answered there, every time
        status, body = await post(a, "beta")
        assert status == 200 and body["choices"][0]["text"], body
    status, body = await post(a, "gamma")  # only the peer with the garbled card lists it
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    # Logged once each, naming the peer and what was wrong with its listing; a client is told none of it.
    log = a.log()
    assert log.count(f"peer {no_list.url}: its /v1/models is not a model list (data: Input should be a valid array)") == 1, log
    assert log.count(f"peer {bad_field.url}: its /v1/models is not a model list (data.0.wake_estimate_s: Input should be a valid number") == 1, log
    assert "Traceback" not in log and bad_field.url not in json.dumps(body)
    peers = {p["url"]: p for p in (await a.status())["peers"]}
    assert peers[bad_field.url]["state"] == "skipped" and "wake_estimate_s" in peers[bad_field.url]["problem"]

    # It mends its listing: once it is asked again, its model is passed on to it.
    bad_field.listing = {"object": "list", "data": [{"id": "gamma", "state": "awake", "wake_estimate_s": 0}]}
    async def passed_on() -> bool:
        status, body = await post(a, "gamma")
        return status == 200 and body["choices"][0]["text"] == "from the fake peer"

    await eventually(passed_on, timeout=30, interval=0.2, what="gamma passed on to the mended peer")
    assert f"peer {bad_field.url} answers a well-formed /v1/models again" in a.log()


async def test_a_black_holed_peer_costs_one_fetch_and_the_misses_after_it_answer_at_once(start_router, servers):
    hole = await servers(BlackHole())
    b_port = free_port()
    a = await start_router(node("node-a", "alpha", [hole.url, f"http://127.0.0.1:{b_port}"]), env=ENV)
    await start_router(node("node-b", "beta", []), env=ENV, port=b_port)

    # 50 concurrent misses share one fetch: one connection to the dead peer, not 50.
    answers = await asyncio.gather(*(post(a, f"nowhere-{i}") for i in range(50)))
    assert {status for status, _ in answers} == {404}
    assert hole.connections == 1
    # Its failure is known now: the next misses and the healthy peer's model do not ask it at all
    # (it is asked again after a backoff, in the background), so nothing waits on it.
    answers = await asyncio.gather(*(post(a, f"elsewhere-{i}") for i in range(50)), post(a, "beta"))
    assert [status for status, _ in answers] == [404] * 50 + [200]
    assert hole.connections == 1
    assert a.log().count(f"peer {hole.url}: its /v1/models did not answer within 2 s") == 1


async def test_a_peer_that_drops_a_passed_on_request_is_a_502_naming_its_node_not_its_address(start_router, servers):
    listing = {"object": "list", "data": [{"id": "gamma", "state": "awake", "node": {"name": "node-g"}}]}
    dropper = await servers(FakePeer(listing, drops=True))
    a = await start_router(node("node-a", "alpha", [dropper.url]), env=ENV)
    status, body = await post(a, "gamma")
    assert status == 502 and body["error"]["code"] == "peer_unreachable", body
    assert "node-g" in body["error"]["message"] and dropper.url not in body["error"]["message"]
    assert "127.0.0.1" not in body["error"]["message"]
    # The operator's side: the log and /admin/status name the peer, and it is skipped for a while.
    assert a.log().count(f"peer {dropper.url}: a request passed on to it did not answer (ServerDisconnectedError)") == 1
    status, body = await post(a, "gamma")
    assert status == 404 and dropper.passed_on == 1, body
    peer = (await a.status())["peers"][0]
    assert (peer["url"], peer["node"], peer["state"]) == (dropper.url, "node-g", "skipped")


def raw_post(router: RouterProcess, path: str, header: bytes, body: dict) -> tuple[int, dict]:
    """A request whose header carries bytes as given (aiohttp's and the SDKs' clients refuse non-UTF-8 ones)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (path.encode(), header, len(data), data))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


async def test_a_key_that_is_not_utf8_is_refused_on_the_hand_off_not_a_crash(start_router):
    b_port = free_port()
    # A node without client keys passes the client's credential on as it is: its bytes must not crash it.
    a = await start_router(node("node-a", "alpha", [f"http://127.0.0.1:{b_port}"], keyed=False), env=ENV)
    keyed_port = free_port()
    k = await start_router(node("node-k", "alpha", [f"http://127.0.0.1:{b_port}"]), env=ENV, port=keyed_port)
    await start_router(node("node-b", "beta", []), env=ENV, port=b_port)
    completion = {"model": "beta", "prompt": "hi", "max_tokens": 4}
    message = {"model": "beta", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

    for header in (b"Authorization: Bearer \xff\xfe", b"Authorization: Bearer " + KEY.encode() + b"\xe9"):
        status, body = raw_post(a, "/v1/completions", header, completion)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (header, body)
    status, body = raw_post(a, "/v1/messages", b"x-api-key: \xff\xfe", message)
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    # A valid x-api-key opens /v1/messages on a keyed node; the Authorization beside it is passed on too.
    status, body = raw_post(k, "/v1/messages", b"x-api-key: " + KEY.encode() + b"\r\nAuthorization: Bearer \xff", message)
    assert status == 401 and body["error"]["type"] == "authentication_error", body
    assert raw_post(k, "/v1/messages", b"x-api-key: " + KEY.encode(), message)[0] == 200
    for router in (a, k):
        assert "internal error" not in router.log() and "Traceback" not in router.log()


class EndlessPeer(FakePeer):
    """A peer that streams its answer for ever, as fast as it is taken: the client's pace is all that holds it back."""

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.passed_on += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Hotswap-Node": "endless"})
        await response.prepare(request)
        event = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * 8000}]}).encode() + b"\n\n"
        while True:
            await response.write(event)


async def test_a_client_that_stops_reading_a_passed_on_stream_is_cut_and_frees_its_place_with_the_peer(start_router, servers):
    endless = await servers(EndlessPeer({"object": "list", "data": [{"id": "beta", "node": {"name": "endless"}}]}))
    a = await start_router(roster_dict(sim_model("alpha"), node={"name": "node-a", "peers": [endless.url]},
                                       queue={"stall_timeout_s": 1}))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it offers
    s.connect(("127.0.0.1", a.port))
    body = json.dumps({"model": "beta", "prompt": "hi", "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: node-a\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # and never reads a byte of the answer
    try:
        async def cut() -> dict | None:
            async with aiohttp.ClientSession() as c, c.get(a.url + "/admin/activity") as r:
                records = (await r.json())["records"]
            return records[0] if records else None

        record = await eventually(cut, 30, what="the stalled stream cut and recorded")
        assert record["peer"] == "endless" and record["status"] == 499, record
        assert "its client took nothing for queue.stall_timeout_s=1 s" in a.log()
        async with aiohttp.ClientSession() as c, c.get(a.url + "/admin/status") as r:
            [peer] = (await r.json())["peers"]
        assert peer["passed_on"] == 0, peer
    finally:
        s.close()


async def test_a_sigterm_ends_a_stream_passed_on_to_a_peer_within_the_drain(start_router, servers):
    """A hand-off holds no engine's lease, so the drain does not wait for it; the shutdown still ends it, within
    swap.drain_timeout_s, rather than after aiohttp's own 60 s."""
    endless = await servers(EndlessPeer({"object": "list", "data": [{"id": "beta", "node": {"name": "endless"}}]}))
    a = await start_router(roster_dict(sim_model("alpha"), node={"name": "node-a", "peers": [endless.url]},
                                       swap={"drain_timeout_s": 1}))
    async with aiohttp.ClientSession() as c:
        async with c.post(a.url + "/v1/completions", json={"model": "beta", "prompt": "hi", "stream": True}) as r:
            assert r.status == 200 and await r.content.read(1024)  # the peer's stream is flowing
            a.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(a.proc.wait, 20) == 0, a.log()
            with pytest.raises(aiohttp.ClientError):
                while await r.content.read(65536):  # the router is gone: so is the stream
                    pass
