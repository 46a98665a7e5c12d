"""An operator reads an engine's log through the router: its last lines, and followed live (SSE)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from pathlib import Path
from typing import AsyncIterator, Callable

import aiohttp
import pytest

from router.admin.logs import HEARTBEAT_S, MAX_LINE_CHARS, MAX_LINES
from tests.component.test_admin import CHROMIUM
from tests.component.test_stalled_clients import its_stream_ended
from tests.support import ask, client, eventually, http, roster_dict, sim_model, until

ADMIN = {"Authorization": "Bearer ops-key"}
KEYED = roster_dict(sim_model("a", default=True), auth={"api_keys": ["${LOG_CLIENT}"], "admin_key": "${LOG_ADMIN}"})
KEYS = {"LOG_CLIENT": "client-key", "LOG_ADMIN": "ops-key"}


async def data_lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        assert "\r" not in line, line  # SSE would end the data line there
        if line.startswith("data: "):
            yield line[len("data: "):]


async def read_until(lines: AsyncIterator[str], done: Callable[[list[str]], bool], timeout: float = 15) -> list[str]:
    seen: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async for line in lines:
                seen.append(line)
                if done(seen):
                    return seen
    except TimeoutError:
        raise AssertionError(f"the lines expected did not arrive within {timeout} s; the last seen: {seen[-20:]}") from None
    raise AssertionError(f"the stream ended before the lines expected arrived: {seen[-20:]}")


async def test_an_operator_reads_the_last_lines_of_an_engines_log(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    status, _, body = await http(router, "GET", "/admin/logs/a?lines=5", headers=ADMIN)
    assert status == 200 and body["model"] == "a" and body["log_file"].endswith("a.log")
    assert 0 < len(body["lines"]) <= 5, body
    status, _, body = await http(router, "GET", "/admin/logs/a", headers=ADMIN)
    assert any(line.startswith("=== hotswap ") and "starting a" in line for line in body["lines"]), body["lines"]
    assert (await http(router, "GET", "/admin/logs/a?lines=0", headers=ADMIN))[2]["lines"] == []


async def test_a_bad_line_count_an_unknown_model_and_a_client_key_are_refused_in_openais_shape(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    # one way and one error for every /admin/* query (pydantic, `invalid_parameter`), as /admin/activity and /timeline
    for bad in ("-1", "ten", str(MAX_LINES + 1), "", "1_0", " 10", "10.0", "+5"):
        status, _, body = await http(router, "GET", f"/admin/logs/a?lines={bad}", headers=ADMIN)
        assert status == 400 and body["error"]["code"] == "invalid_parameter" and body["error"]["param"] == "lines", (bad, body)
        assert f"from 0 to {MAX_LINES}" in body["error"]["message"]
    for query, param in (("follow=yes", "follow"), ("lines=5&tail=1", "tail")):
        status, _, body = await http(router, "GET", f"/admin/logs/a?{query}", headers=ADMIN)
        assert status == 400 and body["error"]["param"] == param and body["error"]["code"] == "invalid_parameter", body
    status, _, body = await http(router, "GET", "/admin/logs/nope", headers=ADMIN)
    assert status == 404 and body["error"]["type"] == "not_found_error" and "nope" in body["error"]["message"]
    for headers in ({"Authorization": "Bearer client-key"}, {}):
        status, _, body = await http(router, "GET", "/admin/logs/a?follow=1", headers=headers)
        assert status == 401 and body["error"]["code"] == "invalid_admin_key"


async def test_log_follow_delivers_the_last_lines_then_new_ones_as_the_engine_writes_them(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    async with aiohttp.ClientSession() as s, s.get(router.url + "/admin/logs/a?follow=1&lines=3", headers=ADMIN) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = data_lines(r)
        assert len(await read_until(lines, lambda seen: len(seen) == 3)) == 3  # the tail first
        assert await ask(client(router, "client-key"), "a")  # the engine logs the request it served
        seen = await read_until(lines, lambda seen: any("POST /v1/completions" in line for line in seen))
        assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in seen), seen


async def test_a_follower_gets_odd_bytes_and_long_lines_as_lines_and_follows_the_file_when_it_is_truncated(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    log_file = Path((await router.engine("a"))["log_file"])
    async with aiohttp.ClientSession() as s, s.get(router.url + "/admin/logs/a?follow=1&lines=0", headers=ADMIN) as r:
        lines = data_lines(r)
        with log_file.open("ab") as log:  # what a crashing native library or a progress bar writes
            log.write(b"not utf-8: \xff\xfe end\nprogress 10%\rprogress 20%\r\nlong: " + b"x" * (2 * MAX_LINE_CHARS) + b"\nlast\n")
        seen = await read_until(lines, lambda seen: seen[-1] == "last")
        start = next(i for i, line in enumerate(seen) if line.startswith("not utf-8"))
        assert seen[start:start + 3] == ["not utf-8: \ufffd\ufffd end", "progress 10%", "progress 20%"], seen
        long = seen[start + 3:-1]
        assert "".join(long) == "long: " + "x" * (2 * MAX_LINE_CHARS) and max(map(len, long)) <= MAX_LINE_CHARS

        log_file.write_bytes(b"a new beginning\n")  # truncated, as `logrotate copytruncate` does
        assert (await read_until(lines, lambda seen: seen[-1] == "a new beginning"))[-1] == "a new beginning"
        log_file.unlink()  # replaced, as `logrotate` without copytruncate does
        log_file.write_bytes(b"another file\n")
        assert (await read_until(lines, lambda seen: seen[-1] == "another file"))[-1] == "another file"


async def test_a_quiet_log_gets_a_comment_now_and_then_so_proxies_keep_the_connection(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    async with aiohttp.ClientSession() as s, s.get(router.url + "/admin/logs/a?follow=1&lines=0", headers=ADMIN) as r:
        async with asyncio.timeout(HEARTBEAT_S + 15):
            async for raw in r.content:
                if raw.startswith(b":"):
                    assert raw == b": keep-alive\n"
                    break


async def test_the_router_stops_at_once_with_a_follower_still_connected(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    async with aiohttp.ClientSession() as s, s.get(router.url + "/admin/logs/a?follow=1&lines=1", headers=ADMIN) as r:
        lines = data_lines(r)
        await read_until(lines, lambda seen: len(seen) == 1)
        stopping = asyncio.create_task(asyncio.to_thread(router.stop, 20))  # past 20 s: SIGKILL, and the code says so
        async with asyncio.timeout(30):
            async for _ in lines:  # the stream ends (the engine's shutdown lines may come first)
                pass
        assert await stopping == 0, router.log()


def stalled_follower(router, model: str) -> socket.socket:
    """Follow `model`'s log with a 4 kB receive buffer, and never read a byte."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window offered
    s.connect(("127.0.0.1", router.port))
    s.sendall(f"GET /admin/logs/{model}?follow=1&lines=0 HTTP/1.1\r\nHost: router\r\n"
              "Authorization: Bearer ops-key\r\n\r\n".encode())
    # Following from the end (lines=0): a flood written before the router began following would never be sent.
    # Its answer's head, peeked at (not taken), says it has begun.
    until(lambda: s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT), 10, "the router following the log")
    return s


