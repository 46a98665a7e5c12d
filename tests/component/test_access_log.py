"""The access log (`listen.access_log`): a line per request, refused ones included, naming keys, never quoting them."""

from __future__ import annotations

import aiohttp

from tests.support import ask, client, http, roster_dict, sim_model, until

KEYS = {"AL_CLIENT": "sk-client-secret", "AL_ADMIN": "sk-admin-secret", "AL_OPS": "sk-ops-secret"}
AUTH = {"api_keys": ["${AL_CLIENT}"], "admin_key": "${AL_ADMIN}", "keys": [{"key": "${AL_OPS}", "name": "ops", "models": ["*"]}]}


def access_lines(router) -> list[str]:
    return [line for line in router.log().splitlines() if " access " in line]


async def test_every_request_leaves_an_access_line_and_no_key_appears_in_it(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), auth=AUTH, listen={"access_log": True}),
                                env=KEYS, admin_key=KEYS["AL_ADMIN"])
    assert await ask(client(router, KEYS["AL_OPS"]), "a")
    assert (await http(router, "GET", "/v1/models", headers={"Authorization": "Bearer sk-wrong-secret"}))[0] == 401
    assert (await http(router, "GET", "/v1/models"))[0] == 401
    assert (await http(router, "GET", "/admin/status?key=sk-client-secret", headers=router.admin_headers))[0] == 200
    assert (await http(router, "GET", "/admin/logs/nope", headers=router.admin_headers))[0] == 404
    assert (await http(router, "GET", "/no/such/route", headers={"Authorization": "Bearer sk-client-secret"}))[0] == 404
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics", headers=router.admin_headers) as r:
        assert r.status == 200

    def logged() -> list[str]:
        lines = access_lines(router)
        return lines if len(lines) >= 6 and any("/metrics" in line for line in lines) else []

    lines = until(logged, 10, "an access line for each request")
    assert any(" POST /v1/completions 200 " in line and "key=ops model=a" in line for line in lines), lines
    assert any(" GET /v1/models 401 " in line and "key=unknown" in line for line in lines), lines
    assert any(" GET /v1/models 401 " in line and "key=- " in line for line in lines), lines
    assert any(" GET /admin/status 200 " in line and "key=admin_key" in line for line in lines), lines
    assert any(" GET /admin/logs/nope 404 " in line for line in lines), lines
    assert any(" GET /no/such/route 404 " in line for line in lines), lines
    assert any(" GET /metrics 200 " in line for line in lines), lines
    assert not [line for line in router.log().splitlines() if "secret" in line]


async def test_without_listen_access_log_requests_leave_no_line(start_router):
    router = await start_router(roster_dict(sim_model("a")))
    assert (await http(router, "GET", "/no/such/route"))[0] == 404
    assert await ask(client(router), "a")
    assert access_lines(router) == []
