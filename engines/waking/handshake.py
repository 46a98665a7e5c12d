"""The end of a boot: wait for a started (or attached) engine's /health, then learn what it serves.

Separate from the state machine (engines/engine.py) because it is the one part of a boot that
only talks to the engine: it polls, and on failure says why in the words the engine's failure
message gets; the engine decides what a failure does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from config.schema import ModelSpec
from engines.vllm import EngineError, EngineTLSError, VLLMClient
from engines.process import EngineProcess

HEALTH_POLL_S = 0.25  # how often a booting engine is asked; not a limit
HEALTH_CALL_S = 5.0  # one /health call; the boot as a whole is bounded by swap.boot_timeout_s


class BootFailed(Exception):
    def __init__(self, message: str, exited: bool = False) -> None:
        super().__init__(message)
        self.exited = exited  # the process is gone: its last log lines explain why


async def served_names(client: VLLMClient, process: Optional[EngineProcess], spec: ModelSpec, port: Optional[int],
                       deadline: float, boot_timeout_s: float) -> list[str]:
    """Once /health answers (before `deadline`), the names the engine serves."""
    await _healthy(client, process, deadline, boot_timeout_s)
    try:
        served = await client.served_models(timeout=max(0.1, deadline - time.monotonic()))
    except EngineError as exc:
        raise BootFailed(f"boot failed: {exc}") from None
    if spec.managed and spec.command is None and spec.name not in served:
        # The router composed --served-model-name: someone else answered on this port.
        raise BootFailed(f"boot failed: port {port} is answered by an engine serving {served}, not "
                         f"{spec.name!r} (another process took the port this engine was given)")
    return served


async def _healthy(client: VLLMClient, process: Optional[EngineProcess], deadline: float, boot_timeout_s: float) -> None:
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if process is not None and process.returncode is not None:
            raise BootFailed("exited during boot", exited=True)
        try:
            await client.health(timeout=min(HEALTH_CALL_S, max(0.1, deadline - time.monotonic())))
            return
        except EngineTLSError as exc:  # the certificate will not change while we wait
            raise BootFailed(f"boot failed: {exc}") from None
        except EngineError as exc:
            last_error = str(exc)
        await asyncio.sleep(HEALTH_POLL_S)
    raise BootFailed(f"not healthy within boot_timeout_s={boot_timeout_s:g} s (last: {last_error})")
