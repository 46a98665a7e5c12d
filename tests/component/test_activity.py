"""The activity log: one record per proxied request, read through GET /admin/activity, `hotswap
activity` and /ui, and kept across a restart in its SQLite file."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import aiohttp
import pytest

from tests.support import RouterProcess, ask, client, eventually, http, roster_dict, sim_model

PROMPT = "the secret prompt words"
# `a` answers at once; `b` has a draft the router does not restore, so its every wake is refused
# by the gate and repaired by a cold restart (tests/component/test_admin.py's TWO).
# b's drafts are accepted less for PROMPT than for the canary (2.6), so a record's MAL is its request's own.
TWO = roster_dict(sim_model("a", default=True),
                  sim_model("b", spec=True, draft_restore="none", args=("--sim-prompt-acceptance", "secret=1.8")))
FIELDS = {"at", "key_name", "model", "engine", "endpoint", "status", "found_awake", "queue_wait_s", "swap_id", "ttfb_s",
          "duration_s", "prompt_tokens", "completion_tokens", "mean_acceptance_length", "peer", "class", "resumed", "paused_s",
          "cut", "swap_s", "held", "held_s"}


async def activity(router, query: str = "") -> list[dict]:
    status, _, body = await http(router, "GET", "/admin/activity" + query, headers=router.admin_headers)
    assert status == 200, body
    return body["records"]


async def newest(router, count: int, query: str = "") -> list[dict]:
    """The newest `count` records once there are that many (a record is made as its request ends)."""
    async def enough() -> list[dict] | None:
        records = await activity(router, query)
        return records[:count] if len(records) >= count else None

    return await eventually(enough, timeout=10, what=f"{count} activity records")


def no_text(record: dict, *texts: str) -> None:
    assert set(record) == FIELDS
    flat = json.dumps(record)
    for text in texts:
        assert text not in flat, f"{text!r} in the activity record {flat}"


async def test_a_request_that_found_its_model_awake_is_recorded_with_its_numbers_and_none_of_its_text(start_router):
    router = await start_router(TWO)
    a = next(e for e in (await router.status())["engines"] if e["name"] == "a")
    assert a["state"] == "awake"
    answer = await client(router).completions.create(model="a", prompt=PROMPT, max_tokens=6, temperature=0)
    [record] = await newest(router, 1)
    assert record["model"] == record["engine"] == "a" and record["endpoint"] == "completions" and record["status"] == 200
    assert record["found_awake"] is True and record["swap_id"] is None and record["queue_wait_s"] >= 0
    assert record["prompt_tokens"] == answer.usage.prompt_tokens and record["completion_tokens"] == 6
    assert record["ttfb_s"] is None and record["duration_s"] > 0 and record["key_name"] is None
    assert record["mean_acceptance_length"] is None  # a has no draft
    assert record["resumed"] is record["paused_s"] is record["cut"] is None  # never paused, never cut
    no_text(record, PROMPT, answer.choices[0].text)


async def test_a_request_that_waited_for_a_swap_carries_the_swap_id_admin_status_shows(start_router):
    """b's wake is refused by the gate (its draft is lost) and repaired by a restart: the request
    waited for that one swap, and its answer's own acceptance is recorded."""
    router = await start_router(TWO)
    answer = await client(router).completions.create(model="b", prompt=PROMPT, max_tokens=16, temperature=0)
    [record] = await newest(router, 1)
    status = await router.status()
    swap = next(s for s in status["swaps"] if s["to"] == "b")
    assert swap["result"] == "ok" and isinstance(swap["id"], int)
    assert (await router.engine("b"))["restarts_by_reason"] == {"gate": 1}, "the gate refused the wake; a restart repaired it"
    assert record["engine"] == "b" and record["status"] == 200
    assert record["found_awake"] is False and record["swap_id"] == swap["id"] and record["queue_wait_s"] > 0
    assert record["completion_tokens"] == 16 and abs(record["mean_acceptance_length"] - 1.8) < 0.15, record
    no_text(record, PROMPT, answer.choices[0].text)

    await ask(client(router), "a")  # a was parked for b: another swap, another id
    record = (await newest(router, 2))[0]
    swap_a = next(s for s in (await router.status())["swaps"] if s["to"] == "a")
    assert record["engine"] == "a" and record["swap_id"] == swap_a["id"] != swap["id"]


