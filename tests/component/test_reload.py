"""Roster hot reload on a real router: what a reload adds, removes, restarts and changes in place,
what it refuses, and that requests on the models it does not touch never notice."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import openai
import pytest
import yaml

from tests.support import ask, client, eventually, http, pid_alive, roster_dict, sim_model

SHARE = ("--gpu-memory-utilization", "0.2")  # everything fits at once: a reload never has to park anyone


def model(name: str, *args: str, **extra) -> dict:
    return sim_model(name, args=(*SHARE, *args), **extra)


async def reload(router, roster: dict, key: str | None = None) -> tuple[int, dict]:
    router.roster_path.write_text(yaml.safe_dump(roster))
    headers = {"Authorization": f"Bearer {key}"} if key else router.admin_headers
    status, _, body = await http(router, "POST", "/admin/reload", headers=headers)
    return status, body


async def engines(router) -> dict[str, dict]:
    return {e["name"]: e for e in (await router.status())["engines"]}


async def model_ids(router, key: str = "unused") -> set[str]:
    return {m.id async for m in client(router, key).models.list()}


async def test_a_reload_adds_removes_and_restarts_models_while_streams_on_the_others_lose_nothing(start_router):
    kept = model("kept", "--sim-token-rate", "400")
    before = roster_dict(kept, model("gone"), model("changed"), model("renamed", aliases=["old-alias"]))
    router = await start_router(before)
    pids = {name: e["pid"] for name, e in (await engines(router)).items()}

    results: list[str] = []
    stop = asyncio.Event()

    async def stream_forever() -> None:
        c = client(router)
        while not stop.is_set():
            text = ""
            async for chunk in await c.completions.create(model="kept", prompt="steady", max_tokens=24, stream=True):
                text += chunk.choices[0].text if chunk.choices else ""
            results.append(text)

    streams = [asyncio.create_task(stream_forever()) for _ in range(4)]
    await eventually(lambda: len(results) >= 4, what="the steady streams are flowing")

    after = roster_dict(kept, model("changed", "--sim-acceptance", "2.5"), model("renamed", aliases=["new-alias"]),
                        model("added"))
    status, body = await reload(router, after)
    assert status == 200, body
    assert body["changes"] == {"added": ["added"], "removed": ["gone"], "revived": [], "restarting": {"changed": ["args"]},
                               "changed_in_place": {"renamed": ["aliases"]}, "unchanged": ["kept"], "sections": [],
                               "needs_restart": []}
    # The new name table is in force the moment the call returns.
    assert await model_ids(router) == {"kept", "changed", "renamed", "new-alias", "added"}
    with pytest.raises(openai.NotFoundError):
        await ask(client(router), "gone")
    with pytest.raises(openai.NotFoundError):
        await ask(client(router), "old-alias")

    async def settled() -> bool:
        now = await engines(router)
        return set(now) == {"kept", "changed", "renamed", "added"} and all(e["state"] == "awake" for e in now.values()) \
            and not now["changed"]["roster_change_pending"]

    await eventually(settled, timeout=30, what="the added model booted, the removed one stopped, the changed one restarted")
    now = await engines(router)
    assert now["changed"]["pid"] != pids["changed"] and now["changed"]["restarts_by_reason"] == {"roster": 1}
    assert now["changed"]["boot_reason"] == "roster" and now["added"]["boot_reason"] == "first"  # as /ui says why it booted
    assert now["changed"]["verdicts"][0]["result"] == "baseline"  # a new entry: a new cold-boot baseline
    assert now["kept"]["pid"] == pids["kept"] and now["renamed"]["pid"] == pids["renamed"]
    assert not pid_alive(pids["gone"])
    assert await ask(client(router), "added") and await ask(client(router), "new-alias") and await ask(client(router), "changed")

    served = len(results)
    await eventually(lambda: len(results) >= served + 4, what="the steady streams still flowing")
    stop.set()
    await asyncio.gather(*streams)  # any failed stream raises here
    assert all(len(text) > 0 for text in results)


async def test_a_removed_model_finishes_its_stream_then_stops(start_router):
    slow = model("slow", "--sim-token-rate", "40")
    router = await start_router(roster_dict(model("other"), slow))
    pid = (await engines(router))["slow"]["pid"]
    stream = await client(router).completions.create(model="slow", prompt="long", max_tokens=40, stream=True)
    first = await anext(aiter(stream))

    status, body = await reload(router, roster_dict(model("other")))
    assert status == 200 and body["changes"]["removed"] == ["slow"]
    with pytest.raises(openai.NotFoundError) as refused:
        await ask(client(router), "slow")
    assert refused.value.body["code"] == "model_not_found"
    assert (await engines(router))["slow"]["retiring"] is True

    rest = [chunk async for chunk in stream]  # the stream in flight runs to its end on the old engine
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    await eventually(lambda: _gone(router, "slow"), timeout=15, what="slow stopped and removed")
    assert not pid_alive(pid)


async def test_a_model_added_back_while_it_is_being_removed_is_revived_and_the_reload_says_so(start_router):
    slow = model("slow", "--sim-token-rate", "40")
    router = await start_router(roster_dict(model("other"), slow))
    pid = (await engines(router))["slow"]["pid"]
    stream = await client(router).completions.create(model="slow", prompt="long", max_tokens=40, stream=True)
    await anext(aiter(stream))
    status, body = await reload(router, roster_dict(model("other")))
    assert status == 200 and body["changes"]["removed"] == ["slow"]
    assert (await engines(router))["slow"]["retiring"] is True  # its stream holds it

    status, body = await reload(router, roster_dict(model("other"), slow))
    assert status == 200, body
    assert body["changes"]["revived"] == ["slow"] and body["changes"]["unchanged"] == ["other"]
    assert body["summary"] == ["+ slow: revived (was being removed); it serves on"]
    assert "roster reload (POST /admin/reload): + slow: revived (was being removed)" in router.log()
    assert [chunk async for chunk in stream][-1].choices[0].finish_reason == "length"
    assert await ask(client(router), "slow")
    now = (await engines(router))["slow"]
    assert now["pid"] == pid and now["retiring"] is False and now["state"] == "awake", "it kept its engine"

    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "status", "--url", router.url],
                                  capture_output=True, text=True, timeout=30)
    assert any(line.endswith("applied: revived ['slow']") for line in run.stdout.splitlines()), run.stdout


async def _gone(router, name: str) -> bool:
    return name not in await engines(router)


async def test_an_invalid_roster_changes_nothing_and_every_error_says_where(start_router, tmp_path):
    roster = roster_dict(model("a"), model("b"))
    router = await start_router(roster)
    before = await engines(router)
    broken = roster_dict(model("a"), model("b", sleep_level=3), model("c", devices=[7]), gpus=[{"index": 0, "memory_gb": 80}])
    broken["models"][0]["modle"] = "typo"
    status, body = await reload(router, broken)
    assert status == 422 and body["error"]["code"] == "invalid_roster"
    errors = body["errors"]
    path = str(router.roster_path)
    assert any(e.startswith(f"{path}:") and "models[0].modle: unknown key 'modle'; did you mean 'model'?" in e for e in errors), errors
    assert any("models[1].sleep_level: must be 'auto', 0, 1 or 2 (found 3)" in e for e in errors), errors
    assert any("models[2].devices[0]: GPU 7 is not in gpus:" in e for e in errors), errors
    for error in errors:  # file:line:col: field: message
        file, line, col, rest = error.split(":", 3)
        assert file == path and int(line) > 0 and int(col) > 0 and rest.startswith(" models[")
    after = await engines(router)
    assert {n: (e["pid"], e["state"], e["roster_change_pending"]) for n, e in after.items()} == \
        {n: (e["pid"], e["state"], False) for n, e in before.items()}
    assert await model_ids(router) == {"a", "b"}
    assert (await router.status())["roster"]["last_reload"]["result"] == "refused"
    for error in errors:
        assert error in router.log()

    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "reload", "--url", router.url],
                                  capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines()[:-1] == errors and "nothing changed" in run.stderr.splitlines()[-1]


async def test_router_side_changes_apply_in_place_and_listen_changes_wait_for_a_restart(start_router):
    router = await start_router(roster_dict(model("a", spec=True), model("b")))
    pids = {name: e["pid"] for name, e in (await engines(router)).items()}
    changed = roster_dict(model("a", spec=True, aliases=["chat"], gate={"min_acceptance_ratio": 0.3, "max_tokens": 16}),
                          model("b", pin=True), queue={"max_waiting": 3}, listen={"port": 1})
    status, body = await reload(router, changed)
    assert status == 200, body
    assert body["changes"]["changed_in_place"] == {"a": ["aliases", "gate.min_acceptance_ratio"], "b": ["pin"]}
    assert body["changes"]["sections"] == ["queue"] and body["changes"]["needs_restart"] == ["listen.port"]
    assert "! listen.port: NOT applied: the listener needs a router restart (still on the old one)" in body["summary"]
    assert await ask(client(router), "chat")  # still on the listener it had
    now = await engines(router)
    assert {n: e["pid"] for n, e in now.items()} == pids and now["b"]["pin"] is True
    assert not any(e["roster_change_pending"] for e in now.values())


async def test_a_changed_canary_means_a_restart_and_a_new_baseline(start_router):
    router = await start_router(roster_dict(model("a")))
    pid = (await engines(router))["a"]["pid"]
    status, body = await reload(router, roster_dict(model("a", gate={"prompt": "Another canary.", "max_tokens": 16})))
    assert status == 200 and body["changes"]["restarting"] == {"a": ["gate.prompt"]}

    async def restarted() -> bool:
        a = (await engines(router))["a"]
        return a["pid"] not in (None, pid) and a["state"] == "awake"

    await eventually(restarted, timeout=20, what="a restarted from its new entry")
    assert (await engines(router))["a"]["verdicts"][0]["result"] == "baseline"


async def test_sighup_and_hotswap_reload_apply_the_file(start_router):
    router = await start_router(roster_dict(model("a")))
    router.roster_path.write_text(yaml.safe_dump(roster_dict(model("a"), model("b"))))
    router.proc.send_signal(signal.SIGHUP)
    await eventually(lambda: _present(router, "b"), timeout=20, what="b added by SIGHUP")
    assert (await router.status())["roster"]["last_reload"]["trigger"] == "SIGHUP"

    router.roster_path.write_text(yaml.safe_dump(roster_dict(model("b"))))
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "reload", "--url", router.url],
                                  capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["- a: removed; takes no new requests, stops once its requests are done",
                                       f"applied {router.roster_path}"]
    await eventually(lambda: _gone(router, "a"), timeout=15, what="a stopped and removed")
    status = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "status", "--url", router.url],
                                     capture_output=True, text=True, timeout=30)
    assert any(line.strip().startswith("last reload (POST /admin/reload) at ") and line.endswith("applied: removed ['a']")
               for line in status.stdout.splitlines()), status.stdout


async def _present(router, name: str) -> bool:
    e = (await engines(router)).get(name)
    return e is not None and e["state"] == "awake"


async def test_a_reload_while_the_engines_boot_is_refused_and_sighup_waits_for_the_boot(start_router, tmp_path):
    from tests.support import RouterProcess

    slow = model("slow", "--sim-boot-s", "3")
    router = RouterProcess(roster_dict(model("a"), slow), tmp_path, env={"HOTSWAP_SIM_GPU_LEDGER": str(tmp_path / "ledger.json")})
    try:
        async def listening() -> bool:
            return (await http(router, "GET", "/health"))[0] == 200

        await eventually(listening, what="the router listens")
        status, body = await reload(router, roster_dict(model("a"), slow, model("b")))
        assert status == 409 and body["error"]["code"] == "still_booting"
        router.proc.send_signal(signal.SIGHUP)  # applied once the boot ends
        await eventually(lambda: _present(router, "b"), timeout=30, what="b added after the boot")
    finally:
        assert router.stop() == 0, router.log()


async def test_hotswap_reload_says_when_no_router_answers():
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "reload", "--url", "http://127.0.0.1:9"],
                                  capture_output=True, text=True, timeout=60, env={**os.environ, "HOTSWAP_ADMIN_KEY": ""})
    assert run.returncode == 1 and "cannot reach a router at http://127.0.0.1:9" in run.stderr
