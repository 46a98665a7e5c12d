"""Helpers shared by the component tests: rosters of simulated engines, polling with deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import aiohttp
import openai
import yaml

import engines.waking
from config import Roster, parse_roster

SIM_LAUNCHER = ["python", "-m", "engines.sim", "serve"]
FAST_SIM = ["--sim-boot-s", "0", "--sim-token-rate", "5000"]


SIM_GPU_GB = 80  # the simulator's memory oracle's default device size


def sim_model(name: str, *, spec: bool = False, args: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"name": name, "model": f"sim/{name}", "launcher": SIM_LAUNCHER, "args": [*FAST_SIM, *args]}
    if spec:
        model["speculative"] = {"num_speculative_tokens": 3}
    model.update(extra)
    return model


def sim_roster(*models: dict[str, Any], **sections: Any) -> Roster:
    """A roster of simulated engines with short timeouts, so failures show in seconds."""
    return parse_roster(yaml.safe_dump(roster_dict(*models, **sections)), "test-roster.yaml", os.environ)


# What the router asks an engine around every sleep and wake to measure its host memory
# (engines/memory/host.py); left out where a test asserts the staged wake's order.
HOST_MEMORY_RPCS = frozenset({"hotswap_host_memory", "hotswap_empty_host_cache"})


def dev_steps(entries: list[dict[str, Any]]) -> list[str]:
    """The steps of a simulated engine's /sim/log, without generations and host-memory reports."""
    return [e["step"] for e in entries if e["step"] != "generate" and e.get("method") not in HOST_MEMORY_RPCS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hopeless(AssertionError):
    """Polling cannot succeed any more (the router process has exited): fail now, not at the deadline."""


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
        except Hopeless:
            raise
        except Exception as exc:  # the thing polled may not be up yet
            last = exc
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s" + (f" (last error: {last!r})" if last else ""))


def until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """The synchronous twin of `eventually`, for tests and fixtures outside an event loop."""
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Hopeless:
            raise
        except Exception as exc:  # the thing polled may not be up yet
            last = exc
        time.sleep(interval)
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


PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10)  # a probe of a router that hangs fails, and is polled again


class RouterProcess:
    """A real `hotswap serve` process on a free loopback port."""

    def __init__(self, roster: dict[str, Any], tmp_path, env: Optional[dict[str, str]] = None, admin_key: Optional[str] = None,
                 port: Optional[int] = None, args: tuple[str, ...] = ()):
        self.own_port = port is None  # given: a router whose URL others were told before it started (peers)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.env = dict(env or {})
        self.roster_path = tmp_path / "roster.yaml"
        self.roster_path.write_text(yaml.safe_dump(roster))
        self.log_path = tmp_path / "router.log"
        self._log = self.log_path.open("w")
        self._argv = ["--config", str(self.roster_path), "--log-dir", str(tmp_path / "engines"), *args]
        self.port_retries = 0
        self._spawn()

    def _spawn(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--port", str(self.port), *self._argv],
                                     stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})

    def _lost_its_port(self) -> bool:
        """free_port's port was taken by another process (a test beside this one) before the router bound it:
        start again on another port. Only at start, and only for a port this object chose."""
        taken = f"cannot listen on 127.0.0.1:{self.port}: error while attempting to bind"
        if not self.own_port or self.port_retries >= 3 or taken not in self.log():
            return False
        self.port_retries += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log.write(f"--- tests.support: port taken before the router bound it; starting again on {self.port}\n")
        self._log.flush()
        self._spawn()
        return True

    def log(self) -> str:
        return self.log_path.read_text()

    def check_alive(self) -> None:
        if self.proc.poll() is not None and not self._lost_its_port():
            raise Hopeless(f"the router exited with {self.proc.returncode}:\n{self.log()}")

    async def wait_listening(self, timeout: float = 30) -> None:
        async def health() -> bool:
            self.check_alive()
            async with aiohttp.ClientSession(timeout=PROBE_TIMEOUT) as s, s.get(self.url + "/health") as r:
                return r.status == 200

        await eventually(health, timeout, interval=0.05, what=f"router listening at {self.url}")

    async def wait_ready(self, timeout: float = 30, session=None) -> None:
        async def ready() -> bool:
            self.check_alive()
            async with aiohttp.ClientSession(timeout=PROBE_TIMEOUT) as s, s.get(self.url + "/ready") as r:
                return r.status == 200

        async def booted() -> bool:
            status = await self.status()
            return status["booted"]

        await eventually(ready, timeout, interval=0.05, what=f"router ready at {self.url}")
        await eventually(booted, timeout, interval=0.05, what="every engine booted")

    async def status(self) -> dict[str, Any]:
        self.check_alive()
        async with aiohttp.ClientSession(timeout=PROBE_TIMEOUT) as s, s.get(self.url + "/admin/status", headers=self.admin_headers) as r:
            return await r.json()

    async def engine(self, name: str) -> dict[str, Any]:
        status = await self.status()
        return next(e for e in status["engines"] if e["name"] == name)

    def stop(self, timeout: float = 30) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def roster_dict(*models: dict[str, Any], **sections: Any) -> dict[str, Any]:
    swap = {"min_active_s": 0, "max_hold_s": 5, "drain_timeout_s": 5, "boot_timeout_s": 30,
            "timeouts": {k: 5 for k in engines.waking.PHASES if k != "drain"}}
    swap.update(sections.pop("swap", {}))
    # A short canary keeps scenarios with slow simulated engines quick; 16 tokens still give the
    # simulator's acceptance accumulator enough drafts to land within 0.1 of its configured value.
    defaults = {"gate": {"max_tokens": 16}, **sections.pop("defaults", {})}
    # Sized like the simulator's memory oracle (80 GB per device), so the router counts the
    # residual each sleeper holds there; a test may pass its own gpus, or gpus=None for none.
    devices = sorted({d for m in models for d in m.get("devices", defaults.get("devices", [0]))})
    gpus = sections.pop("gpus", [{"index": d, "memory_gb": SIM_GPU_GB} for d in devices])
    return {"swap": swap, "defaults": defaults, "models": list(models), **({"gpus": gpus} if gpus else {}), **sections}


