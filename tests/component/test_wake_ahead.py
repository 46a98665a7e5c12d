"""Waking ahead of demand with the real router process and simulated engines (the policy's scenarios
are in tests/unit/test_wake_ahead.py): room an operator frees goes to the model likeliest to be
asked for next, the operator's own choice stays asleep, and the pre-wake's outcome is counted."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ask, client, eventually, http, roster_dict, sim_model


# A wake costs a second, a sleep next to nothing: a pre-wake pays when the engine is about as likely to be
# asked for as not. Without it the two are the sims' bare round trips, and on a loaded machine the
# sleep can measure the dearer: the router then rightly declines the pre-wake. The sims' weights are of
# unknown size, so they sleep at Level 2, whose wake is tagged: the delay goes on its `wake_weights`
# step (the untagged `wake` step is a Level-1 wake's, which these never make).
WAKE_S = "1.0"


def model(name: str, share: float, **extra) -> dict:
    return sim_model(name, args=("--gpu-memory-utilization", str(share), "--sim-step-delay", f"wake_weights={WAKE_S}"),
                     **extra)


async def ahead_count(router, name: str, outcome: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        if family.name == "hotswap_wake_ahead":
            return sum(s.value for s in family.samples if s.name.endswith("_total")
                       and s.labels["model"] == name and s.labels["outcome"] == outcome)
    raise AssertionError("no hotswap_wake_ahead_total in /metrics")


async def test_room_an_operator_frees_goes_to_the_likeliest_parked_model_not_to_the_one_put_to_sleep(start_router):
    router = await start_router(roster_dict(model("a", 0.45, default=True), model("b", 0.45), model("c", 0.45)))
    c = client(router)
    assert await ask(c, "a")
    for _ in range(4):
        assert await ask(c, "b")  # b wakes beside a
    for _ in range(5):
        assert await ask(c, "c")  # c takes a's or b's room, and is the likeliest to be asked for again
    states = {e["name"]: e["state"] for e in (await router.status())["engines"]}
    assert sorted(states.values()) == ["awake", "awake", "sleeping"], states
    parked = next(n for n in ("a", "b") if states[n] == "sleeping")
    status, _, _ = await http(router, "POST", "/admin/sleep?model=c")
    assert status == 200

    async def woken_ahead():
        st = await router.status()
        done = st["placement"]["wake_ahead"]
        engines = {e["name"]: e for e in st["engines"]}
        return engines[parked]["state"] == "awake" and (done or engines[parked]["woken_ahead"]) and st
    st = await eventually(woken_ahead, timeout=20, what=f"{parked} woken ahead into the room c left")
    assert {e["name"]: e["state"] for e in st["engines"]}["c"] == "sleeping", "the operator put c to sleep: it stays"
    assert await ahead_count(router, parked, "woken") == 1
    assert await ask(c, parked)
    await eventually(lambda: _used(router, parked), timeout=10, what="the pre-wake counted as used")


async def _used(router, name: str) -> bool:
    return await ahead_count(router, name, "used") == 1
