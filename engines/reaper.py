"""Run one engine command so that it cannot outlive the router.

`python -m engines.reaper -- ARGV...` leads its own process group and asks Linux for SIGTERM
when its parent (the router) dies for any reason, SIGKILL included. On SIGTERM, from the
router's stop or from the parent-death signal, it stops the whole group: SIGTERM, a grace
period, then SIGKILL. vLLM runs engine-core and worker processes below `vllm serve`; a
parent-death signal on `vllm serve` alone would orphan them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = float(os.environ.get("HOTSWAP_REAPER_GRACE_S", "10"))


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m engines.reaper -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    _die_with_parent(int(os.environ.get("HOTSWAP_REAPER_PARENT", os.getppid())))
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    try:
        child = subprocess.Popen(argv)  # same process group: killpg reaches everything below
    except OSError as exc:
        print(f"hotswap: cannot start engine command {argv[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127
    group = os.getpgrp()
    kill_at: list[float] = []

    def stop(signum: int, frame: object) -> None:
        # Only note the deadline here: the main loop does the waiting, since Popen's wait
        # lock is held by the wait() this handler interrupted.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # killpg below signals us too
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        kill_at.append(time.monotonic() + GRACE_S)
        os.killpg(group, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            code = child.wait(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            if kill_at and time.monotonic() > kill_at[0]:
                os.killpg(group, signal.SIGKILL)  # ends us too: what remains of the group must go
    _kill_rest_of_group(group)  # the engine has exited: take what it left behind with it
    return code if code >= 0 else 128 - code  # a shell's way to report death by signal


def _kill_rest_of_group(group: int) -> None:
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.getpgid(int(entry)) == group:
                os.kill(int(entry), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
