"""Request classes on a real router (issue 33, part 2), as a user sees them: a batch flood for a
parked model never evicts the model interactive users are talking to, and is served once that model
has been idle for swap.interactive_hold_s; X-Hotswap-Class lowers a key's class, never raises it;
and an engine with vLLM's priority scheduling is told each request's class as its `priority`."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import FAST_SIM, SIM_LAUNCHER, RouterProcess, eventually, http, roster_dict, sim_model

SHARE = "--gpu-memory-utilization"
KEYS = {"USERS_KEY": "users-secret-0001", "EVALS_KEY": "evals-secret-0002", "OPS_KEY": "ops-secret-0003"}
AUTH = {"keys": [{"key": "${USERS_KEY}", "name": "users", "models": ["*"]},
                 {"key": "${EVALS_KEY}", "name": "evals", "models": ["*"], "class": "batch"},
                 {"key": "${OPS_KEY}", "name": "ops", "admin": True}]}
HOLD_S = 2.0
FLOOD = 200  # the proof: 200 batch requests for the parked model


def bearer(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}", **headers}


async def chat(session: aiohttp.ClientSession, router: RouterProcess, model: str, key: str,
               **headers: str) -> tuple[int, dict]:
    async with session.post(router.url + "/v1/chat/completions", headers=bearer(key, **headers),
                            json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}) as r:
        return r.status, await r.json()


async def activity(router: RouterProcess, limit: int = 10_000) -> list[dict]:
    status, _, body = await http(router, "GET", f"/admin/activity?limit={limit}", headers=bearer("OPS_KEY"))
    assert status == 200, body
    return body["records"]


async def test_a_batch_flood_never_evicts_the_interactive_model_and_is_served_once_it_is_idle(start_router):
    router = await start_router(roster_dict(
        sim_model("chat", args=(SHARE, "0.6"), default=True), sim_model("nightly", args=(SHARE, "0.6")),
        # Two users back to back are hundreds of requests in seconds: remembered over the default demand_tau_s
        # (300 s), they would keep chat's room for minutes past the hold, as likely back within nightly's wake.
        auth=AUTH, swap={"interactive_hold_s": HOLD_S, "demand_tau_s": HOLD_S},
        queue={"max_waiting": FLOOD, "batch_max_wait_s": 120}), env=KEYS, admin_key=KEYS["OPS_KEY"])
    assert {e["name"]: e["state"] for e in (await router.status())["engines"]} == {"chat": "awake", "nightly": "sleeping"}
    connector = aiohttp.TCPConnector(limit=0)  # the whole flood at once, as a batch client would send it
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=180)) as session:
        stop_users = asyncio.Event()
        user_answers: list[int] = []

        async def user() -> None:
            while not stop_users.is_set():
                status, _ = await chat(session, router, "chat", "USERS_KEY")
                user_answers.append(status)

        users = [asyncio.ensure_future(user()) for _ in range(2)]
        flood: list[asyncio.Future] = []
        try:
            answers, answered_after, metrics = await _flood(session, router, users, user_answers, stop_users, flood)
        finally:  # a failed assertion leaves no client task behind
            for task in [*users, *flood]:
                task.cancel()
            await asyncio.gather(*users, *flood, return_exceptions=True)

    assert [s for s, _ in answers] == [200] * FLOOD, [b for s, b in answers if s != 200][:3]
    assert set(user_answers) == {200}
    assert answered_after >= HOLD_S * 0.9, f"the flood was served {answered_after:.2f} s after the users stopped: " \
        f"before chat's interactive_hold_s of {HOLD_S} s"
    [swap] = (await router.status())["swaps"]
    assert swap["to"] == "nightly" and swap["from"] == ["chat"]

    records = await activity(router)
    interactive = [r for r in records if r["class"] == "interactive"]
    batch = [r for r in records if r["class"] == "batch"]
    assert len(interactive) == len(user_answers) and len(batch) == FLOOD
    assert all(r["found_awake"] and r["swap_id"] is None for r in interactive), \
        "zero interactive requests waited for a swap (the batch's or any other)"
    assert all(r["engine"] == "nightly" and not r["found_awake"] for r in batch)
    assert f'hotswap_queued_requests_by_class{{class="batch",group="",model="nightly"}} {FLOOD}.0' in _gauges(metrics)


async def test_a_batch_request_that_finds_no_room_gets_a_503_naming_the_engine_that_kept_it(start_router):
    router = await start_router(roster_dict(
        sim_model("chat", args=(SHARE, "0.6"), default=True), sim_model("nightly", args=(SHARE, "0.6")),
        auth=AUTH, swap={"interactive_hold_s": 60}, queue={"batch_max_wait_s": 0.5}), env=KEYS, admin_key=KEYS["OPS_KEY"])
    async with aiohttp.ClientSession() as session:
        assert (await chat(session, router, "chat", "USERS_KEY"))[0] == 200
        status, body = await chat(session, router, "nightly", "EVALS_KEY")
    assert status == 503 and body["error"]["code"] == "model_not_ready"
    message = body["error"]["message"]
    assert "queue.batch_max_wait_s=0.5 s" in message and "'chat' served an interactive request" in message \
        and "swap.interactive_hold_s=60" in message, message
    assert (await router.status())["swaps"] == []
    [refused, served] = await activity(router, 2)
    assert (refused["class"], refused["status"], served["class"]) == ("batch", 503, "interactive")
    assert refused["held"] and refused["held"]["interactive"] > 0.4, refused  # its record says what held it, too
    nightly = await router.engine("nightly")
    assert nightly["queued"] == 0 and nightly["batch_held_by"] is None, "no batch request waits now: nothing is held"


async def test_a_batch_flood_that_fills_the_queue_leaves_room_in_it_for_an_interactive_request(start_router):
    router = await start_router(roster_dict(
        sim_model("chat", args=(SHARE, "0.6"), default=True), sim_model("nightly", args=(SHARE, "0.6")),
        auth=AUTH, swap={"interactive_hold_s": 60}, queue={"max_waiting": 3, "batch_max_wait_s": 120}),
        env=KEYS, admin_key=KEYS["OPS_KEY"])
    async with aiohttp.ClientSession() as session:
        assert (await chat(session, router, "chat", "USERS_KEY"))[0] == 200  # chat's hold keeps the batch waiting
        flood = [asyncio.ensure_future(chat(session, router, "nightly", "EVALS_KEY")) for _ in range(3)]
        try:
            async def full() -> bool:
                return (await router.engine("nightly"))["queued_by_class"] == {"interactive": 0, "batch": 3}
            await eventually(full, timeout=20, what="three batch requests queued for nightly")
            status, body = await chat(session, router, "nightly", "EVALS_KEY")
            assert status == 429 and "has 3 batch requests waiting (queue.max_waiting, per class)" in \
                body["error"]["message"], body
            status, body = await chat(session, router, "nightly", "USERS_KEY")
            assert status == 200, body
            assert [(await answer)[0] for answer in flood] == [200] * 3, "the user's wake served the flood too"
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)


async def _flood(session, router, users, user_answers, stop_users, flood) -> tuple[list, float, str]:
    """The flood beside the users' traffic: it waits while they talk, and is served once chat is idle.
    Returns its answers, how long after the users stopped they were all in, and /metrics while it waited."""
    await eventually(lambda: len(user_answers) >= 5, timeout=20, what="interactive traffic on chat")
    flood += [asyncio.ensure_future(chat(session, router, "nightly", "EVALS_KEY")) for _ in range(FLOOD)]

    async def all_queued() -> bool:
        return (await router.engine("nightly"))["queued_by_class"] == {"interactive": 0, "batch": FLOOD}
    await eventually(all_queued, timeout=60, what=f"all {FLOOD} batch requests queued for nightly")
    assert "interactive request" in (await router.engine("chat"))["interactive_demand"]
    await _operator_sees_why_the_batch_waits(session, router)
    # While users keep talking to chat, the flood waits: many more interactive answers, and no swap at all.
    seen = len(user_answers)
    await eventually(lambda: len(user_answers) >= seen + 40, timeout=60, what="interactive traffic beside the flood")
    status = await router.status()
    assert status["swaps"] == [], "the batch flood made no swap while chat had interactive demand"
    assert {e["name"]: e["state"] for e in status["engines"]} == {"chat": "awake", "nightly": "sleeping"}
    assert not any(f.done() for f in flood), "no batch request was answered (nor refused) meanwhile"
    async with session.get(router.url + "/metrics", headers=bearer("OPS_KEY")) as r:
        metrics = await r.text()
    stop_users.set()
    await asyncio.gather(*users)
    idle_from = time.monotonic()

    answers = await asyncio.wait_for(asyncio.gather(*flood), timeout=120)
    answered_after = time.monotonic() - idle_from
    return answers, answered_after, metrics


async def _operator_sees_why_the_batch_waits(session: aiohttp.ClientSession, router: RouterProcess) -> None:
    """`/admin/status`, `hotswap status` and /ui each say how much of the queue is batch and whose demand keeps its room."""
    async def held() -> bool:
        return "interactive demand keeps the room: 'chat'" in ((await router.engine("nightly"))["batch_held_by"] or "")
    await eventually(held, timeout=30, what="nightly's batch_held_by naming chat's interactive demand")
    run = await asyncio.create_subprocess_exec(sys.executable, "-m", "router.cli", "status", "--url", router.url, "--admin-key", KEYS["OPS_KEY"],
                                               stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(run.communicate(), timeout=60)
    page = out.decode()
    assert run.returncode == 0, err.decode()
    [row] = [line for line in page.splitlines() if line.split()[:2] == ["nightly", "sleeping"]]  # its table row
    assert f"{FLOOD} ({FLOOD} batch)" in row, page
    assert f"  nightly: {FLOOD} batch request(s) wait for room: interactive demand keeps the room: 'chat'" in page, page
    async with session.get(router.url + "/ui", headers=bearer("OPS_KEY")) as r:
        ui = await r.text()
    assert r.status == 200 and f"{FLOOD} ({FLOOD} batch)<br><span class='muted'>interactive demand keeps the room" in ui


def _gauges(text: str) -> str:
    """The metrics' samples as `name{labels} value` lines, labels sorted."""
    lines = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            lines.append(f"{s.name}{{{labels}}} {s.value}")
    return "\n".join(lines)


