"""Virtual models on a real router: one name for several equivalent models, answered by the member
that answers soonest (`pick: awake`), the operator's first (`first`), or spread over those awake
and one more woken only when their queue would be the longer wait (`balance`)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support import ask, client, eventually, http, roster_dict, sim_model

SHARE = "--gpu-memory-utilization"


def model(name: str, share: float, *args: str, **extra) -> dict:
    return sim_model(name, args=(SHARE, str(share), *args), **extra)


async def states(router) -> dict[str, str]:
    return {e["name"]: e["state"] for e in (await router.status())["engines"]}


async def records(router, model: str, count: int) -> list[dict]:
    async def enough():
        status, _, body = await http(router, "GET", f"/admin/activity?model={model}", headers=router.admin_headers)
        assert status == 200, body
        return body["records"] if len(body["records"]) >= count else None

    return await eventually(enough, timeout=15, what=f"{count} activity records for {model}")


async def card(router, name: str, key: str = "unused") -> dict:
    status, _, body = await http(router, "GET", f"/v1/models/{name}", headers={"Authorization": f"Bearer {key}"})
    assert status == 200, body
    return body


async def test_a_request_for_chat_is_answered_by_the_awake_member_with_no_wake_while_another_is_parked(start_router):
    # chat-b and chat-a cannot be awake together (0.6 + 0.5 of one GPU); chat-a is the default, so chat-b boots and parks.
    router = await start_router(roster_dict(model("chat-b", 0.6), model("chat-a", 0.5, default=True),
                                            virtual_models=[{"name": "chat", "models": ["chat-b", "chat-a"]}]))
    assert await states(router) == {"chat-b": "sleeping", "chat-a": "awake"}
    listed = await card(router, "chat")
    assert listed["members"] == ["chat-b", "chat-a"] and listed["picks"] == "chat-a" and listed["state"] == "awake"

    c = client(router)
    for _ in range(5):
        answer = await c.completions.create(model="chat", prompt="hello", max_tokens=8, temperature=0)
        assert answer.choices[0].text
    assert (await router.status())["swaps"] == [], "an awake member answered: nothing was woken"
    assert await states(router) == {"chat-b": "sleeping", "chat-a": "awake"}
    served = await records(router, "chat", 5)
    assert {(r["model"], r["engine"], r["status"], r["found_awake"]) for r in served} == {("chat", "chat-a", 200, True)}


async def test_first_wakes_its_first_member_and_keeps_using_it(start_router):
    # Only `other` fits beside nothing else; both members are parked at boot.
    router = await start_router(roster_dict(model("chat-a", 0.5), model("chat-b", 0.5), model("other", 0.9, default=True),
                                            virtual_models=[{"name": "chat", "models": ["chat-b", "chat-a"], "pick": "first"}]))
    assert await states(router) == {"chat-a": "sleeping", "chat-b": "sleeping", "other": "awake"}
    c = client(router)
    for _ in range(3):
        assert await ask(c, "chat")
    assert await states(router) == {"chat-a": "sleeping", "chat-b": "awake", "other": "sleeping"}
    assert {r["engine"] for r in await records(router, "chat", 3)} == {"chat-b"}
    [swap] = (await router.status())["swaps"]
    assert swap["to"] == "chat-b"


async def test_balance_spreads_over_the_awake_members_by_requests_in_flight(start_router):
    # 400 tokens at 400 tokens/s: each request holds its engine about a second, long enough to overlap.
    slow = ("--sim-token-rate", "400")
    router = await start_router(roster_dict(model("chat-a", 0.3, *slow), model("chat-b", 0.3, *slow),
                                            virtual_models=[{"name": "chat", "models": ["chat-a", "chat-b"], "pick": "balance"}]))
    c = client(router)
    await asyncio.gather(*(ask(c, "chat", max_tokens=400) for _ in range(8)))
    engines = [r["engine"] for r in await records(router, "chat", 8)]
    assert sorted(engines) == ["chat-a"] * 4 + ["chat-b"] * 4, engines


async def test_balance_wakes_one_more_member_only_when_the_awake_ones_queue_would_wait_longer_than_its_wake(start_router):
    # chat-a decodes one request at a time (--max-num-seqs 1), each about 5 s; chat-b sleeps, after one measured
    # wake (an operator's swap-in) that tells the router its wakes take well under a second. One finished
    # request tells it how long a request holds chat-a.
    router = await start_router(roster_dict(model("chat-a", 0.3, "--max-num-seqs", "1", "--sim-token-rate", "100"),
                                            model("chat-b", 0.3),
                                            virtual_models=[{"name": "chat", "models": ["chat-a", "chat-b"], "pick": "balance"}]))
    for action in ("sleep", "swap", "sleep"):
        assert (await http(router, "POST", f"/admin/{action}?model=chat-b", headers=router.admin_headers))[0] == 200
    c = client(router)
    assert await ask(c, "chat", max_tokens=500)  # chat-a, alone awake and idle
    assert (await states(router))["chat-b"] == "sleeping"
    swaps = len((await router.status())["swaps"])

    first = asyncio.ensure_future(ask(c, "chat", max_tokens=500))  # chat-a again: a free slot waits for nobody

    async def holding() -> bool:
        return (await router.engine("chat-a"))["in_flight"] == 1

    await eventually(holding, timeout=10, what="chat-a holding the first request")
    # A second would queue about 5 s behind it inside chat-a; chat-b's wake is shorter: it is woken and answers.
    assert await ask(c, "chat", max_tokens=8)
    await first
    served = [r["engine"] for r in await records(router, "chat", 3)]
    assert served == ["chat-a", "chat-b", "chat-a"], f"newest first: {served}"
    assert [s["to"] for s in (await router.status())["swaps"][swaps:]] == ["chat-b"], "the one wake the queue asked for"


async def test_with_room_in_its_queue_balance_wakes_nobody_and_the_admin_api_wants_a_member(start_router):
    router = await start_router(roster_dict(model("chat-a", 0.3, "--sim-token-rate", "100"), model("chat-b", 0.3),
                                            virtual_models=[{"name": "chat", "models": ["chat-a", "chat-b"], "pick": "balance"}]))
    status, _, body = await http(router, "POST", "/admin/sleep?model=chat", headers=router.admin_headers)
    assert status == 400 and body["error"]["code"] == "virtual_model" and "(chat-a, chat-b)" in body["error"]["message"]
    assert (await http(router, "POST", "/admin/sleep?model=chat-b", headers=router.admin_headers))[0] == 200
    c = client(router)
    assert await ask(c, "chat", max_tokens=100)
    await asyncio.gather(*(ask(c, "chat", max_tokens=100) for _ in range(4)))  # far below vLLM's 1024 sequences
    assert {r["engine"] for r in await records(router, "chat", 5)} == {"chat-a"}
    assert (await router.status())["swaps"] == []


async def test_a_key_given_the_virtual_name_reaches_its_members_only_through_it(start_router):
    keys = {"APP_KEY": "app-secret-0001"}
    auth = {"keys": [{"key": "${APP_KEY}", "name": "app", "models": ["chat"]}], "admin_key": "${ADMIN_KEY}"}
    env = {**keys, "ADMIN_KEY": "admin-secret-0002"}
    router = await start_router(roster_dict(model("chat-a", 0.3), model("chat-b", 0.3), model("private", 0.3),
                                            virtual_models=[{"name": "chat", "models": ["chat-a", "chat-b"]}], auth=auth),
                                env=env, admin_key=env["ADMIN_KEY"])
    app = client(router, keys["APP_KEY"])
    assert [m.id async for m in app.models.list()] == ["chat"]
    assert await ask(app, "chat")
    for name in ("chat-a", "private"):
        with pytest.raises(openai.NotFoundError) as hidden:
            await ask(app, name)
        assert "Available: chat" in hidden.value.body["message"]


async def test_a_glob_that_matches_a_virtual_name_reaches_only_the_members_it_matches(start_router):
    # 'chat-*' was written for the chat models; chat-any (private first) and chat-hidden only match it by name.
    env = {"APP_KEY": "app-secret-0001", "ADMIN_KEY": "admin-secret-0002"}
    auth = {"keys": [{"key": "${APP_KEY}", "name": "app", "models": ["chat-*"]}], "admin_key": "${ADMIN_KEY}"}
    router = await start_router(roster_dict(
        model("chat-a", 0.3), model("chat-b", 0.3), model("private", 0.3),
        virtual_models=[{"name": "chat-any", "models": ["private", "chat-a"], "pick": "first"},
                        {"name": "chat-hidden", "models": ["private"]}], auth=auth), env=env, admin_key=env["ADMIN_KEY"])
    app = client(router, env["APP_KEY"])
    assert [m.id async for m in app.models.list()] == ["chat-a", "chat-b", "chat-any"]
    assert (await card(router, "chat-any", env["APP_KEY"]))["members"] == ["chat-a"], "no member outside the key is named"
    for _ in range(3):
        answer = await app.completions.create(model="chat-any", prompt="hello", max_tokens=4, temperature=0)
        assert answer.model == "chat-a", "the first member the key may use answers, never private"
    for name in ("chat-hidden", "private"):
        with pytest.raises(openai.NotFoundError) as hidden:
            await ask(app, name)
        assert hidden.value.body["code"] == "model_not_found", hidden.value.body
        assert hidden.value.body["message"].endswith("Available: chat-a, chat-any, chat-b"), hidden.value.body
    served = await records(router, "chat-any", 3)
    assert {r["engine"] for r in served} == {"chat-a"}


async def test_a_responses_follow_up_by_the_virtual_name_stays_on_the_member_that_holds_the_conversation(start_router):
    store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}  # vLLM keeps a response for its follow-ups only with this
    router = await start_router(roster_dict(model("chat-a", 0.3, env=store), model("chat-b", 0.3, env=store),
                                            virtual_models=[{"name": "chat", "models": ["chat-a", "chat-b"], "pick": "balance"}]))
    c = client(router)
    first = await c.responses.create(model="chat", input="hello")
    held_by = (await records(router, "chat", 1))[0]["engine"]
    for _ in range(3):  # balance would send each to the other member by load alone; the conversation decides
        follow = await c.responses.create(model="chat", input="and then?", previous_response_id=first.id)
        assert follow.output_text
    assert {r["engine"] for r in await records(router, "chat", 4)} == {held_by}


async def test_a_virtual_name_that_clashes_is_refused_at_check_with_where(tmp_path):
    import subprocess
    import sys

    import yaml

    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(roster_dict(model("chat-a", 0.3, aliases=["chat"]),
                                               virtual_models=[{"name": "chat", "models": ["chat-a", "nope"]}]),
                                   sort_keys=False))
    done = subprocess.run([sys.executable, "-m", "router.cli", "check", "--config", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert f"{path}:" in out and "virtual_models[0].name: 'chat' is already used by models[0].aliases[0]" in out, out
    assert "virtual_models[0].models[1]: 'nope' is not a model of this roster (models: chat-a)" in out, out


async def test_a_reload_adds_changes_and_removes_a_virtual_model_in_place(start_router):
    import yaml

    before = roster_dict(model("chat-a", 0.3), model("chat-b", 0.3))
    router = await start_router(before)
    pids = {e["name"]: e["pid"] for e in (await router.status())["engines"]}

    async def reload(roster: dict) -> dict:
        router.roster_path.write_text(yaml.safe_dump(roster))
        status, _, body = await http(router, "POST", "/admin/reload", headers=router.admin_headers)
        assert status == 200, body
        return body

    await reload({**before, "virtual_models": [{"name": "chat", "models": ["chat-b", "chat-a"], "pick": "first"}]})
    assert (await card(router, "chat"))["picks"] == "chat-b"
    assert await ask(client(router), "chat")
    await reload({**before, "virtual_models": [{"name": "chat", "models": ["chat-a"], "pick": "first"}]})
    assert (await card(router, "chat"))["members"] == ["chat-a"]
    await reload(before)
    with pytest.raises(openai.NotFoundError):
        await ask(client(router), "chat")
    assert {e["name"]: e["pid"] for e in (await router.status())["engines"]} == pids, "no engine restarted for it"