def unacknowledged(router_port: int, client: socket.socket) -> int:
    """Bytes the router has sent on `client`'s connection that the client has not taken (/proc/net/tcp's tx_queue)."""
    client_port = client.getsockname()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == router_port and int(fields[2].split(":")[1], 16) == client_port:
            return int(fields[4].split(":")[0], 16)
    return 0


def flood(log_file: Path, megabytes: int = 30) -> None:
    """Append what a chatty engine writes in a busy minute: far more than the socket buffers hold."""
    line = b"INFO engine: " + b"x" * 1010 + b"\n"
    with log_file.open("ab") as log:
        log.write(line * (megabytes * 1024))


async def test_a_follower_that_reads_nothing_is_cut_after_stall_timeout_s(start_router):
    roster = {**KEYED, "queue": {"stall_timeout_s": 1}}
    router = await start_router(roster, env=KEYS, admin_key="ops-key")
    log_file = Path((await router.engine("a"))["log_file"])
    s = stalled_follower(router, "a")
    try:
        flood(log_file)
        await eventually(lambda: "cut a follower of a's log from 127.0.0.1: the client took nothing of the log for "
                                 "queue.stall_timeout_s=1 s" in router.log(), timeout=30, what="the stalled follower cut")
        assert its_stream_ended(s)
    finally:
        s.close()
    status, _, body = await http(router, "GET", "/admin/logs/a?lines=1", headers=ADMIN)  # the router carries on
    assert status == 200 and body["lines"], body
    assert "Traceback" not in router.log() and "Error handling request" not in router.log(), router.log()


