"""One managed engine process: its argv and env, its log file (written by the engine itself), start, stop.

Every engine runs under `engines.process.reaper`, which leads the engine's process group and takes
the whole group down when the router dies, SIGKILL included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from config.argv import ROUTER_OWNED_FLAGS
from config.schema import ModelSpec
from engines.process import reaper, worker_path
from engines.process.worker_path import WORKER_EXTENSION


def loads_extension(spec: ModelSpec) -> bool:
    """Whether the router composes --worker-extension-cls for this engine: when it reloads its draft,
    and when it may sleep at Level 2 from a checkpoint vLLM can reload, because then its wake stages
    that checkpoint into the page cache first (engines.waking.stage). Never for a `command:` (its argv is the
    operator's) or a `url:` engine (not started here)."""
    if not spec.managed or spec.command is not None:
        return False
    return spec.draft_restore == "reload" or (spec.sleep_level in ("auto", 2) and spec.reloads_weights)
PRESERVE_DRAFT = "draft.*"
TAIL_BYTES = 64 * 1024
CAUSE_BYTES = 1024 * 1024  # how much of a failed run's output is searched for its cause (vLLM's comes well before its last lines)
# The router waits this much longer than the reaper's grace before it SIGKILLs the group itself:
# the reaper's own SIGKILL comes first unless the reaper is stuck.
REAPER_MARGIN_S = 5.0

# The value of each router-owned flag for one engine: its arguments after the flag ([] for a bare
# flag), or None to leave it out. compose_argv walks config.argv.ROUTER_OWNED_FLAGS (the list
# `args` may not contain) and looks each flag up here, so it emits no flag outside that list, and
# a flag added there without a rule here fails every compose_argv at once.
FlagRule = Callable[[ModelSpec, int], Optional[list[str]]]
ROUTER_FLAG_VALUES: dict[str, FlagRule] = {
    "--host": lambda spec, port: ["127.0.0.1"],
    "--port": lambda spec, port: [str(port)],
    # Every alias is served too, so a request naming one passes through byte for byte.
    "--served-model-name": lambda spec, port: list(spec.names),
    "--enable-sleep-mode": lambda spec, port: [],
    "--speculative-config": lambda spec, port: (
        None if spec.speculative is None else [json.dumps(spec.speculative, separators=(",", ":"))]
    ),
    "--worker-extension-cls": lambda spec, port: [WORKER_EXTENSION] if loads_extension(spec) else None,
    "--sleep-preserve-parameter-names": lambda spec, port: [PRESERVE_DRAFT] if spec.draft_restore == "preserve" else None,
    # Each single-sequence answer then carries its own acceptance under metrics.speculative_decoding
    # (vllm/config/observability.py:50, engine/arg_utils.py:1657 in vLLM 0.32), which the gate and the
    # mid-life watch read instead of the engine-wide counters. Only with a draft: vLLM refuses the flag
    # without speculative decoding (vllm/config/vllm.py:1660).
    "--per-request-spec-decode-metrics": lambda spec, port: ["summary"] if spec.speculative is not None else None,
}


def log_file(log_dir: Path, name: str) -> Path:
    """Where engine `name` writes its output: one file per roster entry, appended to by every run."""
    return log_dir / f"{name}.log"


def session_pids(leader: int) -> set[int]:
    """`leader` and every process of the session it leads: an engine's process and everything it spawned
    (vLLM's EngineCore holds the GPU memory; an engine is started with start_new_session)."""
    pids = {leader}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if int(fields[3]) == leader:  # the session id, after state, ppid and pgrp
            pids.add(int(entry.name))
    return pids


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def compose_argv(spec: ModelSpec, port: int) -> list[str]:
    """The engine's command line: `command` as written, or launcher + what the router owns + args."""
    if spec.command is not None:
        fill = {"port": str(port), "model": spec.model or spec.name, "name": spec.name}
        return [_resolve_python(part.format(**fill)) if i == 0 else part.format(**fill) for i, part in enumerate(spec.command)]
    argv = [_resolve_python(spec.launcher[0]), *spec.launcher[1:], str(spec.model)]
    for flag in ROUTER_OWNED_FLAGS:
        try:
            rule = ROUTER_FLAG_VALUES[flag]
        except KeyError:
            raise RuntimeError(f"router-owned flag {flag} has no value rule in engines.process.engine_process.ROUTER_FLAG_VALUES") from None
        value = rule(spec, port)
        if value is not None:
            argv += [flag, *value]
    return argv + list(spec.args)


def _resolve_python(program: str) -> str:
    # Engines launched as `python -m ...` (the simulator, wrappers) run on the router's own
    # interpreter, whatever PATH says: a venv that is not activated is the common case.
    return sys.executable if program in ("python", "python3") else program


class EngineProcess:
    def __init__(self, spec: ModelSpec, port: int, log_dir: Path, *, kill_grace_s: float):
        self.spec = spec
        self.port = port
        self.kill_grace_s = kill_grace_s  # swap.kill_grace_s: SIGTERM, then SIGKILL after this long
        self.log_path = log_file(log_dir, spec.name)
        self.proc: Optional[asyncio.subprocess.Process] = None
        self._log_start = 0  # where this run's output begins in the (appended) log file

    @property
    def argv(self) -> list[str]:
        return compose_argv(self.spec, self.port)

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.spec.env}
        # Router-owned (the roster refuses it in `env`): the GPUs placement counted this engine on,
        # whatever the router's own environment says. The engine numbers them 0..n-1.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in self.spec.devices)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the sleep/wake/collective_rpc endpoints
        env["HOTSWAP_REAPER_PARENT"] = str(os.getpid())
        env.setdefault("PYTHONUNBUFFERED", "1")  # the log tail must be current when we quote it
        if self.gets_worker_path:  # the worker extension importable in vLLM's own Python (engines.process.worker_path)
            env["PYTHONPATH"] = worker_path.pythonpath(env.get("PYTHONPATH"))
        return env

    @property
    def gets_worker_path(self) -> bool:
        return worker_path.gets_path(self.argv, self.spec.command is not None)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def group_pids(self) -> set[int]:
        """The engine's process and everything it spawned (`session_pids`)."""
        return set() if self.proc is None else session_pids(self.proc.pid)

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode if self.proc else None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = reaper.command(self.kill_grace_s, self.argv)
        shown = " ".join(self.spec.masked(self.argv))  # the log file is read by more people than the roster
        header = f"=== hotswap {time.strftime('%Y-%m-%dT%H:%M:%S')}: starting {self.spec.name}: {shown}\n"
        # The engine writes its log file itself: its output never passes through the router's
        # event loop (vLLM logs a line per request), and the file outlives a router crash.
        with self.log_path.open("ab") as log:
            log.write(header.encode())
            log.flush()  # before the engine appends to the same file, or the header lands after its output
            self._log_start = log.tell()
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                env=self.env(), start_new_session=True,
            )

    async def wait(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"engine {self.spec.name}: wait() before start()")
        return await self.proc.wait()

    async def reap_briefly(self) -> None:
        """Wait a moment for the reaper's exit report: a crashed engine drops its connections a moment
        before it; an engine that only dropped a connection and lives on is not waited on longer."""
        if self.proc is not None:
            await asyncio.wait({asyncio.ensure_future(self.wait())}, timeout=reaper.REPORT_S)

    async def stop(self) -> Optional[int]:
        """Stop the engine and everything below it; returns the reaper's exit code.

        SIGTERM goes to the reaper, which SIGTERMs the engine's process group and SIGKILLs it
        after `kill_grace_s`. Should the reaper itself not be done a little after that
        (REAPER_MARGIN_S), the router SIGKILLs the group.
        """
        if self.proc is None:
            return None
        if self.proc.returncode is not None:
            # The reaper is gone (killed on its own, say) and what it led may live on, holding the GPU and the
            # router's connections to it: nothing is left to take it down but the router.
            for pid in self.group_pids() - {self.proc.pid}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return self.returncode
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            async with asyncio.timeout(self.kill_grace_s + REAPER_MARGIN_S):
                return await asyncio.shield(self.wait())
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            return await self.wait()

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def how_it_ended(self, lines: int = 8) -> str:
        """For a failure's message: its exit code and last log lines once it has exited, else nothing."""
        if self.returncode is None:
            return ""
        tail = self.last_lines(lines)
        cause = worker_path.import_failure(self._output(CAUSE_BYTES), self.argv[0], self.gets_worker_path)
        return (f" (process exited with code {self.returncode})" + (f": {cause}" if cause else "")
                + ("; last log lines:\n  " + "\n  ".join(tail) if tail else ""))

    def last_lines(self, n: int = 20) -> list[str]:
        """The last `n` lines this run of the engine wrote (read from its log file when asked)."""
        return self._output(TAIL_BYTES).splitlines()[-n:]

    def _output(self, most: int) -> str:
        """This run's output, its last `most` bytes at most (from the first whole line)."""
        try:
            with self.log_path.open("rb") as log:
                size = log.seek(0, os.SEEK_END)
                start = max(self._log_start, size - most)
                log.seek(start)
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        if start > self._log_start:
            text = text.partition("\n")[2]  # the first line read is probably cut
        return text