# -- clients of a running router (the real openai SDK; closed by the component conftest) ------------

_sdk_clients: list[openai.AsyncOpenAI] = []


class SSEReader:
    """A stream read as a client's SSE parser reads it: its data events, its comment lines, its [DONE] count."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.comments: list[bytes] = []
        self.done = 0

    async def lines(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """Each line of the stream, once it has arrived whole and been recorded."""
        buffer = b""
        async for data in response.content.iter_any():
            buffer += data
            *blocks, buffer = buffer.split(b"\n\n")
            for block in blocks:
                for line in block.split(b"\n"):
                    if line.startswith(b":"):
                        self.comments.append(line)
                    elif line == b"data: [DONE]":
                        self.done += 1
                    elif line.startswith(b"data: "):
                        self.events.append(json.loads(line[6:]))
                    yield line


async def sim_fault(router: RouterProcess, name: str, step: str, kind: str, times=1) -> None:
    """Engine `name`'s simulator answers its next `times` `step`s with fault `kind` (engines/sim/control.py)."""
    port = (await router.engine(name))["port"]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/sim/faults", json={"step": step, "kind": kind, "times": times}) as r:
            assert r.status == 200


async def metric_lines(router: RouterProcess, name: str) -> str:
    """The router's /metrics lines of metric `name` (its samples, as text)."""
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        return "\n".join(line for line in (await r.text()).splitlines() if line.startswith(name))


def client(router: RouterProcess, key: str = "unused") -> openai.AsyncOpenAI:
    return _sdk(router.url + "/v1", key)


async def direct(router: RouterProcess, name: str) -> openai.AsyncOpenAI:
    return _sdk(f"http://127.0.0.1:{(await router.engine(name))['port']}/v1", "unused")


def _sdk(base_url: str, key: str) -> openai.AsyncOpenAI:
    _sdk_clients.append(openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30))
    return _sdk_clients[-1]


async def http(router: RouterProcess, method: str, path: str, **kw) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, router.url + path, **kw) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def ask(c: openai.AsyncOpenAI, model: str, prompt: str = "hello", max_tokens: int = 8) -> str:
    answer = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].text


async def close_sdk_clients() -> None:
    while _sdk_clients:
        await _sdk_clients.pop().close()


@contextlib.asynccontextmanager
async def traffic_beside(base_url: str, model: str, prompt: str, max_tokens: int, workers: int) -> AsyncIterator[list[int]]:
    """Other clients of an engine, straight to its port, back to back while the block runs (so a canary
    judged meanwhile shares the engine with them); yields the count of their answered requests."""
    answered = [0]

    async def one(s: aiohttp.ClientSession) -> None:
        while True:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            with contextlib.suppress(aiohttp.ClientError):
                async with s.post(base_url + "/v1/completions", json=body) as r:
                    await r.read()
                    answered[0] += r.status == 200

    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(one(s)) for _ in range(workers)]
        try:
            yield answered
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
