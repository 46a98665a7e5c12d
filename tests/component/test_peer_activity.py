"""What the activity log keeps of a request passed on to a peer (`node.peers`): the node that answered
(`peer`), its status, timings and, when the answer carries them, tokens; `hotswap activity` shows it.
Two real routers with different models, each the other's peer, over loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import openai
import pytest

from tests.support import eventually, free_port, http, roster_dict, sim_model

KEY = "fleet-key"
# A long key name: `hotswap activity`'s columns widen to it rather than shift every column after it.
AUTH = {"keys": [{"key": "${FLEET_KEY}", "name": "team-analytics-nightly-batch", "models": ["*"]}]}


def node(name: str, model: str, peers: list[str]) -> dict:
    return roster_dict(sim_model(model), node={"name": name, "peers": peers}, auth=AUTH)


@pytest.fixture
async def pair(start_router):
    """node-a serves alpha, node-b serves beta; each lists the other as its peer."""
    a_port, b_port = free_port(), free_port()
    env = {"FLEET_KEY": KEY}
    a = await start_router(node("node-a", "alpha", [f"http://127.0.0.1:{b_port}"]), env=env, port=a_port)
    b = await start_router(node("node-b", "beta", [f"http://127.0.0.1:{a_port}"]), env=env, port=b_port)
    return a, b


async def records(router, count: int) -> list[dict]:
    async def enough() -> list[dict] | None:
        _, _, body = await http(router, "GET", "/admin/activity", headers=router.admin_headers)
        return body["records"] if len(body["records"]) >= count else None

    return await eventually(enough, 15, what=f"{count} activity records")


async def test_a_request_passed_to_a_peer_is_recorded_with_the_peer_its_status_timings_and_tokens(pair):
    a, _ = pair
    async with openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=KEY, max_retries=0, timeout=30) as c:
        answer = await c.completions.create(model="beta", prompt="hello", max_tokens=6, temperature=0)
        stream = await c.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        with pytest.raises(openai.BadRequestError):  # the peer's engine refuses it: its own 400 comes back
            await c.completions.create(model="beta", prompt="hello", max_tokens=0)
    refused, streamed, buffered = await records(a, 3)
    assert buffered["peer"] == "node-b" and buffered["engine"] is None and buffered["model"] == "beta", buffered
    assert buffered["status"] == 200 and buffered["duration_s"] > 0 and buffered["key_name"] == "team-analytics-nightly-batch"
    assert (buffered["prompt_tokens"], buffered["completion_tokens"]) == (answer.usage.prompt_tokens, 6)
    assert streamed["peer"] == "node-b" and streamed["status"] == 200 and streamed["endpoint"] == "chat"
    assert 0 < streamed["ttfb_s"] <= streamed["duration_s"], streamed
    assert (streamed["prompt_tokens"], streamed["completion_tokens"]) == (chunks[-1].usage.prompt_tokens, 5)
    assert refused["peer"] == "node-b" and refused["status"] == 400 and refused["completion_tokens"] is None

    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", "activity", "--url", a.url],
                                  capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    header, *lines = run.stdout.splitlines()
    assert len(lines) == 3 and all("peer node-b" in line for line in lines), run.stdout
    status_at = header.index("STATUS")
    assert all(line[status_at:].split()[0] in ("200", "400") for line in lines), "every column starts under its header"
