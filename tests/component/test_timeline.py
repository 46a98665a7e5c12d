"""The router's recent history as JSON (GET /admin/timeline): what /ui draws, and what other tools read."""

from __future__ import annotations

import time

import aiohttp
import yaml

from tests.support import ask, client, eventually, http, roster_dict, sim_model

# b has a draft but no draft restore: a Level-2 wake loses the draft, the gate refuses, a cold restart repairs it
TWO = roster_dict(sim_model("a", default=True), sim_model("b", spec=True, draft_restore="none"))


def states(lane: list[dict]) -> list[str]:
    return [f"{i['state']} L{i['level']}" if "level" in i else i["state"] for i in lane]


async def test_the_timeline_tells_a_swap_whose_gate_refused_as_refused_restarted_passed(start_router):
    router = await start_router(TWO)
    before = time.time()
    assert await ask(client(router), "b")
    status, _, body = await http(router, "GET", "/admin/timeline")
    assert status == 200 and body["minutes"] == 30

    # one lane per engine, times in epoch seconds, contiguous, the open interval last with `to: null`
    assert set(body["engines"]) == {"a", "b"}
    for lane in body["engines"].values():
        assert all(x["to"] == y["from"] for x, y in zip(lane, lane[1:])), lane
        assert lane[-1]["to"] is None and all(i["to"] is not None for i in lane[:-1])
    # both booted and recorded their baseline, one at a time (one fits on GPU 0); a then parked to make room for b
    a, b = states(body["engines"]["a"]), states(body["engines"]["b"])
    assert a[:3] == b[:3] == ["cold", "booting", "awake"], (a, b)
    assert a[-3:] == ["awake", "draining", "sleeping L2"], a
    # b: woken from Level 2, refused at its gate, cold-restarted, verified against its baseline, promoted
    assert b[-6:] == ["sleeping L2", "waking", "verifying", "cold", "booting", "awake"], b

    swap = next(s for s in body["swaps"] if s["to"] == "b")
    assert swap["from"] == ["a"] and swap["result"] == "ok" and swap["gates"] == ["refused", "restarted", "passed"]
    assert before <= swap["started"] <= swap["at"] <= body["now"] and swap["seconds"] > 0 and swap["predicted_s"] >= 0
    assert {"drain", "sleep", "wake_weights", "gate", "restart"} <= set(swap["phases"]), swap["phases"]

    refusals = [m for m in body["marks"] if m["kind"] == "refused"]
    assert [m["engine"] for m in refusals] == ["b"] and swap["started"] <= refusals[0]["at"] <= swap["at"]
    assert refusals[0]["detail"], "the refusal says why"
    restarts = [m for m in body["marks"] if m["kind"] == "restart"]
    assert [(m["engine"], m["detail"]) for m in restarts] == [("b", "gate")]

    # the samples: host RAM for Level 1 against its budget, and each GPU's shares, as placement counts them
    async def sampled_after_the_swap():
        _, _, now = await http(router, "GET", "/admin/timeline")
        last = now["samples"][-1]
        return now if last["gpus"]["0"].get("b", {}).get("state") == "awake" else None
    body = await eventually(sampled_after_the_swap, timeout=10, what="a sample with b awake")
    last = body["samples"][-1]
    assert last["gpus"]["0"]["b"] == {"state": "awake", "share": 0.9}
    assert last["gpus"]["0"]["a"]["state"] == "sleeping" and 0 < last["gpus"]["0"]["a"]["share"] < 0.1
    assert last["budget_gb"] >= 0 and last["host_gb"] >= 0
    # the status page's swap table says the same
    _, _, status_body = await http(router, "GET", "/admin/status")
    assert status_body["swaps"][0]["gates"] == ["refused", "restarted", "passed"]
    assert next(e for e in status_body["engines"] if e["name"] == "b")["boot_reason"] == "gate"


async def test_minutes_narrows_the_window_and_bad_input_gets_a_400_in_openais_shape(start_router):
    router = await start_router(roster_dict(sim_model("a")))
    _, _, whole = await http(router, "GET", "/admin/timeline?minutes=60")
    assert states(whole["engines"]["a"]) == ["cold", "booting", "awake"] and whole["minutes"] == 60
    awake_since = whole["engines"]["a"][-1]["from"]

    async def later():
        _, _, body = await http(router, "GET", "/admin/timeline?minutes=0.001")  # the last 60 ms
        return body if body["since"] > awake_since else None
    narrow = await eventually(later, timeout=5, what="a window that begins after a's boot")
    assert states(narrow["engines"]["a"]) == ["awake"], "only the interval still open reaches into the window"
    assert narrow["engines"]["a"][0]["from"] == awake_since, "it keeps its real start"
    assert narrow["swaps"] == [] and narrow["marks"] == []
    first, *within = narrow["samples"]  # a sample a second: one may land inside the 60 ms too
    assert first["at"] < narrow["since"], "the sample in force at the window's start comes first"
    assert len(within) <= 1 and all(s["at"] >= narrow["since"] for s in within), narrow["samples"]

    for bad in ("0", "-5", "61", "soon", "nan", "inf", "1_0", " 5", "1e1"):
        status, _, body = await http(router, "GET", f"/admin/timeline?minutes={bad}")
        assert status == 400, (bad, body)
        assert body["error"]["code"] == "invalid_parameter" and body["error"]["param"] == "minutes", body
        assert "at most 60" in body["error"]["message"]
    status, _, body = await http(router, "GET", "/admin/timeline?minute=5")
    assert status == 400 and body["error"]["param"] == "minute" and body["error"]["code"] == "invalid_parameter"


async def test_a_model_removed_by_a_reload_has_its_lane_end_at_its_retirement(start_router):
    share = ("--gpu-memory-utilization", "0.2")  # both fit awake: the reload parks nobody
    router = await start_router(roster_dict(sim_model("a", default=True, args=share), sim_model("gone", args=share)))
    router.roster_path.write_text(yaml.safe_dump(roster_dict(sim_model("a", default=True, args=share))))
    status, _, body = await http(router, "POST", "/admin/reload")
    assert status == 200 and body["changes"]["removed"] == ["gone"], body

    async def lane_ended():
        _, _, now = await http(router, "GET", "/admin/timeline")
        return now if now["engines"]["gone"][-1]["state"] == "removed" else None
    body = await eventually(lane_ended, timeout=15, what="gone's lane ended with `removed`")
    gone = body["engines"]["gone"]
    assert states(gone)[-2:] == ["cold", "removed"], gone  # stopped, then out of the roster
    assert all(i["to"] is not None for i in gone) and gone[-1]["from"] == gone[-1]["to"] <= body["now"], gone
    assert all(x["to"] == y["from"] for x, y in zip(gone, gone[1:])), gone
    assert body["engines"]["a"][-1]["to"] is None  # the model that stays is still in its state
    # /ui draws the lane up to the retirement and says it was removed, not `cold` until now
    async with aiohttp.ClientSession() as s, s.get(router.url + "/ui") as r:
        page = await r.text()
    lane = page.split("id='lane-gone'")[1].split("</g>")[0]
    assert "gone: removed from the roster at " in lane and "–now</title>" not in lane, lane