async def test_a_stream_with_usage_is_recorded_with_its_tokens_and_first_byte(start_router):
    router = await start_router(roster_dict(sim_model("a")))
    stream = await client(router).chat.completions.create(model="a", messages=[{"role": "user", "content": PROMPT}],
                                                          max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [record] = await newest(router, 1)
    assert record["endpoint"] == "chat" and record["status"] == 200, record
    assert record["completion_tokens"] == 5 and record["prompt_tokens"] == chunks[-1].usage.prompt_tokens
    assert 0 < record["ttfb_s"] <= record["duration_s"]
    no_text(record, PROMPT, text)


async def test_requests_that_failed_are_recorded_with_their_status(start_router):
    router = await start_router(TWO)
    status, _, _ = await http(router, "POST", "/v1/completions", json={"model": "nope", "prompt": PROMPT})
    assert status == 404
    [record] = await newest(router, 1)
    assert record["status"] == 404 and record["model"] == "nope" and record["engine"] is None
    assert record["found_awake"] is None and record["swap_id"] is None
    no_text(record, PROMPT)

    port = (await router.engine("a"))["port"]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/sim/faults", json={"step": "generate", "kind": "http500"}) as r:
            assert r.status == 200
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "a", "prompt": PROMPT})
    assert status == 500, body  # the engine's own error, passed through
    record = (await newest(router, 2))[0]
    assert record["engine"] == "a" and record["status"] == 500 and record["found_awake"] is True
    assert record["prompt_tokens"] is None
    no_text(record, PROMPT)


async def test_the_route_filters_by_model_and_time_and_refuses_bad_parameters(start_router):
    router = await start_router(roster_dict(sim_model("a"), sim_model("c")))
    await ask(client(router), "a")
    await ask(client(router), "c")
    await ask(client(router), "a")
    records = await newest(router, 3)
    assert [r["engine"] for r in records] == ["a", "c", "a"], "newest first"
    assert [r["engine"] for r in await activity(router, "?model=a")] == ["a", "a"]
    assert [r["engine"] for r in await activity(router, "?limit=1")] == ["a"]
    assert [r["engine"] for r in await activity(router, f"?since={records[1]['at']!r}")] == ["a"]
    for query, param in (("?since=yesterday", "since"), ("?limit=0", "limit"), ("?limit=2.5", "limit"), ("?since=-1", "since"),
                         ("?limit=100000", "limit"), ("?colour=red", "colour"), ("?limit=1_0", "limit"),
                         ("?since=1e9", "since")):
        status, _, body = await http(router, "GET", "/admin/activity" + query)
        assert status == 400 and body["error"]["param"] == param and body["error"]["code"] == "invalid_parameter", (query, body)


async def test_the_sqlite_file_brings_the_records_back_after_a_restart(start_router, tmp_path):
    roster = roster_dict(sim_model("a"), activity={"path": str(tmp_path / "activity.db"), "max_rows": 3})
    first = await start_router(roster)
    for _ in range(4):
        await ask(client(first), "a", prompt=PROMPT)
    before = await newest(first, 4)
    assert first.stop() == 0, first.log()  # the writer flushes on stop

    second = await start_router(roster)
    after = await activity(second)
    assert json.dumps(after) == json.dumps(before[:3]), "the file kept its newest max_rows rows, and the ring was refilled from it"
    await ask(client(second), "a")
    assert len(await newest(second, 4)) == 4


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a non-interactive shell starts


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_hotswap_activity_prints_the_table_and_follows_new_requests(start_router, stop):
    router = await start_router(roster_dict(sim_model("a"), sim_model("c")))
    await ask(client(router), "a")
    await ask(client(router), "c")
    c = (await newest(router, 2))[0]
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "activity", "--url", router.url,
                                                   "--model", "c"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    header, *lines = run.stdout.splitlines()
    assert header.split()[:4] == ["TIME", "KEY", "MODEL", "ENGINE"]
    lease = "awake" if c["found_awake"] else f"swap {c['swap_id']}"  # a and c do not fit together: c's wake parked a
    assert len(lines) == 1 and lines[0].split()[2:6] == ["c", "c", "completions", "200"] and f" {lease} " in lines[0], run.stdout

    # Started with SIGINT ignored, as under `nohup bash .ci/run &`: Ctrl-C must still end it.
    follow = subprocess.Popen([sys.executable, "-m", "router.cli", "activity", "--url", router.url, "--follow", "--limit", "1"],
                              stdout=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)

    async def next_line() -> str:
        assert follow.stdout is not None
        return await asyncio.wait_for(asyncio.to_thread(follow.stdout.readline), timeout=15)

    try:
        assert (await next_line()).startswith("TIME")
        assert (await next_line()).split()[2] == "c"  # the newest so far
        await ask(client(router), "a")
        line = await next_line()  # a later poll brings it
        assert line.split()[2:4] == ["a", "a"], line
    finally:
        follow.send_signal(stop)
        assert follow.wait(timeout=10) == 0, f"{signal.Signals(stop).name} ends --follow cleanly"


