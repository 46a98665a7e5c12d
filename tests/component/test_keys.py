"""Scoped API keys on a real router: each key uses and sees only its models (others are answered
as unknown), admin is its own grant, requests are counted per key name, and no key leaks."""

from __future__ import annotations

import json
import socket

import aiohttp
import anthropic
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ask, client, http, roster_dict, sim_model

SHARE = ("--gpu-memory-utilization", "0.2")
KEYS = {"TEAM_A_KEY": "team-a-secret-0001", "OPS_KEY": "ops-secret-0002", "ALL_KEY": "all-secret-0003",
        "PROM_KEY": "prometheus-secret-0004"}
AUTH = {"api_keys": ["${ALL_KEY}"],
        "keys": [{"key": "${TEAM_A_KEY}", "name": "team-a", "models": ["chat-*", "embed"]},
                 {"key": "${OPS_KEY}", "name": "ops", "admin": True},
                 {"key": "${PROM_KEY}", "name": "prometheus", "metrics": True}]}


def roster(auth=AUTH) -> dict:
    return roster_dict(sim_model("chat-a", aliases=["chat-fast"], args=SHARE), sim_model("chat-b", args=SHARE),
                       sim_model("embed", args=SHARE), sim_model("secret", default=True, args=SHARE), auth=auth)


@pytest.fixture
async def router(start_router):
    return await start_router(roster(), env=KEYS, admin_key=KEYS["OPS_KEY"])


async def ids(router, key: str) -> set[str]:
    return {m.id async for m in client(router, key).models.list()}


