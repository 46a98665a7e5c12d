"""How try-local waits and fails (trylocal.py and its scenario_*.py): its processes, its loopback
calls, and polls with deadlines that fit a busy machine.

A run shares two cores with test runs: every wait is a poll for what it waits for, with a deadline
far beyond what a loaded run takes; a wait fails at once when a process it needs has exited (the
end of that process's log says why), else at its deadline, naming the step and what it last saw.
A SIGTERM (try-local.sh's bound) is reported with the step it interrupted (`STEP`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

# A run on this 2-core machine under load 6 took a few seconds for each step; these leave ten times that.
CALL_TIMEOUT_S = 30.0  # one loopback HTTP call outside a poll
POLL_CALL_S = 5.0  # one call inside a poll (the poll tries again)
SETTLE_S = 60.0  # HAProxy's checks and agents (1 s apart), a node's idle timer, a park
POLL_EVERY_S = 0.1

STEP = {"now": "starting", "since": time.monotonic()}
WATCHED: dict[str, subprocess.Popen] = {}  # the processes every poll needs alive (trylocal sets them)
LOGS: list[Path] = []  # where their logs are (<name>.log)


class Failed(AssertionError):
    """A step of the run did not happen; the message names the step and what it last saw."""


def step(what: str) -> None:
    STEP.update(now=what, since=time.monotonic())


def poll(what: str, timeout: float, look: Callable[[], tuple[bool, str]]) -> str:
    """Call `look()` -> (done, what it saw) until done, and return that last sight. Fails (`Failed`) at
    once when a process of WATCHED has exited, else at `timeout` with the last sight."""
    step(what)
    deadline, seen = time.monotonic() + timeout, "nothing yet"
    while True:
        for name, proc in WATCHED.items():
            if proc.poll() is not None:
                raise Failed(f"{what}: {name} exited with code {proc.returncode} ({log_tail(name)})")
        try:
            done, seen = look()
            if done:
                return seen
        except Exception as exc:  # noqa: BLE001 (the thing polled may not be up yet: say what it answered)
            seen = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise Failed(f"{what}: not within {timeout:g} s; last seen: {seen}")
        time.sleep(POLL_EVERY_S)


def log_tail(name: str, lines: int = 3) -> str:
    try:
        tail = (LOGS[0] / f"{name}.log").read_text(errors="replace").strip().splitlines()[-lines:]
    except (OSError, IndexError):
        return "no log"
    return "its log ends: " + " | ".join(tail) if tail else "its log is empty"


def call(method: str, url: str, timeout: float = CALL_TIMEOUT_S) -> tuple[int, bytes]:
    """One loopback HTTP call: (status, body), an error status included."""
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get(url: str, timeout: float = CALL_TIMEOUT_S) -> tuple[int, bytes]:
    return call("GET", url, timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Each child leads its own process group; `stop_all` takes every group down (TERM, then KILL)."""

    def __init__(self, logs: Path, cwd: Path) -> None:
        self.logs, self.cwd = logs, cwd
        self.started: dict[str, subprocess.Popen] = {}
        LOGS[:] = [logs]

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            self.started[name] = subprocess.Popen(argv, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True)
        return self.started[name]

    def stop_all(self, grace_s: float = 15.0) -> None:
        for proc in self.started.values():
            signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.started.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
