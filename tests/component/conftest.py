"""Launching simulated vLLM engines (engines/sim) as real processes on loopback."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from engines.engine import Engine
from tests.support import RouterProcess, close_sdk_clients, sim_roster

REPO = Path(__file__).resolve().parents[2]


def sim_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimEngineProcess:
    """One `python -m engines.sim serve ...` process, its port and its logs."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str], logdir: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stdout_path = logdir / f"sim-{port}.out"
        self.stderr_path = logdir / f"sim-{port}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def health_status(self) -> int | None:
        """/health's status, or None while nothing listens."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError:
            return None
        finally:
            conn.close()

    def wait_healthy(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sim exited with {self.proc.returncode} before serving:\n{self.stderr()}")
            if self.health_status() == 200:
                return
            time.sleep(0.01)
        raise AssertionError(f"sim not healthy after {timeout}s:\n{self.stdout()}\n{self.stderr()}")

    def wait_exit(self, timeout: float = 5.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)


def launch_sim_engine(
    logdir: Path,
    *args: str,
    model: str = "sim-model",
    dev_mode: bool = True,
    boot_s: float = 0.0,
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> SimEngineProcess:
    port = sim_free_port()
    argv = [sys.executable, "-m", "engines.sim", "serve", model, "--port", str(port), "--sim-boot-s", str(boot_s), *args]
    # A stray VLLM_API_KEY in the developer's shell would lock the tests out of /v1.
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    full_env.update({"VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0", **(env or {})})
    sim = SimEngineProcess(argv, port, full_env, logdir)
    if wait:
        try:
            sim.wait_healthy()
        except BaseException:
            sim.stop()
            raise
    return sim


@pytest.fixture(scope="module")
def shared_sim_engine(tmp_path_factory):
    """One speculative sim (k=3, worker extension, fast decode) for tests that only read.

    Tests using it must leave it awake with a loaded target and draft."""
    sim = launch_sim_engine(
        tmp_path_factory.mktemp("shared-sim"),
        "--speculative-config", '{"num_speculative_tokens": 3, "model": "sim-draft", "method": "eagle"}',
        "--worker-extension-cls", "engines.vllm_worker.HotswapWorkerExtension",
        "--sim-token-rate", "100000",
    )  # fmt: skip
    yield sim
    sim.stop()


@pytest.fixture
def start_sim_engine(tmp_path):
    """Factory: start_sim_engine(*sim_args, model=..., dev_mode=True, wait=True). Killed at teardown."""
    started: list[SimEngineProcess] = []

    def start(*args: str, **kw) -> SimEngineProcess:
        sim = launch_sim_engine(tmp_path, *args, **kw)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


# -- a real router process with simulated engines behind it -----------------------------------------

@pytest.fixture(autouse=True)
async def close_clients():
    yield
    await close_sdk_clients()


ROUTER_LOG_TAIL = 200  # lines of each router's log a failed test's report carries


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tail of every router it started: a failure seen once in CI
    is debugged from its report, as its temp dir is gone by then."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for router in getattr(item, "hotswap_routers", ()):
            lines = router.log().splitlines()[-ROUTER_LOG_TAIL:]
            report.sections.append((f"router log {router.log_path} (last {len(lines)} lines)", "\n".join(lines)))


@pytest.fixture
async def start_router(tmp_path, request):
    routers: list[RouterProcess] = []
    request.node.hotswap_routers = routers

    async def start(roster: dict, env=None, subdir: str = "r", admin_key=None, timeout_s: float = 30,
                    booted: bool = True, port: int | None = None, args: tuple[str, ...] = ()) -> RouterProcess:
        """`booted=False`: return once the router listens, while its engines may still boot."""
        path = tmp_path / f"{subdir}{len(routers)}"
        path.mkdir()
        # The simulated engines share one GPU-memory ledger: if the router's placement is wrong,
        # an engine fails to boot or wake exactly as vLLM would, and the test sees it.
        env = {"HOTSWAP_SIM_GPU_LEDGER": str(path / "gpu-ledger.json"), **(env or {})}
        router = RouterProcess(roster, path, env, admin_key, port, args)
        routers.append(router)
        await (router.wait_ready(timeout_s) if booted else router.wait_listening(timeout_s))
        return router

    yield start
    for router in routers:
        assert router.stop() == 0, router.log()


@pytest.fixture
async def engine_factory(tmp_path: Path):
    """Factory: make(model dict) -> an Engine (not booted) over a simulated engine; stopped at teardown."""
    made: list[Engine] = []
    async with aiohttp.ClientSession() as session:

        def make(model: dict) -> Engine:
            roster = sim_roster(model)
            made.append(Engine(roster.models[0], roster.swap, session, tmp_path))
            return made[-1]

        yield make
        for engine in made:
            await engine.stop()
