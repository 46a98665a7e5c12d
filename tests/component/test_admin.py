"""The operator's side: admin actions, `hotswap status`, and the /ui page in a real headless browser."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support import ask, client, eventually, http, roster_dict, sim_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TWO = roster_dict(sim_model("a", default=True), sim_model("b", spec=True, draft_restore="none"))


async def admin(router, action: str, model: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await http(router, "POST", f"/admin/{action}?model={model}", headers=headers)


async def test_an_operator_can_swap_in_sleep_and_restart_a_model(start_router):
    router = await start_router(TWO)
    status, _, body = await admin(router, "swap", "b")
    assert status == 200 and body["result"] == "awake" and body["engine"]["state"] == "awake"
    assert (await router.engine("a"))["state"] == "sleeping"
    # b has no draft restore: the swap went through the gate, was refused, and was restarted
    assert body["engine"]["restarts_by_reason"] == {"gate": 1}

    assert (await admin(router, "swap", "b"))[2]["result"] == "already awake"
    status, _, body = await admin(router, "sleep", "b")
    assert status == 200 and body["result"] == "sleeping" and body["engine"]["sleep_level"] == 2
    assert (await admin(router, "sleep", "b"))[2]["result"] == "not awake (sleeping)"

    status, _, body = await admin(router, "restart", "a")  # asleep: the cold boot makes it the awake one
    assert status == 200 and body["result"] == "awake" and body["engine"]["state"] == "awake"
    assert body["engine"]["restarts_by_reason"] == {"admin": 1}
    first_pid = body["engine"]["pid"]
    status, _, body = await admin(router, "restart", "a")  # awake: restarted in place
    assert body["engine"]["pid"] != first_pid and body["engine"]["restarts_by_reason"] == {"admin": 2}
    assert await ask(client(router), "a")

    assert (await admin(router, "swap", "nope"))[0] == 404
    status, _, body = await http(router, "POST", "/admin/swap")
    assert status == 400 and body["error"]["code"] == "missing_model"


async def test_an_admin_sleep_whose_caller_disconnects_still_parks_the_engine_once_its_stream_ends(start_router):
    router = await start_router(roster_dict(sim_model("small", args=("--sim-token-rate", "40"))))
    before = await router.engine("small")
    stream = await client(router).completions.create(model="small", prompt="long", max_tokens=120, stream=True)
    await anext(aiter(stream))  # ~3 s of tokens still to come: the sleep must drain them first

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:  # as `curl -m 0.5` would
        with pytest.raises(asyncio.TimeoutError):
            await s.post(router.url + "/admin/sleep?model=small")
    assert (await router.engine("small"))["state"] == "draining"

    rest = [chunk async for chunk in stream]
    assert rest[-1].choices[0].finish_reason == "length", "the drain let the stream finish"

    async def parked() -> dict | None:
        engine = await router.engine("small")
        return engine if engine["state"] == "sleeping" else None

    engine = await eventually(parked, timeout=10, what="small parked by the sleep its caller left")
    assert engine["in_flight"] == 0
    assert "admin sleep small: the caller left before it ended; it runs on" in router.log()

    assert await ask(client(router), "small")  # woken from its sleep, not cold-restarted
    after = await router.engine("small")
    assert after["state"] == "awake" and after["pid"] == before["pid"] and after["restarts"] == before["restarts"]


async def test_the_admin_key_guards_admin_and_ui_and_is_separate_from_client_keys(start_router):
    roster = roster_dict(sim_model("a", default=True), auth={"api_keys": ["${T_CLIENT}"], "admin_key": "${T_ADMIN}"})
    router = await start_router(roster, env={"T_CLIENT": "client-key", "T_ADMIN": "admin-key"}, admin_key="admin-key")
    assert (await http(router, "GET", "/admin/status", headers={"Authorization": "Bearer client-key"}))[0] == 401
    assert (await http(router, "GET", "/admin/status", headers={"Authorization": "Bearer admin-key"}))[0] == 200
    assert (await admin(router, "sleep", "a", key="client-key"))[0] == 401
    assert (await admin(router, "sleep", "a", key="admin-key"))[0] == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/ui") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == 'Basic realm="hotswap"'
        basic = base64.b64encode(b"operator:admin-key").decode()
        async with s.get(router.url + "/ui", headers={"Authorization": f"Basic {basic}"}) as r:
            assert r.status == 200 and "<h2>placement</h2>" in await r.text()
    # the admin key is no client key
    status, _, _ = await http(router, "POST", "/v1/completions", json={"model": "a", "prompt": "x"},
                              headers={"Authorization": "Bearer admin-key"})
    assert status == 401


async def test_hotswap_status_prints_a_readable_table(start_router):
    router = await start_router(TWO)
    assert await ask(client(router), "b")
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "status", "--url", router.url],
                                  capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "ready: yes"
    assert "GPU 0 of 80 GB: awake 0.90, residual 0.01, free 0.09  (a asleep 0.0125, b awake 0.9)" in lines, lines
    header = next(l for l in lines if l.strip().startswith("MODEL"))
    assert header.split() == ["MODEL", "STATE", "FOR", "LEVEL", "GPUS", "SHARE", "WAKE~", "IN-FLIGHT", "QUEUED", "MAL", "base/obs",
                              "DRIFT", "last/max", "RESTARTS", "LAST", "VERDICT"]
    row_b = next(l.split() for l in lines if l.strip().startswith("b "))
    assert row_b[1] == "awake" and row_b[4:7] == ["0", "0.9", "0.0s"] and row_b[-1] == "passed" and row_b[-2] == "1"
    assert row_b[-3] == "0/0.05", "the woken engine's logprob drift (bit-exact sim) and gate.max_logprob_drift"
    assert any(l.strip().startswith("last wake: b ok in") and "(parked a)" in l for l in lines), lines


def chromium(*args: str, profile: Path) -> str:
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.skipif(CHROMIUM is None and os.environ.get("HOTSWAP_REQUIRE_TOOLS") != "1",
                    reason="chromium is not installed (.ci/install-tools.sh installs it)")
async def test_the_status_page_renders_the_roster_and_shows_a_swap_in_a_real_browser(start_router, tmp_path):
    assert CHROMIUM, "HOTSWAP_REQUIRE_TOOLS=1 but chromium is missing"
    router = await start_router(TWO)
    before = await asyncio.to_thread(chromium, "--dump-dom", router.url + "/ui", profile=tmp_path / "p1")
    assert "id=\"engine-a\"" in before and "id=\"engine-b\"" in before and "no swaps yet" in before
    assert await ask(client(router), "b")  # refused by the gate, restarted, promoted
    after = await asyncio.to_thread(chromium, "--dump-dom", router.url + "/ui", profile=tmp_path / "p2")
    assert "a → b" in after and ">refused<" in after and "restart" in after
    shot = tmp_path / "ui.png"
    await asyncio.to_thread(chromium, f"--screenshot={shot}", "--window-size=1280,1000", "--hide-scrollbars",
                            router.url + "/ui", profile=tmp_path / "p3")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("HOTSWAP_DOCS_SCREENSHOT"):
        shutil.copy(shot, os.environ["HOTSWAP_DOCS_SCREENSHOT"])
