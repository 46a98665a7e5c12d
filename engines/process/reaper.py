"""Run one engine command so that it cannot outlive the router.

`python -P engines/process/reaper.py --grace-s S -- ARGV...` (`command`) leads its own process group and asks Linux
for SIGTERM when its parent (the router) dies for any reason, SIGKILL included. On SIGTERM,
from the router's stop or from the parent-death signal, it stops the whole group: SIGTERM,
then SIGKILL after S seconds (the roster's `swap.kill_grace_s`; 15 when not given). vLLM runs
engine-core and worker processes below `vllm serve`; a parent-death signal on `vllm serve`
alone would orphan them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
DEFAULT_GRACE_S = 15.0  # swap.kill_grace_s's default
POLL_S = 0.05  # how often the reaper looks at its engine: it reports an exit within this
REPORT_S = 20 * POLL_S  # what a caller may wait for that report once the engine's sockets dropped
USAGE = f"usage: python -P {__file__} [--grace-s SECONDS] -- COMMAND [ARGS...]"


def command(grace_s: float, argv: list[str]) -> list[str]:
    """How the router starts a reaper: by this file, not `-m`, so that no package of ours comes with it
    (`engines.process`'s __init__ imports the roster's schema: half a second and 25 MB more in every
    reaper, for its engine's whole life). -P keeps this file's folder off sys.path: the standard library only."""
    return [sys.executable, "-P", __file__, "--grace-s", str(grace_s), "--", *argv]


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)


def parse_args(argv: list[str]) -> tuple[float, list[str]]:
    """`[--grace-s S] [--] COMMAND...` -> (grace, command); ValueError with the reason."""
    grace = DEFAULT_GRACE_S
    if argv[:1] == ["--grace-s"] or (argv and argv[0].startswith("--grace-s=")):
        text = argv[0].partition("=")[2] if "=" in argv[0] else (argv[1] if len(argv) > 1 else "")
        argv = argv[1:] if "=" in argv[0] else argv[2:]
        try:
            grace = float(text)
        except ValueError:
            raise ValueError(f"--grace-s needs a number of seconds, not {text!r}") from None
        if not grace > 0:
            raise ValueError(f"--grace-s must be > 0, not {text}")
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("no command given")
    return grace, argv


def main(argv: list[str]) -> int:
    try:
        grace_s, argv = parse_args(argv)
    except ValueError as exc:
        print(f"reaper: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    _die_with_parent(int(os.environ.get("HOTSWAP_REAPER_PARENT", os.getppid())))
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    group = os.getpgrp()
    kill_at: list[float] = []

    def stop(signum: int, frame: object) -> None:
        # Only note the deadline here: the main loop does the waiting, since Popen's wait
        # lock is held by the wait() this handler interrupted.
        if kill_at:
            return  # the killpg below signals us too
        kill_at.append(time.monotonic() + grace_s)
        os.killpg(group, signal.SIGTERM)

    # The handler is in place before the engine starts: a SIGTERM in between must not kill the
    # reaper alone and leave the engine running. (Handled, not ignored: the engine would
    # inherit an ignored SIGTERM.)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        child = subprocess.Popen(argv)  # same process group: killpg reaches everything below
    except OSError as exc:
        print(f"hotswap: cannot start engine command {argv[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127
    if kill_at:  # stopped while the engine was starting: it may have missed the group's SIGTERM
        os.killpg(group, signal.SIGTERM)
    while True:
        try:
            code = child.wait(timeout=POLL_S)
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
