"""The real router process in front of real `vllm serve` engines: a synchronous handle for tests.

Wraps `tests.support.RouterProcess` (the same `hotswap serve` process the component tier
drives) with what the integration tier reads: /admin/status, the router's /metrics, the
engines' own ports and log files, and every engine process the router ever ran, so
teardown can prove they are all gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import http, poll, progress
from tests.support import RouterProcess, pid_alive


class LiveRouter:
    @classmethod
    @contextlib.contextmanager
    def booted(cls, roster: dict[str, Any], workdir: Path, timeout: float) -> Iterator["LiveRouter"]:
        """A router with every engine booted, for a module's tests; stopped (and checked) after them."""
        live = cls(roster, workdir)
        try:
            live.wait_booted(timeout=timeout)
            yield live
        finally:
            live.stop()

    def __init__(self, roster: dict[str, Any], workdir: Path):
        self.workdir = workdir
        self.proc = RouterProcess(roster, workdir)
        self.log_dir = workdir / "engines"
        self.engine_pids: set[int] = set()  # every engine process group leader seen in /admin/status

    @property
    def url(self) -> str:
        return self.proc.url  # it may start again on another port (tests.support.RouterProcess)

    # -- lifecycle -------------------------------------------------------------------------

    def wait_booted(self, timeout: float) -> dict[str, Any]:
        """Until /ready answers 200 and every engine has booted (each one's baseline taken)."""

        def booted() -> Optional[dict[str, Any]]:
            status = self.status()
            return status if status["booted"] else None

        progress(f"router at {self.url} booting its real engines (up to {timeout:.0f} s; engine logs in {self.log_dir})")
        started = time.monotonic()
        try:
            status = poll(booted, timeout, "every group booted", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- router log ---\n{self.log_tail()}") from None
        progress(f"router booted {len(status['engines'])} engine(s) in {time.monotonic() - started:.0f} s")
        failed = [e for e in self.engines(status).values() if e["state"] == "failed"]
        assert not failed, f"engines failed at boot: {failed}\n{self.log_tail()}"
        assert http("GET", self.url + "/ready")[0] == 200
        return status

    def stop(self, timeout: float = 90) -> None:
        """SIGTERM the router; it must exit 0 and take every engine process with it."""
        try:
            self.status()  # note the current engine pids
        except Exception:  # the router may already be gone: the pids seen so far still count
            pass
        code = self.proc.stop(timeout)
        assert self.engine_pids, "no engine process was ever seen in /admin/status"
        deadline = time.monotonic() + 30
        while (left := self.live_engine_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"engine processes outlived the router: {left}"
        assert code == 0, f"router exited with {code}:\n{self.log_tail()}"

    def live_engine_processes(self) -> list[str]:
        """Processes still alive in any engine process group the router ran (leader or children)."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            state, pgid = fields[0], int(fields[2])
            if state != "Z" and (pgid in self.engine_pids or int(entry) in self.engine_pids):
                try:
                    cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:160]
                except OSError:
                    cmd = "?"
                out.append(f"{entry}: {cmd}")
        return out + [f"{p}: (leader)" for p in self.engine_pids if pid_alive(p) and not any(o.startswith(f"{p}:") for o in out)]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.proc.log().splitlines()[-n:])

    # -- what the router shows -------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        self.proc.check_alive()
        code, body = http("GET", self.url + "/admin/status", timeout=30)
        assert code == 200, (code, body)
        for engine in self.engines(body).values():
            if engine.get("pid"):
                self.engine_pids.add(engine["pid"])
        return body

    @staticmethod
    def engines(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in status["engines"]}

    def engine(self, name: str) -> dict[str, Any]:
        return self.engines(self.status())[name]

    def awake(self) -> list[str]:
        return [e["name"] for e in self.status()["engines"] if e["state"] == "awake"]

    def last_swap(self) -> Optional[dict[str, Any]]:
        return self.status()["last_swap"]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        code, text = http("GET", self.url + "/metrics", timeout=30)
        assert code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    @staticmethod
    def metric(values: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
        return values.get((name, tuple(sorted(labels.items()))), 0.0)

    # -- clients -----------------------------------------------------------------------------

    def client(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def direct(self, name: str, timeout: float = 60) -> openai.OpenAI:
        """The engine's own OpenAI endpoint (only while it is awake: an asleep vLLM hangs requests)."""
        return openai.OpenAI(base_url=self.engine_url(name) + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def engine_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.engine(name)['port']}"

    def rpc(self, name: str, method: str, timeout: float = 60, **kwargs: Any) -> list[Any]:
        """collective_rpc straight to an engine's port (the router never forwards it)."""
        code, body = http("POST", self.engine_url(name) + "/collective_rpc",
                          {"method": method, "args": [], "kwargs": kwargs}, timeout)
        assert code == 200, f"{name}: collective_rpc {method} -> {code} {body}"
        return body["results"]

    # -- engine log files (vLLM's own access log included) --------------------------------------

    def engine_log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_mark(self, name: str) -> int:
        path = self.engine_log(name)
        return path.stat().st_size if path.exists() else 0

    def log_since(self, name: str, mark: int) -> list[str]:
        with self.engine_log(name).open("rb") as f:
            f.seek(mark)
            return f.read().decode("utf-8", "replace").splitlines()
