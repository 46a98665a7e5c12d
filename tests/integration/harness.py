"""Helpers for the integration tier: HTTP to a real engine, its metrics, the engine process.

Runs in the router's venv (stdlib + prometheus_client); vLLM runs in its own venv, started
through `cpu_launcher`, with the router's worker-extension folder on its PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

from prometheus_client.parser import text_string_to_metric_families

from engines.process import worker_path
from tests.support import until as poll  # the shared polling loop, with a deadline

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "cpu_launcher"
EXTENSION = "engines.vllm_worker.HotswapWorkerExtension"
BOOT_TIMEOUT_S = float(os.environ.get("HOTSWAP_VLLM_BOOT_TIMEOUT_S", "420"))

# Measurements the tests record; conftest prints them at the end of the run and keeps
# them as JSON beside the engine log, so docs/vllm-cpu.md can quote real numbers.
REPORT: dict[str, Any] = {}

# A single test of this tier runs for minutes (building models, booting engines, wake cycles);
# without a word on the terminal it looks hung. conftest's pytest_configure attaches pytest's
# config, and progress() writes through its terminal reporter past output capture (no -s needed).
_pytest_config: Any = None
_started: Optional[float] = None  # the tier's first progress line: its clock counts from there


def attach_progress(config: Any) -> None:
    global _pytest_config
    _pytest_config = config


def progress(message: str) -> None:
    """`[vllm tier 3m12s] message` on the terminal now, whatever pytest captures; the time is since the
    tier's first line, not since pytest started (the faster tiers run before it)."""
    global _started
    now = time.monotonic()
    _started = now if _started is None else _started
    line = f"[vllm tier {_clock(now - _started)}] {message}"
    plugins = _pytest_config.pluginmanager if _pytest_config is not None else None
    reporter = plugins.get_plugin("terminalreporter") if plugins is not None else None
    capture = plugins.get_plugin("capturemanager") if plugins is not None else None
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        # On an xdist worker the terminal is the controller's: a worker's stderr reaches it, its reporter does not.
        if reporter is None or hasattr(_pytest_config, "workerinput"):
            print(line, file=sys.stderr, flush=True)
            return
        reporter.ensure_newline()
        reporter.write_line(line)
        reporter.flush()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s"


# --- HTTP and metrics helpers ----------------------------------------------------------


def http(method: str, url: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON or text); HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


def spec_counters(base_url: str) -> dict[str, float]:
    """Current spec-decode counters, summed over label sets."""
    _, text = http("GET", base_url + "/metrics", timeout=30)
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]] += sample.value
    return out


def metric_samples(base_url: str, name: str) -> dict[str, float]:
    _, text = http("GET", base_url + "/metrics", timeout=30)
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[json.dumps(sample.labels, sort_keys=True)] = sample.value
    return out


# --- a real engine -----------------------------------------------------------------------


class VllmServer:
    """One `vllm serve` started through cpu_launcher in its own process group."""

    def __init__(self, name: str, model: Path, args: list[str], env: dict[str, str], log_dir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.name = name
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.argv = [
            str(LAUNCHER), str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", name, "--enable-sleep-mode",  # the launcher must drop it
            *args,
        ]
        self.env = {**os.environ, **env, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
        # The worker extension importable in the vLLM venv as the router makes it (cpu_launcher adds nothing).
        self.env["PYTHONPATH"] = worker_path.pythonpath(self.env.get("PYTHONPATH"))
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.boot_s = 0.0

    def start(self) -> "VllmServer":
        self._log = self.log_path.open("wb")
        started = time.monotonic()
        progress(f"booting {self.name} (vllm serve on CPU; its log: {self.log_path})")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = started + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._kill_group()  # children that outlived the launcher's process
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} while booting:\n{self.tail()}")
            try:
                status, _ = http("GET", self.url + "/health", timeout=5)
                if status == 200 and http("GET", self.url + "/v1/models", timeout=5)[0] == 200:
                    self.boot_s = time.monotonic() - started
                    progress(f"{self.name} serving after {self.boot_s:.0f} s")
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise AssertionError(f"{self.name} not healthy within {BOOT_TIMEOUT_S} s:\n{self.tail()}")

    def stop(self, grace_s: float = 30) -> float:
        """SIGTERM the whole group, SIGKILL after `grace_s`; returns the seconds it took."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        finally:
            self._kill_group()  # stragglers (engine core, workers) that outlived the leader
            self._log.close()
        return time.monotonic() - started

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # -- the engine's API --

    def rpc(self, method: str, *args: str, timeout: float = 120, **kwargs: Any) -> tuple[list[Any], float]:
        """POST /collective_rpc; returns (results, seconds)."""
        started = time.monotonic()
        status, body = http("POST", self.url + "/collective_rpc", {"method": method, "args": list(args), "kwargs": kwargs}, timeout)
        seconds = time.monotonic() - started
        assert status == 200, f"collective_rpc {method} -> {status} {body}\n{self.tail()}"
        return body["results"], seconds

    def complete(self, prompt: str, max_tokens: int = 32, timeout: float = 120) -> dict[str, Any]:
        status, body = http(
            "POST", self.url + "/v1/completions",
            {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True, "return_token_ids": True},
            timeout,
        )
        assert status == 200, f"completion -> {status} {body}"
        return body

    def canary(self, prompt: str, max_tokens: int = 32) -> tuple[float, dict[str, Any]]:
        """Mean acceptance length of one greedy completion, from counter deltas, and the completion.

        The counters can lag the response: poll until they account for every decoded
        token. Each decode step that drafts yields 1 + accepted tokens, so after
        `max_tokens` tokens d(drafts) + d(accepted) >= max_tokens - 1 (more when the last
        step's accepted drafts overshoot and are cut off).
        """
        before = spec_counters(self.url)
        body = self.complete(prompt, max_tokens)

        def moved() -> Optional[dict[str, float]]:
            now = spec_counters(self.url)
            d = {k: now[k] - before[k] for k in now}
            return d if d["drafts"] + d["accepted"] >= max_tokens - 1 else None

        d = poll(moved, 30, f"spec-decode counters of {self.name} to account for {max_tokens} tokens")
        return 1 + d["accepted"] / d["drafts"], body


class Background:
    """A call running on a thread, so a test can watch it hang and then finish."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()