@pytest.fixture
async def prio_router(start_router):
    # `own` is started from its own argv (`command:`): its scheduling policy is the one written there.
    own = {"name": "own", "default": True, "command": [*SIM_LAUNCHER, "sim/own", "--port", "{port}", "--served-model-name",
                                                       "{name}", "--enable-sleep-mode", *FAST_SIM, SHARE, "0.2",
                                                       "--scheduling-policy", "priority"]}
    return await start_router(roster_dict(
        sim_model("prio", args=(SHARE, "0.3", "--scheduling-policy", "priority"), default=True),
        sim_model("fifo", args=(SHARE, "0.3"), default=True), own, auth=AUTH), env=KEYS, admin_key=KEYS["OPS_KEY"])


async def sim_priorities(router: RouterProcess, name: str) -> list:
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/log") as r:
        return [e.get("priority") for e in await r.json() if e["step"] == "generate" and e.get("path") == "/v1/chat/completions"]


async def test_the_class_header_lowers_a_key_class_never_raises_it_and_a_bad_one_is_a_400(prio_router):
    router = prio_router
    async with aiohttp.ClientSession() as session:
        assert (await chat(session, router, "prio", "USERS_KEY"))[0] == 200
        assert (await chat(session, router, "prio", "USERS_KEY", **{"X-Hotswap-Class": "batch"}))[0] == 200
        assert (await chat(session, router, "prio", "EVALS_KEY", **{"X-Hotswap-Class": "interactive"}))[0] == 200
        status, body = await chat(session, router, "prio", "USERS_KEY", **{"X-Hotswap-Class": "urgent"})
        assert status == 400 and body["error"]["code"] == "invalid_header"
        assert "X-Hotswap-Class must be one of interactive, batch" in body["error"]["message"] and "'urgent'" in body["error"]["message"]
        async with session.post(router.url + "/v1/messages", headers=bearer("USERS_KEY", **{"X-Hotswap-Class": "later"}),
                                json={"model": "prio", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}) as r:
            anthropic_body = await r.json()
            assert r.status == 400
        assert anthropic_body["type"] == "error" and anthropic_body["error"]["type"] == "invalid_request_error"
        assert "X-Hotswap-Class" in anthropic_body["error"]["message"]
    records = [r for r in reversed(await activity(router)) if r["endpoint"] == "chat"]
    assert [(r["key_name"], r["status"], r["class"]) for r in records] == [
        ("users", 200, "interactive"), ("users", 200, "batch"), ("evals", 200, "batch"), ("users", 400, None)], \
        "a header lowers a key's class, never raises it"


