"""`hotswap serve --simulate`: an operator's own roster of real vLLM engines, run without a GPU by the
simulator, with the roster's shares, levels and sizes (config/simulate.py)."""

from __future__ import annotations

from tests.support import ask, client, eventually, roster_dict

# Written for a GPU host: `vllm serve` (the default launcher), checkpoints that are not on this machine.
# Their shares (0.6 each) do not fit together: they take turns.
REAL = roster_dict(
    {"name": "llama", "model": "/models/llama-3.1-8b-instruct", "weights_gb": 16, "default": True,
     "args": ["--gpu-memory-utilization", 0.6, "--dtype", "bfloat16"]},
    {"name": "qwen", "model": "/models/qwen2.5-7b-instruct", "weights_gb": 15, "port": 1,
     "args": ["--gpu-memory-utilization", 0.6, "--max-model-len", 8192]},
    host={"ram_budget_gb": 64},
)


async def test_a_roster_of_real_vllm_engines_runs_simulated_answers_both_models_and_swaps(start_router):
    router = await start_router(REAL, args=("--simulate",))
    status = await router.status()
    assert status["simulated"] is True
    c = client(router)
    assert await ask(c, "qwen") and await ask(c, "llama") and await ask(c, "qwen")

    async def swapped() -> list:
        return [s for s in (await router.status())["swaps"] if s["to"] == "qwen" and "llama" in s["from"]]

    await eventually(swapped, what="a swap to qwen in /admin/status")
    log = router.log()
    assert "simulated: every engine runs as the simulator" in log and "Not modelled: durations" in log
    assert log.count("Not modelled") == 1  # said once
    assert "simulated: llama: weights 16.00 GB (weights_gb: 16 in the roster)" in log
    assert "simulated: no engine is real" in log
    engines = {e["name"]: e for e in status["engines"]}
    assert set(engines) == {"llama", "qwen"}


async def test_a_roster_whose_sizes_cannot_be_read_still_runs_and_says_what_it_assumed(start_router, tmp_path):
    unread = roster_dict(
        {"name": "mystery", "model": str(tmp_path / "not-here"), "args": ["--gpu-memory-utilization", 0.5]},
        {"name": "wrapped", "command": ["my-vllm-wrapper", "--port", "{port}", "--gpu-memory-utilization", "0.4"]},
    )
    router = await start_router(unread, args=("--simulate",))
    c = client(router)
    assert await ask(c, "mystery") and await ask(c, "wrapped")
    log = router.log()
    assert "simulated: mystery: weight size unknown: assumed as serve would assume it: it sleeps at level 2" in log
    assert "mystery: weight size unknown, so it sleeps at level 2" in log  # the router's own sizing, with the reason
    assert "wrapped: its command is not run; a simulated engine stands in, with the flags the router reads from it " \
           "(--gpu-memory-utilization 0.4)" in log