async def test_a_sigterm_ends_at_once_a_follower_that_reads_nothing(start_router):
    roster = {**KEYED, "queue": {"stall_timeout_s": 600}}  # the stall bound is not what ends it here
    router = await start_router(roster, env=KEYS, admin_key="ops-key")
    log_file = Path((await router.engine("a"))["log_file"])
    s = stalled_follower(router, "a")
    try:
        flood(log_file)
        readings = [-1]

        def stopped_sending() -> bool:  # the follower waits for its client: what it sent stopped growing
            readings.append(unacknowledged(router.port, s))
            return readings[-1] == readings[-2] > 0

        await eventually(stopped_sending, timeout=30, interval=0.5, what="the router's sends to the follower piling up "
                         "unread until its socket is full")
        # Well within aiohttp's 60 s shutdown timeout: before, the router waited for the follower that long, and more.
        assert await asyncio.to_thread(router.stop, 30) == 0, router.log()
        assert "cut a follower of a's log from 127.0.0.1: the router is shutting down" in router.log()
        assert "Traceback" not in router.log(), router.log()
    finally:
        s.close()


async def test_the_status_page_offers_to_follow_each_log_and_stops_refreshing_while_it_does(start_router):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    async with aiohttp.ClientSession() as s, s.get(router.url + "/ui", headers=ADMIN) as r:
        page = await r.text()
    pre, after = page.split("<pre id='log-a'")[1].split("</pre>", 1)
    assert "starting a" not in pre and "Uvicorn running" in pre  # the tail of this run
    assert "data-model='a'" in after.split("</details>")[0] and "followLog(this)" in after
    head = page.split("</head>")[0]
    assert "<noscript><meta http-equiv='refresh'" in head and head.count("http-equiv='refresh'") == 1
    script = page.split("<script>")[1]
    assert "new EventSource('/admin/logs/'" in script and "clearTimeout(refresh)" in script


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/install-tools.sh installs it)")
async def test_a_browser_on_the_status_page_follows_an_engines_log_live(start_router, tmp_path):
    router = await start_router(KEYED, env=KEYS, admin_key="ops-key")
    log_file = Path((await router.engine("a"))["log_file"])
    profile = tmp_path / "profile"
    # The operator logged in with Basic auth (the admin key as password); /ui#follow=a follows a's log at once.
    url = router.url.replace("http://", "http://operator:ops-key@") + "/ui#follow=a"
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                                "--remote-debugging-port=0", f"--user-data-dir={profile}", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = until(lambda: (profile / "DevToolsActivePort").read_text().split()[0], 30, "chromium's debugging port")
        async with aiohttp.ClientSession() as s:
            async def page_target() -> str:
                async with s.get(f"http://127.0.0.1:{port}/json/list") as r:
                    pages = [t for t in await r.json() if t["type"] == "page" and "/ui" in t["url"]]
                    return pages[0]["webSocketDebuggerUrl"] if pages else ""

            async with s.ws_connect(await eventually(page_target, 30, what="the /ui page open in chromium")) as ws:
                calls = iter(range(1, 10_000))

                async def evaluate(expression: str):
                    call = next(calls)
                    await ws.send_json({"id": call, "method": "Runtime.evaluate",
                                        "params": {"expression": expression, "returnByValue": True}})
                    while (answer := await ws.receive_json()).get("id") != call:
                        pass  # the page's events, and nothing else: one call at a time
                    return answer["result"]["result"].get("value")

                async def log_shown() -> str:
                    return await evaluate("(document.getElementById('log-a') || {}).textContent || ''")

                await eventually(lambda: evaluate("document.readyState === 'complete' && following === 1"), 30,
                                 what="the page loaded and following a's log")
                await evaluate("window.stillTheSamePage = true")
                with log_file.open("ab") as log:
                    log.write(b"written after the page loaded <b>1</b>\n")
                assert "written after the page loaded <b>1</b>" in await eventually(
                    lambda: _containing(log_shown(), "after the page loaded <b>1</b>"), 15, what="the new line in the page")
                # Past the page's 2 s refresh (or until it refreshed, which the assert below reports).
                past = await evaluate("performance.now()") + 2500
                await eventually(lambda: evaluate(f"window.stillTheSamePage !== true || performance.now() > {past}"), 15,
                                 what="the page's refresh interval to pass")
                assert await evaluate("window.stillTheSamePage === true"), "the page refreshed while following a log"
                with log_file.open("ab") as log:
                    log.write(b"and another\n")
                await eventually(lambda: _containing(log_shown(), "and another"), 15, what="the second line in the page")
                assert await evaluate("window.stillTheSamePage === true"), "the page refreshed while following a log"
    finally:
        browser.kill()
        browser.wait(10)


async def _containing(text, part: str) -> str:
    value = await text
    return value if part in value else ""
