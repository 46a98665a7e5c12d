"""Helpers shared by the component tests: rosters of simulated engines, polling with deadlines."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any, Awaitable, Callable, Optional

import yaml

from config import Roster, parse_roster

SIM_LAUNCHER = ["python", "-m", "engines.sim", "serve"]
FAST_SIM = ["--sim-boot-s", "0", "--sim-token-rate", "5000"]


def sim_model(name: str, *, spec: bool = False, args: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"name": name, "model": f"sim/{name}", "launcher": SIM_LAUNCHER, "args": [*FAST_SIM, *args]}
    if spec:
        model["speculative"] = {"num_speculative_tokens": 3}
    model.update(extra)
    return model


def sim_roster(*models: dict[str, Any], **sections: Any) -> Roster:
    """A roster of simulated engines with short timeouts, so failures show in seconds."""
    swap = {"min_active_s": 0, "max_hold_s": 5, "drain_timeout_s": 5, "boot_timeout_s": 30,
            "timeouts": {k: 3 for k in ("sleep", "wake_weights", "reload_draft", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate")}}
    swap.update(sections.pop("swap", {}))
    data = {"swap": swap, "models": list(models), **sections}
    return parse_roster(yaml.safe_dump(data), "test-roster.yaml", os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def eventually(check: Callable[[], Any], timeout: float = 10, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll `check` (sync or async) until it returns something truthy, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if isinstance(value, Awaitable):
                value = await value
            if value:
                return value
        except Exception as exc:  # the thing polled may not be up yet
            last = exc
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s" + (f" (last error: {last!r})" if last else ""))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