async def test_a_team_key_sees_and_uses_only_its_models_and_others_look_unknown(router):
    team = KEYS["TEAM_A_KEY"]
    assert await ids(router, team) == {"chat-a", "chat-fast", "chat-b", "embed"}
    assert await ids(router, KEYS["ALL_KEY"]) == {"chat-a", "chat-fast", "chat-b", "embed", "secret"}
    assert await ask(client(router, team), "chat-fast") and await ask(client(router, team), "embed")

    with pytest.raises(openai.NotFoundError) as forbidden:
        await ask(client(router, team), "secret")
    with pytest.raises(openai.NotFoundError) as unknown:
        await ask(client(router, team), "no-such-model")
    # The same answer as for a model that does not exist: the key learns nothing of the others.
    assert forbidden.value.body == {**unknown.value.body, "message": unknown.value.body["message"].replace("no-such-model", "secret")}
    assert "secret" not in forbidden.value.body["message"].split("Available:")[1]
    with pytest.raises(openai.NotFoundError):
        await client(router, team).models.retrieve("secret")

    async with anthropic.AsyncAnthropic(base_url=router.url, api_key=team, max_retries=0, timeout=30) as a:
        with pytest.raises(anthropic.NotFoundError):
            await a.messages.create(model="secret", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        answer = await a.messages.create(model="chat-b", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert answer.content[0].text

    # The roster's default model is outside the team's scope: a request naming none is told its own names.
    status, _, body = await http(router, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                                 headers={"Authorization": f"Bearer {team}"})
    assert status == 400 and body["error"]["code"] == "missing_model" and "secret" not in body["error"]["message"]
    assert (await http(router, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEYS['ALL_KEY']}"}))[0] == 200


async def test_admin_is_a_grant_of_its_own(router):
    ops, team = KEYS["OPS_KEY"], KEYS["TEAM_A_KEY"]
    for key, expected in ((ops, 200), (team, 401), (KEYS["ALL_KEY"], 401), ("wrong", 401)):
        assert (await http(router, "GET", "/admin/status", headers={"Authorization": f"Bearer {key}"}))[0] == expected, key
    with pytest.raises(openai.AuthenticationError):  # an admin-only key is no client key
        await ids(router, ops)
    with pytest.raises(openai.AuthenticationError):
        await ask(client(router, ops), "chat-a")
    with pytest.raises(openai.AuthenticationError):
        await ask(client(router, "wrong"), "chat-a")


async def test_requests_are_counted_per_key_name_and_no_key_appears_anywhere(router):
    team = KEYS["TEAM_A_KEY"]
    for _ in range(3):
        await ask(client(router, team), "chat-a")
    with pytest.raises(openai.NotFoundError):
        await ask(client(router, team), "secret")
    await ask(client(router, KEYS["ALL_KEY"]), "secret")

    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['PROM_KEY']}"}) as r:
            text = await r.text()
        async with s.get(router.url + "/ui", headers={"Authorization": f"Bearer {KEYS['OPS_KEY']}"}) as r:
            page = await r.text()
    samples = {(s.labels["key_name"], s.labels["model"], s.labels["status"]): s.value
               for f in text_string_to_metric_families(text) if f.name == "hotswap_key_requests" for s in f.samples}
    assert samples == {("team-a", "chat-a", "200"): 3, ("team-a", "_unknown", "404"): 1, ("api_keys[0]", "secret", "200"): 1}

    status = yaml.safe_dump(await router.status())
    for key in KEYS.values():
        assert key not in text and key not in router.log() and key not in status and key not in page


async def test_without_a_key_neither_metrics_nor_ready_names_a_model_or_a_key(router):
    async def metrics(key=None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics", headers=headers) as r:
            return r.status, await r.text()

    await ask(client(router, KEYS["TEAM_A_KEY"]), "chat-a")  # so a key name is among the series
    for key in (None, "wrong", KEYS["TEAM_A_KEY"], KEYS["ALL_KEY"]):  # client keys are no metrics keys
        status, text = await metrics(key)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_metrics_key", (key, text)
        assert "chat-a" not in text and "team-a" not in text
    for key in (KEYS["PROM_KEY"], KEYS["OPS_KEY"]):
        status, text = await metrics(key)
        assert status == 200 and 'model="chat-a"' in text and 'key_name="team-a"' in text
    with pytest.raises(openai.AuthenticationError):  # and a metrics key is no client key
        await ask(client(router, KEYS["PROM_KEY"]), "chat-a")

    # /ready: a probe without a key gets the status alone; a key, the models it may use
    status, _, body = await http(router, "GET", "/ready")
    assert status == 200 and body == {"ready": True, "draining": False}
    _, _, body = await http(router, "GET", "/ready", headers={"Authorization": f"Bearer {KEYS['TEAM_A_KEY']}"})
    assert set(body["serviceable"]) == {"chat-a", "chat-b", "embed"} and set(body["promoted"]) <= set(body["serviceable"])
    for key in (KEYS["ALL_KEY"], KEYS["OPS_KEY"], KEYS["PROM_KEY"]):
        _, _, body = await http(router, "GET", "/ready", headers={"Authorization": f"Bearer {key}"})
        assert set(body["serviceable"]) == {"chat-a", "chat-b", "embed", "secret"}, key


async def test_open_metrics_serves_metrics_without_a_key_while_client_keys_are_on(start_router):
    auth = {"api_keys": ["${ALL_KEY}"], "open_metrics": True}
    router = await start_router(roster_dict(sim_model("a", default=True), auth=auth), env=KEYS)
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        assert r.status == 200 and 'model="a"' in await r.text()
    assert (await http(router, "GET", "/ready"))[2] == {"ready": True, "draining": False}  # /ready does not open with it


async def test_a_reload_changes_what_a_key_may_use_without_a_restart(router):
    team = KEYS["TEAM_A_KEY"]
    narrowed = {**AUTH, "keys": [{"key": "${TEAM_A_KEY}", "name": "team-a", "models": ["secret"]}, AUTH["keys"][1]]}
    router.roster_path.write_text(yaml.safe_dump(roster(narrowed)))
    status, _, body = await http(router, "POST", "/admin/reload", headers=router.admin_headers)
    assert status == 200 and body["changes"]["sections"] == ["auth"]
    assert await ids(router, team) == {"secret"}
    with pytest.raises(openai.NotFoundError):
        await ask(client(router, team), "chat-a")
    assert await ask(client(router, team), "secret")


def raw_get(router, path: str, header: bytes) -> tuple[int, dict]:
    """A request whose header carries bytes as given (aiohttp's and the SDKs' clients refuse non-ASCII ones)."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\nConnection: close\r\n\r\n" % (path.encode(), header))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_a_key_that_is_not_utf8_is_a_wrong_key_not_a_crash(router):
    for header in (b"Authorization: Bearer \xff\xfe", b"Authorization: Basic \xff", b"Authorization: Bearer " + KEYS["ALL_KEY"].encode() + b"\xe9"):
        status, body = raw_get(router, "/v1/models", header)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (header, body)
        status, body = raw_get(router, "/admin/status", header)
        assert status == 401 and body["error"]["code"] == "invalid_admin_key", (header, body)
    status, body = raw_get(router, "/v1/messages/count_tokens", b"x-api-key: \xff\xfe")
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    assert raw_get(router, "/v1/models", b"Authorization: Bearer " + KEYS["ALL_KEY"].encode())[0] == 200
    assert "internal error" not in router.log() and "Traceback" not in router.log()


async def test_without_client_keys_a_non_utf8_header_is_ignored_where_no_key_is_needed(start_router):
    router = await start_router(roster_dict(sim_model("a"), auth={"admin_key": "${OPS_KEY}"}), env=KEYS, admin_key=KEYS["OPS_KEY"])
    status, body = raw_get(router, "/v1/models", b"Authorization: Bearer \xff\xfe")
    assert status == 200 and [m["id"] for m in body["data"]] == ["a"]
    status, body = raw_get(router, "/admin/status", b"Authorization: Bearer \xff\xfe")
    assert status == 401 and body["error"]["code"] == "invalid_admin_key"
    assert "internal error" not in router.log()
