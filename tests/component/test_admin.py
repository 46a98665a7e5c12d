"""The operator's side: admin actions, `hotswap status`, and the /ui page in a real headless browser."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

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
    stream = await client(router).completions.create(model="small", prompt="long", max_tokens=120, stream=True,
                                                         extra_body={"ignore_eos": True})  # a sampled end is no drain's
    await anext(aiter(stream))  # ~3 s of tokens still to come: the sleep must drain them first

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:  # as `curl -m 0.5` would
        with pytest.raises(asyncio.TimeoutError):
            await s.post(router.url + "/admin/sleep?model=small")

    async def draining() -> dict | None:  # the router may read the request after its caller left, on a loaded machine
        engine = await router.engine("small")
        return engine if engine["state"] == "draining" else None

    await eventually(draining, timeout=5, what="small draining for the sleep its caller left")

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


@pytest.mark.parametrize("forwarded", [{"X-Forwarded-For": "203.0.113.7"}, {"Forwarded": "for=203.0.113.7"},
                                       {"X-Real-IP": "203.0.113.7"}])
async def test_without_an_admin_key_a_request_a_front_forwarded_from_loopback_is_not_trusted_as_loopback(start_router, forwarded):
    """try-local's layout: HAProxy on the same host, so every outside client reaches the node from 127.0.0.1."""
    router = await start_router(roster_dict(sim_model("a", default=True)))
    status, _, body = await http(router, "GET", "/admin/status", headers=forwarded)
    assert status == 403 and body["error"]["code"] == "admin_loopback_only"
    assert (await http(router, "POST", "/admin/sleep?model=a", headers=forwarded))[0] == 403
    async with aiohttp.ClientSession() as s, s.get(router.url + "/ui", headers=forwarded) as r:
        assert r.status == 403
    assert (await router.engine("a"))["state"] == "awake", "the forwarded sleep did nothing"
    assert (await http(router, "GET", "/admin/status"))[0] == 200, "a loopback operator (no forwarding header) still may"
    assert await ask(client(router), "a"), "client routes do not care about forwarding headers"


async def test_with_an_admin_key_a_forwarded_request_is_an_admin_request_like_any_other(start_router):
    roster = roster_dict(sim_model("a", default=True), auth={"admin_key": "${T_ADMIN}"})
    router = await start_router(roster, env={"T_ADMIN": "admin-key"}, admin_key="admin-key")
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    assert (await http(router, "GET", "/admin/status", headers=forwarded))[0] == 401
    assert (await http(router, "GET", "/admin/status", headers={**forwarded, "Authorization": "Bearer admin-key"}))[0] == 200


async def test_hotswap_status_prints_a_readable_table(start_router):
    router = await start_router(TWO)
    assert await ask(client(router), "b")
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "status", "--url", router.url],
                                  capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "ready: yes"
    assert "GPU 0 (80 GB), shares of it: awake 0.90, residual 0.01, free 0.09  (a sleeping 0.0125, b awake 0.9)" in lines, lines
    header = next(l for l in lines if l.strip().startswith("MODEL"))
    assert header.split() == ["MODEL", "STATE", "FOR", "LEVEL", "GPUS", "SHARE", "WAKE~", "IN-FLIGHT", "QUEUED", "MAL", "base/obs",
                              "DRIFT", "last/limit", "RESTARTS", "LAST", "VERDICT"]
    row_b = next(l.split() for l in lines if l.strip().startswith("b "))
    assert row_b[1] == "awake" and row_b[4:7] == ["0", "0.9", "0.0s"] and row_b[-1] == "passed" and row_b[-2] == "1"
    assert row_b[-3] == "0/0.05", "the woken engine's logprob drift (bit-exact sim) and gate.max_logprob_drift"
    # b has no draft restore: its wake was refused by the gate and a restart repaired it, and the line says so
    assert any(l.strip().startswith("last wake: b refused → restarted → passed in") and "(parked a)" in l for l in lines), lines