async def test_the_ui_shows_recent_requests_filtered_by_model(start_router):
    router = await start_router(roster_dict(sim_model("a"), sim_model("c")))
    await ask(client(router), "a", prompt=PROMPT)
    await ask(client(router), "c", prompt=PROMPT)
    await newest(router, 2)

    async def page(query: str = "") -> str:
        async with aiohttp.ClientSession() as s, s.get(router.url + "/ui" + query) as r:
            assert r.status == 200
            return await r.text()

    def rows(html: str) -> list[str]:
        table = html.split("<table class='recent'>", 1)[1].split("</table>", 1)[0]
        return [cells.split("</td><td>")[3] for cells in table.split("<tr class='activity'><td>")[1:]]  # each row's engine

    everything = await page()
    assert "recent requests" in everything and rows(everything) == ["c", "a"]
    assert "href='/ui?model=a'" in everything and "href='/ui?model=c'" in everything
    assert rows(await page("?model=a")) == ["a"]
    assert PROMPT not in everything


async def test_a_record_names_the_clients_key_and_never_holds_the_key(start_router):
    auth = {"admin_key": "${ADMIN_KEY}", "keys": [{"key": "${TEAM_KEY}", "name": "team-a", "models": ["*"]}]}
    router = await start_router(roster_dict(sim_model("a"), auth=auth), admin_key="adm-key-1234",
                                env={"ADMIN_KEY": "adm-key-1234", "TEAM_KEY": "sk-team-secret-5678"})
    await ask(client(router, "sk-team-secret-5678"), "a", prompt=PROMPT)
    [record] = await newest(router, 1)
    assert record["key_name"] == "team-a" and record["status"] == 200
    no_text(record, PROMPT, "sk-team-secret-5678")
    status, _, body = await http(router, "GET", "/admin/activity", headers={"Authorization": "Bearer sk-team-secret-5678"})
    assert status in (401, 403), "a client key does not read the activity log"


async def test_a_request_whose_wake_the_gate_refused_for_good_is_recorded_as_the_503_it_got(start_router):
    refuse = roster_dict(sim_model("a", default=True), sim_model("b", spec=True, draft_restore="none", gate={"on_fail": "refuse"}))
    router = await start_router(refuse)
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "b", "prompt": PROMPT})
    assert status == 503 and body["error"]["code"] == "engine_failed", body
    [record] = await newest(router, 1)
    assert record["engine"] == "b" and record["status"] == 503
    assert record["found_awake"] is False and record["swap_id"] is None, "it waited, for no lease"
    assert record["swap_s"] > 0 and record["queue_wait_s"] >= record["swap_s"], "the wake the gate refused is its wait"
    assert record["duration_s"] > 0 and record["completion_tokens"] is None
    no_text(record, PROMPT)


async def test_swap_ids_go_on_across_a_restart_so_an_old_record_never_names_a_swap_of_this_run(start_router, tmp_path):
    roster = {**TWO, "activity": {"path": str(tmp_path / "activity.db")}}
    first = await start_router(roster)
    assert await ask(client(first), "a") and await ask(client(first), "b")  # a and b never fit together: b's wake is a swap
    old = [r["swap_id"] for r in await newest(first, 2) if r["swap_id"] is not None]
    assert old, "a request waited for a swap"
    assert first.stop() == 0, first.log()

    second = await start_router(roster)
    assert await ask(client(second), "a") and await ask(client(second), "b")
    swaps = [s["id"] for s in (await second.status())["swaps"]]
    assert swaps and min(swaps) > max(old), (old, swaps)
    records = await newest(second, 4)
    assert {r["swap_id"] for r in records[2:]} == set(old) | {None}, "the refilled records keep their swaps"


def test_an_activity_path_that_cannot_be_used_fails_the_start_naming_it(tmp_path):
    not_sqlite = tmp_path / "activity.db"
    not_sqlite.write_text("not a database " * 200)
    router = RouterProcess(roster_dict(sim_model("a"), activity={"path": str(not_sqlite)}), tmp_path)
    try:
        assert router.proc.wait(30) == 1, router.log()
    finally:
        router.stop()
    assert f"hotswap: activity.path {not_sqlite}: cannot be used as the activity log's file: file is not a database" \
        in router.log()
    assert "Traceback" not in router.log()
