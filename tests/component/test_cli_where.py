"""The client commands find a real router from its roster's `listen:`, and say which URL they tried once it is gone."""

from __future__ import annotations

import subprocess
import sys

from tests.support import free_port, roster_dict, sim_model


def hotswap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=60)


async def test_status_activity_and_reload_find_the_router_from_its_roster_and_name_the_url_once_it_stopped(start_router):
    port = free_port()
    router = await start_router(roster_dict(sim_model("chat"), listen={"host": "0.0.0.0", "port": port}), port=port)
    path = str(router.roster_path)

    status = hotswap("status", "--config", path)
    assert status.returncode == 0 and "chat" in status.stdout, status.stderr
    assert hotswap("activity", "--config", path).returncode == 0
    reload = hotswap("reload", "--config", path)
    assert reload.returncode == 0 and reload.stdout.splitlines()[-1] == f"applied {path}", reload.stderr

    assert router.stop() == 0
    gone = hotswap("status", "--config", path)
    assert gone.returncode == 1 and gone.stderr.startswith(
        f"hotswap status: cannot reach a router at http://127.0.0.1:{port} (from listen: in {path}): nothing listens there "
        "(connection refused). Is the router running there?"), gone.stderr