async def test_a_booting_engine_says_why_it_boots_and_which_step_it_is_in(start_router):
    # b's boots take 2 s (its first, and the restart after its gate refuses a Level-2 wake without its draft)
    slow_b = sim_model("b", spec=True, draft_restore="none", args=("--sim-boot-s", "2"))
    router = await start_router(roster_dict(sim_model("a", default=True), slow_b))
    first = await router.engine("b")
    assert first["boot_reason"] == "first" and first["step"] is None and first["gate_story"] == ["baseline"]
    asked = asyncio.ensure_future(ask(client(router), "b"))

    async def restarting() -> dict | None:
        engine = await router.engine("b")
        return engine if engine["state"] == "booting" and engine["step"] == "load" else None
    engine = await eventually(restarting, timeout=10, what="b cold-restarting after the refusal, waiting to load")
    assert engine["boot_reason"] == "gate" and engine["gate_story"] == ["refused", "restarted"]
    assert engine["boot_deadline_in_s"] > 0
    async with aiohttp.ClientSession() as s, s.get(router.url + "/ui") as r:
        page = await r.text()
    row = page[page.index("<tr id='engine-b'>"):]
    assert "restart: the gate refused a wake, step: load, deadline in" in row[:row.index("</tr>")]
    assert await asked
    done = await router.engine("b")
    assert done["step"] is None and done["gate_story"] == ["refused", "restarted", "passed"] and done["boot_reason"] == "gate"


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
    # a parks at Level 1 and holds its host copy for real (a 20 MB checkpoint, so the host RAM chart has
    # something to show); b, woken from Level 2 without its draft, is refused by the gate and restarted
    checkpoint = tmp_path / "a-weights"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").open("wb").truncate(20_000_000)  # sparse; the router and the sim size from it
    # sleep_level 1: with its weights and the GPU's size known, `auto` would only release a's KV cache
    a = sim_model("a", default=True, model=str(checkpoint), args=("--sim-host-bytes-per-gb", "1e9"), sleep_level=1)
    router = await start_router(roster_dict(a, sim_model("b", spec=True, draft_restore="none"), host={"ram_budget_gb": 0.05}))
    before = await asyncio.to_thread(chromium, "--dump-dom", router.url + "/ui", profile=tmp_path / "p1")
    assert "id=\"engine-a\"" in before and "id=\"engine-b\"" in before and "no swaps yet" in before
    assert await ask(client(router), "b")  # refused by the gate, restarted, promoted

    async def host_copy_sampled() -> bool:
        _, _, timeline = await http(router, "GET", "/admin/timeline")
        return timeline["samples"][-1]["host_gb"] > 0
    await eventually(host_copy_sampled, timeout=10, what="a's host copy in the history's samples")
    after = await asyncio.to_thread(chromium, "--dump-dom", router.url + "/ui", profile=tmp_path / "p2")
    assert "a → b" in after and ">refused<" in after and "restart" in after

    # the swaps table and the engine's row tell the refusal a restart repaired, not a plain "ok" / "passed"
    swaps = svg_or_table(after, "<table class=\"swaps\">", "</table>")
    assert "refused → restarted → passed" in swaps and ">ok<" not in swaps
    assert "refused → restarted → passed" in svg_or_table(after, "<tr id=\"engine-b\">", "</tr>")
    assert "0: 0.90" in svg_or_table(after, "<tr id=\"engine-b\">", "</tr>"), "the GPU: share column"

    # the timeline: a lane per engine under its GPU, the refusal marker and the restart in b's lane, the
    # swap's end marked in the woken engine's lane
    timeline = ElementTree.fromstring(svg_or_table(after, "<svg id=\"timeline\"", "</svg>"))
    lanes = {g.get("data-engine"): g for g in timeline.iter(SVG + "g") if g.get("class") == "lane"}
    assert set(lanes) == {"a", "b"} and [t.text for t in timeline.iter(SVG + "text") if t.get("class") == "gpu-group"] == ["GPU 0"]
    assert classes(lanes["b"], "refusal-marker") == 1 and classes(lanes["b"], "restart-marker") == 1
    assert classes(lanes["a"], "refusal-marker") == 0 and classes(lanes["b"], "swap-marker") == 1
    assert classes(lanes["b"], "interval state-verifying") >= 1 and classes(lanes["a"], "interval state-sleeping-L1") == 1
    # the swap's phases beside its prediction, told as refused -> restarted -> passed
    bars = ElementTree.fromstring(svg_or_table(after, "<svg id=\"swap-phases\"", "</svg>"))
    swap = next(g for g in bars.iter(SVG + "g") if "swap-phases" in (g.get("class") or ""))
    assert swap.get("data-to") == "b" and "warn" in swap.get("class")
    assert [t.text for t in swap.iter(SVG + "text") if t.get("class") == "swap-story"] == ["refused → restarted → passed"]
    assert {"phase phase-gate", "phase phase-restart", "predicted"} <= {r.get("class") for r in swap.iter(SVG + "rect")}
    memory = ElementTree.fromstring(svg_or_table(after, "<svg id=\"memory\"", "</svg>"))
    assert [g.get("id") for g in memory.iter(SVG + "g") if g.get("class") == "gpu-shares"] == ["gpu-shares-0"]
    assert any(float(r.get("height")) > 10 for r in memory.iter(SVG + "rect") if r.get("class") == "host-ram"), "a's host copy"
    assert "id=\"legend\"" in after and "sleeping L1" in after and "gate refused" in after

    # the activity log: the request that waited for the refused-and-repaired swap links to that swap's row
    swap_id = (await http(router, "GET", "/admin/status"))[2]["last_swap"]["id"]
    recent = ElementTree.fromstring(svg_or_table(after, "<table class=\"recent\">", "</table>"))
    rows = [[("".join(td.itertext())) for td in tr.iter("td")] for tr in recent.iter("tr") if tr.get("class") == "activity"]
    assert len(rows) == 1 and rows[0][2:6] == ["b", "b", "completions", "200"] and rows[0][6] == f"swap {swap_id}", rows
    assert f"<tr id=\"swap-{swap_id}\">" in after and f"href=\"#swap-{swap_id}\"" in after

    shot = tmp_path / "ui.png"
    await asyncio.to_thread(chromium, f"--screenshot={shot}", "--window-size=1280,1650", "--hide-scrollbars",
                            router.url + "/ui", profile=tmp_path / "p3")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("HOTSWAP_DOCS_SCREENSHOT"):
        shutil.copy(shot, os.environ["HOTSWAP_DOCS_SCREENSHOT"])