async def test_an_engine_with_priority_scheduling_gets_the_class_as_priority_unless_the_client_set_one(prio_router):
    router = prio_router
    async with aiohttp.ClientSession() as session:
        for model in ("prio", "fifo", "own"):
            assert (await chat(session, router, model, "USERS_KEY"))[0] == 200
            assert (await chat(session, router, model, "EVALS_KEY"))[0] == 200
        async with session.post(router.url + "/v1/chat/completions", headers=bearer("EVALS_KEY"),
                                json={"model": "prio", "max_tokens": 4, "priority": 7,
                                      "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
    assert await sim_priorities(router, "prio") == [0, 1, 7], "interactive 0, batch 1, the client's own kept"
    assert await sim_priorities(router, "fifo") == [None, None], "an engine without priority scheduling is sent none"
    assert await sim_priorities(router, "own") == [0, 1], "a command engine's --scheduling-policy is read from its command"


async def test_a_client_priority_may_ask_to_be_served_later_never_before_its_class(prio_router):
    router = prio_router

    async def asking(key: str, priority) -> tuple[int, dict]:
        async with session.post(router.url + "/v1/chat/completions", headers=bearer(key),
                                json={"model": "prio", "max_tokens": 4, "priority": priority,
                                      "messages": [{"role": "user", "content": "hi"}]}) as r:
            return r.status, await r.json()

    async with aiohttp.ClientSession() as session:
        assert (await asking("EVALS_KEY", -10))[0] == 200
        assert (await asking("EVALS_KEY", 0))[0] == 200
        assert (await asking("USERS_KEY", -10))[0] == 200
        assert (await asking("USERS_KEY", 5))[0] == 200
        status, body = await asking("EVALS_KEY", "-10")
    assert await sim_priorities(router, "prio") == [1, 1, 0, 5], \
        "a batch key is served no earlier than batch (1), an interactive one no earlier than 0; later is its own choice"
    assert status == 400 and body["error"]["param"] == "priority" and "must be an integer" in body["error"]["message"], body


POOLING_ROUTES = [("/v1/embeddings", {"input": "press"}), ("/v2/embed", {"texts": ["press"], "embedding_types": ["float"]}),
                  ("/pooling", {"input": "press"}), ("/classify", {"input": ["press"]}),
                  ("/v1/score", {"text_1": "press", "text_2": "a printing press"}),
                  ("/v1/rerank", {"query": "press", "documents": ["a printing press"]})]


async def test_every_pooling_route_tells_the_engine_a_batch_requests_class(prio_router):
    # vLLM's pooling requests all take `priority` (PoolingBasicRequestMixin): batch embeddings and reranks
    # are served after interactive ones there too.
    router = prio_router
    async with aiohttp.ClientSession() as session:
        for path, body in POOLING_ROUTES:
            async with session.post(router.url + path, headers=bearer("EVALS_KEY"), json={"model": "prio", **body}) as r:
                assert r.status == 200, (path, await r.text())
        port = (await router.engine("prio"))["port"]
        async with session.get(f"http://127.0.0.1:{port}/sim/log") as r:
            routes = {path for path, _ in POOLING_ROUTES}  # not the gate's canaries
            sent = [(e["path"], e.get("priority")) for e in await r.json() if e["step"] == "generate" and e["path"] in routes]
    assert sent == [(path, 1) for path, _ in POOLING_ROUTES]
