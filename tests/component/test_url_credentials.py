"""An attached engine whose `url` carries a password (`http://user:${PW}@host:port`, an engine behind a
proxy that wants Basic auth): the password reaches the engine and nobody else. Not a client's
/v1/models, not an operator's answers or the router's log, and no client-facing field names the
engine's internal address at all."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

from aiohttp import web

from router.errors import for_clients
from tests.support import ask, client, eventually, free_port, http, roster_dict

PASSWORD = "s3cret-Pa55word"


async def test_a_password_in_an_attached_engines_url_reaches_the_engine_and_no_one_else(start_router):
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "engines.sim", "serve", "sim/ext", "--port", str(port), "--sim-boot-s", "0"],
                              env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        router = await start_router(roster_dict({"name": "ext", "url": f"http://ops:${{ENGINE_PW}}@127.0.0.1:{port}", "default": True}),
                                    env={"ENGINE_PW": PASSWORD})
        assert await ask(client(router), "ext"), "proxied: the credentials are no part of the Host header"

        status, _, models = await http(router, "GET", "/v1/models")
        assert status == 200
        [card] = models["data"]
        assert card["root"] == "ext", "a url engine's card says its name, not where it listens"
        assert PASSWORD not in json.dumps(models) and str(port) not in json.dumps(models)

        status, _, body = await http(router, "GET", "/admin/logs/ext")
        assert status == 404 and PASSWORD not in json.dumps(body), body
    finally:
        engine.kill()
        engine.wait()
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "ext", "prompt": "x"})
    assert status == 502 and PASSWORD not in json.dumps(body), body
    await eventually(lambda: _failed(router), 15, what="the gone engine noticed")
    assert PASSWORD not in json.dumps(await router.status())
    assert "cannot connect to http://127.0.0.1:" in router.log() and PASSWORD not in router.log()


async def _failed(router) -> bool:
    return (await router.engine("ext"))["state"] == "failed"


async def test_the_urls_credentials_are_sent_as_basic_auth_on_control_calls_and_proxied_requests(start_router):
    """A stand-in for the proxy in front of such an engine: it takes only Basic ops:<password>, and
    answers as a vLLM server would (enough of one for a boot without a gate, and a completion)."""
    seen: list[tuple[str, str, str]] = []  # (path, Authorization, Host)
    expected = "Basic " + base64.b64encode(f"ops:{PASSWORD}".encode()).decode()

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", ""), request.host))
        if request.headers.get("Authorization") != expected:
            return web.json_response({"error": "unauthorized"}, status=401)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "ext", "object": "model"}]})
        if request.path == "/v1/completions":
            return web.json_response({"id": "c", "object": "text_completion", "model": "ext",
                                      "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
        return web.Response(text="")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        router = await start_router(roster_dict({"name": "ext", "url": f"http://ops:${{ENGINE_PW}}@127.0.0.1:{port}",
                                                 "default": True, "gate": {"enabled": False}}), env={"ENGINE_PW": PASSWORD})
        assert await ask(client(router), "ext") == "hi"
    finally:
        await runner.cleanup()
    assert {path for path, _, _ in seen} >= {"/health", "/v1/models", "/v1/completions"}
    assert all(auth == expected and host == f"127.0.0.1:{port}" for _, auth, host in seen), seen


async def test_a_client_told_an_engine_failed_hears_why_but_not_where_it_listens(start_router):
    """A dead attached engine: the waiter's 503 says what failed; its address is for the operator alone."""
    port = free_port()  # nothing listens there
    router = await start_router(roster_dict({"name": "ext", "url": f"http://127.0.0.1:{port}", "default": True},
                                            swap={"boot_timeout_s": 1}), booted=False)
    await eventually(lambda: _failed(router), what="ext failed its boot")
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "ext", "prompt": "x"})
    assert status == 503 and body["error"]["code"] == "engine_failed", body
    message = body["error"]["message"]
    assert "ext" in message and "not healthy" in message, message
    assert str(port) not in message and "127.0.0.1" not in message, message
    # The last probe was refused (its error names the address), or, on a loaded machine, timed out (no address).
    failure = (await router.engine("ext"))["failure"]
    assert str(port) in failure or "no answer within" in failure, failure
    assert for_clients(failure) in message, "the client reads the operator's failure, its address masked"