SVG = "{http://www.w3.org/2000/svg}"


def svg_or_table(dom: str, start: str, end: str) -> str:
    """The first element of the dumped DOM that begins with `start`, up to its first `end`."""
    assert start in dom, f"{start!r} is not on the page"
    begin = dom.index(start)
    return dom[begin:dom.index(end, begin) + len(end)]


def classes(element: ElementTree.Element, css: str) -> int:
    return sum(1 for e in element.iter() if e.get("class") == css)


async def test_every_json_answer_of_the_router_ends_with_a_newline(start_router):
    """`curl` at a terminal leaves the prompt on a line of its own, and line-reading tools see a whole line."""
    router = await start_router(roster_dict(sim_model("a", default=True)))
    async with aiohttp.ClientSession() as s:
        for method, path in (("GET", "/admin/status"), ("GET", "/admin/timeline"), ("GET", "/admin/activity"),
                             ("GET", "/admin/logs/a?lines=1"), ("GET", "/v1/models"), ("GET", "/v1/models/a"),
                             ("GET", "/health"), ("GET", "/ready"), ("GET", "/admin/timeline?minutes=soon"),
                             ("POST", "/v1/chat/completions"), ("GET", "/admin/logs/nope")):
            async with s.request(method, router.url + path) as r:
                body = await r.read()
                assert r.content_type == "application/json" and body.endswith(b"}\n"), (path, r.status, body[-80:])
