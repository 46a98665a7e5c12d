"""LoRA adapters through the router: routed by the names the engine reported at boot, listed
with their parent, unchanged across a Level-2 sleep and wake, checked by the gate when the
roster names a gate.lora_canary, and loaded or unloaded only through the admin API.
"""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.support import client, http, roster_dict, sim_model

pytestmark = pytest.mark.timeout(60)

ADMIN = "sk-lora-admin-51d0"
LORA = ("--enable-lora", "--lora-modules", "terse=/adapters/terse", "poet=/adapters/poet")


async def admin(router, path: str, body=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(router.url + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            return r.status, await r.json(content_type=None)


async def complete(router, model: str) -> str:
    answer = await client(router).completions.create(model=model, prompt="write", max_tokens=8, temperature=0)
    return answer.choices[0].text


async def sleep_and_wake(router, name: str) -> None:
    status, body = await admin(router, f"/admin/sleep?model={name}")
    assert status == 200 and (await router.engine(name))["state"] == "sleeping", body
    assert (await router.engine(name))["sleep_level"] == 2


async def test_adapters_answer_like_before_across_a_level2_sleep_and_wake(start_router):
    router = await start_router(roster_dict(sim_model("chat", default=True, sleep_level=2, args=LORA)), admin_key=None)
    before = {m: await complete(router, m) for m in ("chat", "terse", "poet")}
    assert len(set(before.values())) == 3  # each adapter really answers, differently from the base model
    await sleep_and_wake(router, "chat")
    after = {m: await complete(router, m) for m in ("chat", "terse", "poet")}  # the first request wakes it
    assert after == before


@pytest.mark.parametrize("on_fail", ["restart", "refuse"])
async def test_the_gate_catches_an_adapter_that_came_back_wrong(start_router, on_fail):
    model = sim_model("chat", default=True, sleep_level=2, args=(*LORA, "--sim-lora-lost-on-level2"),
                      gate={"lora_canary": "terse", "on_fail": on_fail})
    router = await start_router(roster_dict(model))
    before = await complete(router, "terse")
    await sleep_and_wake(router, "chat")
    if on_fail == "restart":
        assert await complete(router, "terse") == before  # refused, restarted cold, re-verified: the adapter is back
        engine = await router.engine("chat")
        assert engine["restarts"], engine
    else:
        with pytest.raises(openai.APIStatusError) as raised:
            await complete(router, "terse")
        assert raised.value.status_code == 503
    refused = [v for v in (await router.engine("chat"))["verdicts"] if v["result"] == "refused"]
    assert len(refused) == 1 and refused[0]["reason"].startswith("LoRA adapter 'terse': canary output differs"), refused


async def test_a_lora_canary_the_engine_does_not_serve_fails_the_boot_with_the_reason(start_router):
    model = sim_model("chat", default=True, args=LORA, gate={"lora_canary": "typo"})
    router = await start_router(roster_dict(model, sim_model("other")))
    engine = await router.engine("chat")
    assert engine["state"] == "failed" and "gate.lora_canary 'typo' is not served" in engine["failure"], engine


async def test_runtime_adapters_are_an_admin_action_only(start_router):
    model = sim_model("chat", default=True, args=("--enable-lora",), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    router = await start_router(roster_dict(model, auth={"admin_key": "${LORA_ADMIN}"}), env={"LORA_ADMIN": ADMIN}, admin_key=ADMIN)
    # clients cannot reach the engine's own LoRA endpoints, under any key
    for key in ("unused", ADMIN):
        got, _, body = await http(router, "POST", "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                                  headers={"Authorization": f"Bearer {key}"})
        assert got == 404, body
    status, body = await admin(router, "/admin/lora/load?model=chat", {"lora_name": "fresh", "lora_path": "/adapters/fresh"})
    assert status == 200 and body["adapters"] == ["fresh"], body
    models = {m.id: m for m in (await client(router).models.list()).data}
    assert models["fresh"].parent == "chat"
    assert await complete(router, "fresh") != await complete(router, "chat")
    status, body = await admin(router, "/admin/lora/load?model=chat", {"lora_name": "fresh", "lora_path": "/adapters/fresh"})
    assert status == 400 and "already been loaded" in body["error"]["message"], body
    status, body = await admin(router, "/admin/lora/unload?model=chat", {"lora_name": "fresh"})
    assert status == 200 and body["adapters"] == [], body
    with pytest.raises(openai.NotFoundError, match="The model 'fresh' does not exist"):
        await complete(router, "fresh")  # a removed adapter's name: a clear 404, in OpenAI's shape
    status, body = await admin(router, "/admin/lora/unload?model=chat", {"lora_name": "fresh"})
    assert status == 404 and "cannot be found" in body["error"]["message"], body
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/admin/lora/load?model=chat", json={"lora_name": "y", "lora_path": "/y"}) as r:
            assert r.status == 401
        # json's parser recurses per level: a body nested past Python's stack is malformed JSON, not a 500
        async with s.post(router.url + "/admin/lora/load?model=chat", data=b"[" * 100_000,
                          headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
