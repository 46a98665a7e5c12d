"""`hotswap status` and `hotswap reload` against a router with an admin key: a refusal says what to set."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from tests.support import roster_dict, sim_model

ADMIN_KEY = "sk-admin-cli-secret"


async def hotswap(*args: str, key_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_ADMIN_KEY"}
    if key_env is not None:
        env["HOTSWAP_ADMIN_KEY"] = key_env
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True,
                                   timeout=60, env=env)


async def test_status_and_reload_without_the_admin_key_say_which_flag_or_variable_to_set(start_router):
    router = await start_router(roster_dict(sim_model("a"), auth={"admin_key": "${CLI_ADMIN}"}), env={"CLI_ADMIN": ADMIN_KEY},
                                admin_key=ADMIN_KEY)
    for command in ("status", "reload"):
        run = await hotswap(command, "--url", router.url)
        assert run.returncode == 1 and run.stdout == ""
        assert f"hotswap {command}: {router.url} wants the admin key: pass --admin-key KEY or set HOTSWAP_ADMIN_KEY" in run.stderr
        assert "{" not in run.stderr, run.stderr  # not the raw 401 body

        run = await hotswap(command, "--url", router.url, "--admin-key", "sk-wrong-cli-secret")
        assert run.returncode == 1 and "refused the admin key given" in run.stderr, run.stderr
        assert "sk-wrong-cli-secret" not in run.stderr + run.stdout

    run = await hotswap("status", "--url", router.url, key_env=ADMIN_KEY)
    assert run.returncode == 0 and run.stdout.startswith("ready: yes"), run.stderr
    run = await hotswap("reload", "--url", router.url, "--admin-key", ADMIN_KEY)
    assert run.returncode == 0 and "applied" in run.stdout, run.stderr
    assert ADMIN_KEY not in run.stdout + run.stderr
