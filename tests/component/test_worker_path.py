"""vLLM in its own environment: the router makes the worker extension importable there (engines.process.worker_path).

The simulator with `--sim-separate-env` looks the extension up the way a vLLM without hotswap installed
does, on PYTHONPATH alone, and fails its boot as vLLM's worker does when it is not there. Its launcher
is a shell wrapper (as `cpu_launcher` and most real launchers are), not the router's own interpreter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp

from engines.process import WORKER_EXTENSION
from tests.support import ask, client, eventually, http, roster_dict, sim_model

REPO = Path(__file__).resolve().parents[2]
# `vllm serve`'s place in a roster, taken by a wrapper that runs the simulator; the second one sets
# PYTHONPATH itself, as a careless launcher would, and so drops what the router put there.
WRAPPER = ["sh", "-c", 'exec "$0" -m engines.sim serve "$@"', sys.executable]
CLOBBERING = ["sh", "-c", 'PYTHONPATH=/opt/site exec "$0" -m engines.sim serve "$@"', sys.executable]


def separate_env(name: str, launcher: list[str], **extra) -> dict:
    # spec: the router reloads its draft, so it passes --worker-extension-cls
    return sim_model(name, spec=True, launcher=launcher, args=("--sim-separate-env",), **extra)


async def sim_state(router, name: str) -> dict:
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sim/state") as r:
        return await r.json()


async def test_an_engine_in_its_own_environment_imports_the_extension_from_the_routers_folder_alone(start_router):
    router = await start_router(roster_dict(separate_env("a", WRAPPER, default=True)))
    found = Path((await sim_state(router, "a"))["worker_extension_from"])
    folder = found.parents[2]
    assert found == folder / "engines" / "vllm_worker" / "__init__.py"
    assert REPO not in found.parents, "from the router's folder, not the checkout"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*.py")) == sorted(
        f"engines/vllm_worker/{p.name}" for p in (REPO / "engines" / "vllm_worker").glob("*.py"))
    assert await ask(client(router), "a")
    assert router.stop() == 0
    assert not folder.exists(), "the router removes its folder when it exits"


async def test_a_vllm_whose_python_cannot_import_the_extension_fails_its_boot_saying_which_python_and_what_to_do(start_router):
    router = await start_router(roster_dict(sim_model("a", default=True), separate_env("b", CLOBBERING)))
    await eventually(lambda: "boot finished" in router.log(), what="the end-of-boot summary")
    python = f"{sys.prefix}/bin/python{sys.version_info.major}.{sys.version_info.minor}"  # the simulator's, from its traceback
    said = (f"engine b: exited during boot (process exited with code 1): vLLM could not import the worker extension "
            f"{WORKER_EXTENSION} (ModuleNotFoundError: No module named 'engines') in its Python, {python}: nothing on "
            f"that Python's path holds it. The router puts a folder holding only the extension first on the engine's PYTHONPATH")
    keep = "a launcher that sets PYTHONPATH must keep that entry"
    assert said in router.log() and keep in router.log()
    failure = (await router.engine("b"))["failure"]
    assert failure.startswith(said) and keep in failure
    status, _, body = await http(router, "POST", "/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 4})
    assert status == 503 and said in body["error"]["message"] and keep in body["error"]["message"], body
