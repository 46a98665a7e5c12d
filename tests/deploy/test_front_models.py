"""The front's one /v1/models (deploy/multinode/models.lua) in a real HAProxy, over nodes that are
stubs answering /v1/models as a hotswap node does (try-local checks it over real nodes): the union,
a node that does not answer, a model no node has, a key every node refuses, no node at all, and
each card's `created` (a Unix time) passed on exactly."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

from tests.support import free_port, until

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "multinode"))
import haproxy  # noqa: E402

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
pytestmark = pytest.mark.skipif(not Path(HAPROXY).exists(), reason="needs haproxy (apt-get install haproxy)")
KEY = "fleet-key"
# Each node's start (its cards' `created`): ten significant digits, as a Unix time has; 1764600000 would
# survive a round trip through six (a float printed with %g), these do not.
CREATED = {"node-a": 1796155152, "node-b": 1764612345}


def node_stub(name: str, models: list[tuple[str, str, float]], created: int,
              odd_created: Optional[dict[str, object]] = None,
              aliases: Optional[dict[str, str]] = None) -> http.server.ThreadingHTTPServer:
    """A node's /v1/models: each (id, state, wake_estimate_s) as a card with this node's name and `created`
    (its start, in Unix seconds; `odd_created`: what a broken node says instead, per model); 401 without KEY.
    (/ready answers 200, as a node's does while it can serve.)"""
    cards = [{"id": m, "object": "model", "created": (odd_created or {}).get(m, created), "owned_by": "hotswap",
              "parent": None, "alias_of": (aliases or {}).get(m), "state": state, "wake_estimate_s": wake, "node": {"name": name, "labels": {}}}
             for m, state, wake in models]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            ok = self.headers.get("Authorization") == f"Bearer {KEY}" or self.path == "/ready"  # HAProxy's check
            body = json.dumps({"object": "list", "data": cards} if ok else
                              {"error": {"message": "bad key", "type": "authentication_error", "param": None,
                                         "code": "invalid_api_key"}}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def get(url: str, key: str = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def front(tmp_path):
    """node-a (shared awake, alpha parked) and node-b (shared parked, org/beta, and org/odd, an alias of
    org/beta whose card says `"created": "soon"`) up; node-c never listens."""
    stubs = [node_stub("node-a", [("shared", "awake", 0), ("alpha", "sleeping", 1.5)], created=CREATED["node-a"]),
             node_stub("node-b", [("shared", "sleeping", 2.25), ("org/beta", "awake", 0), ("org/odd", "awake", 0)],
                       created=CREATED["node-b"], odd_created={"org/odd": "soon"}, aliases={"org/odd": "org/beta"})]
    addr = {"node-a": f"127.0.0.1:{stubs[0].server_port}", "node-b": f"127.0.0.1:{stubs[1].server_port}",
            "node-c": f"127.0.0.1:{free_port()}"}
    placement = {"shared": [("node-a", addr["node-a"]), ("node-b", addr["node-b"])], "alpha": [("node-a", addr["node-a"])],
                 "org/beta": [("node-b", addr["node-b"])], "org/odd": [("node-b", addr["node-b"])], "gamma": [("node-c", addr["node-c"])]}
    port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy.render(placement, f"127.0.0.1:{port}", models_lua=str(haproxy.LUA_FILE)))
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=(tmp_path / "haproxy.log").open("wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        # Ready once its first checks have run: node-c DOWN, the other two answering.
        until(lambda: get(url + "/v1/models")[1].get("unanswered_nodes") == [
            {"name": "node-c", "why": "down in the front's health checks"}], 20, "HAProxy's checks of the three nodes")
        yield url, stubs
    finally:
        proc.terminate()
        proc.wait(10)
        for stub in stubs:
            stub.shutdown()


def test_the_front_lists_each_model_once_with_its_state_on_every_node(front):
    url, _ = front
    status, body = get(url + "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["alpha", "org/beta", "org/odd", "shared"]
    shared = next(m for m in body["data"] if m["id"] == "shared")
    assert shared["nodes"] == [{"name": "node-a", "state": "awake", "wake_estimate_s": 0},
                               {"name": "node-b", "state": "sleeping", "wake_estimate_s": 2.25}]
    assert body["unanswered_nodes"] == [{"name": "node-c", "why": "down in the front's health checks"}]


def test_one_model_is_its_card_or_a_404_in_openais_shape(front):
    url, _ = front
    status, card = get(url + "/v1/models/org/beta")
    assert status == 200 and card["id"] == "org/beta" and card["nodes"] == [{"name": "node-b", "state": "awake", "wake_estimate_s": 0}]
    status, body = get(url + "/v1/models/gamma")  # in the placement, but its only node does not answer
    assert status == 404 and body["error"]["code"] == "model_not_found" and "gamma" in body["error"]["message"]


def test_each_models_created_is_the_nodes_integer_exactly(front):
    """`created` comes from the first node (by name) that lists the model: shared and alpha from node-a."""
    url, _ = front
    status, body = get(url + "/v1/models")
    assert status == 200
    assert {m["id"]: m["created"] for m in body["data"]} == {
        "alpha": CREATED["node-a"], "shared": CREATED["node-a"], "org/beta": CREATED["node-b"], "org/odd": 0}
    status, card = get(url + "/v1/models/org/beta")
    assert status == 200 and card["created"] == CREATED["node-b"]


def test_a_card_whose_created_is_no_integer_says_0_and_the_list_is_whole(front):
    """A broken node's `"created": "soon"` costs that card its time, not the fleet its list."""
    url, _ = front
    status, card = get(url + "/v1/models/org/odd")
    assert status == 200 and card["created"] == 0 and card["nodes"] == [{"name": "node-b", "state": "awake", "wake_estimate_s": 0}]


def test_a_key_every_node_refuses_gets_their_401(front):
    url, _ = front
    status, body = get(url + "/v1/models", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_no_node_answering_is_a_503_in_openais_shape(front):
    url, stubs = front
    for stub in stubs:
        stub.shutdown()
        stub.server_close()
    status, body = until(lambda: (answer := get(url + "/v1/models"))[0] == 503 and answer, 20, "a 503 once no node answers")
    assert body["error"]["code"] == "no_node_available" and body["error"]["type"] == "service_unavailable"


def test_an_alias_says_which_model_it_names_through_the_front(front):
    url, _ = front
    status, body = get(url + "/v1/models")
    assert status == 200
    assert {m["id"]: m["alias_of"] for m in body["data"]} == {"alpha": None, "org/beta": None, "org/odd": "org/beta", "shared": None}
