"""What the benchmarks in bench/ share: targets, measured phases, the load generator, process
handling, /proc readers, report helpers, the run session.

The benchmarks are scripts run from the repo root (`.venv/bin/python bench/peers.py`, ...);
Python puts a script's own folder first on sys.path, so they `import harness` as a sibling
module. The load generator runs in its own process (so its CPU is not the measured proxy's), as
`harness.py loadgen JSON` (`_loadgen`'s arguments), started by `run_phase`: it warms up, prints WARM,
waits for `go` on stdin, runs the measured requests and prints one JSON line (its own CPU time,
counts, latencies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "bench"  # the roster name and the sim's served name: the router never rewrites the body
SIM_FLAGS = ["--sim-boot-s", "0", "--sim-token-rate", "100000"]
SIM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}  # what the router gives its engines
MODES = {
    # mode: (body, expected SSE data lines or None)
    "non-stream": ({"model": MODEL, "prompt": "The proxy cost of", "max_tokens": 16, "temperature": 0, "ignore_eos": True}, None),
    "stream": ({"model": MODEL, "prompt": "The proxy cost of", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}, 64),
}


# -- load generator (runs in its own process: `harness.py loadgen ...`) ----------------------------

async def _loadgen(url: str, mode: str, n: int, warmup: int, concurrency: int, max_s: float, stream_check: str,
                   timeout_s: float = 30.0) -> dict:
    import aiohttp

    body_obj, chunks = MODES[mode]
    # "exact": chunks data lines + [DONE] (a byte-for-byte pass-through); "min": at least that many, for
    # proxies that re-frame the stream (LiteLLM sends one more chunk carrying finish_reason).
    enough = (lambda n_data: n_data == chunks + 1) if stream_check == "exact" else (lambda n_data: n_data >= chunks + 1)
    body = json.dumps(body_obj).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {os.environ.get('BENCH_KEY', '')}"}
    errors: list[str] = []
    lat: list[float] = []

    async def one(session: aiohttp.ClientSession, record: bool) -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as r:
                data = await r.read()
            ok = r.status == 200 and (
                enough(data.count(b"data: ")) and data.rstrip().endswith(b"data: [DONE]") if chunks
                else b'"choices"' in data)
            if not ok:
                errors.append(f"HTTP {r.status}: {data[:200]!r}")
                return
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            errors.append(repr(exc))
            return
        if record:
            lat.append(time.perf_counter() - t0)

    async def run(session: aiohttp.ClientSession, count: int, deadline: float, record: bool) -> None:
        left = [count]

        async def worker() -> None:
            while left[0] > 0 and time.monotonic() < deadline:
                left[0] -= 1
                await one(session, record)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        await run(session, warmup, time.monotonic() + min(max_s, 5.0), record=False)  # opens every connection
        warm_errors = len(errors)
        print("WARM", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            return {"aborted": True}
        t0 = time.perf_counter()
        await run(session, n, time.monotonic() + max_s, record=True)
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "ok": len(lat), "errors": len(errors) - warm_errors, "warmup_errors": warm_errors,
            "first_errors": errors[:3], "wall_s": wall, "latencies": lat}


def loadgen_main(config: str) -> int:
    """`config`: `_loadgen`'s keyword arguments as JSON (the client's key comes in BENCH_KEY, out of `ps`)."""
    import uvloop

    print(json.dumps(uvloop.run(_loadgen(**json.loads(config)))), flush=True)
    return 0


# -- process handling ------------------------------------------------------------------------------

class Processes:
    """Every child in its own session; `close()` takes each whole group down (TERM, grace, KILL)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.extra_groups: list[int] = []  # groups our children started (the router's engine)

    def start(self, name: str, argv: list[str], log: Path, env: Optional[dict] = None, cwd: Path = REPO, **kw) -> subprocess.Popen:
        with open(log, "ab") as out:  # the child holds its own copy
            proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=kw.pop("stdout", out), stderr=out,
                                    stdin=kw.pop("stdin", subprocess.DEVNULL), start_new_session=True, **kw)
        self.procs.append((name, proc))
        return proc

    def close(self, grace_s: float = 15.0) -> None:
        for _, proc in reversed(self.procs):
            killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"bench: {name} (pid {proc.pid}) ignored SIGTERM; killing its group", file=sys.stderr)
                killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            killpg(proc.pid, signal.SIGKILL)  # anything left behind in the group
        for pgid in self.extra_groups:  # the router stops its engine itself; this is the backstop
            killpg(pgid, signal.SIGKILL)


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(method: str, url: str, body: Optional[bytes] = None, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body); an HTTP error status is an answer, a refused or broken connection raises."""
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class NotReady(SystemExit):
    """A started process exited, or did not answer OK in time; the message ends with its log tail."""


def wait_until_ok(url: str, proc: subprocess.Popen, log: Path, deadline_s: float = 60.0) -> bytes:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"bench: process behind {url} exited ({proc.returncode}); log {log}:\n{tail(log)}")
        try:
            status, body = request("GET", url)
        except (urllib.error.URLError, OSError):  # nothing listens yet
            status, body = 0, b""
        if status == 200:
            return body
        time.sleep(0.05)
    raise NotReady(f"bench: {url} not OK within {deadline_s:g} s; log {log}:\n{tail(log)}")


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def read_until(proc: subprocess.Popen, marker: bytes, timeout: float) -> None:
    """Read the load generator's stdout until `marker` (its WARM line)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"bench: the load generator did not warm up within {timeout:g} s")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise SystemExit(f"bench: the load generator exited during warmup ({proc.wait(timeout=5)})")
            buf += chunk


# -- /proc readers ---------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` (children excluded), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU time every process on the machine spent (all cores), from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / CLK_TCK  # user nice system idle iowait irq softirq steal: all but idle+iowait


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            todo += children(p)
        except (FileNotFoundError, ProcessLookupError):
            continue
        out.append(p)
    return out


def tree_cpu(pids: list[int]) -> dict[int, float]:
    """cpu_seconds of each pid still alive."""
    out = {}
    for p in pids:
        try:
            out[p] = cpu_seconds(p)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def rss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1024


def ncpu() -> int:
    return len(os.sched_getaffinity(0))


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def cpu_model() -> str:
    found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)  # Linux only, as /proc/stat
    return found.group(1).strip() if found else platform.processor() or "unknown CPU"


def wait_quiet(max_wait_s: float, threshold_pct: float = 15.0, window_s: float = 5.0) -> float:
    """Wait (at most max_wait_s) until two consecutive windows of the machine's CPU are below threshold_pct busy.

    The machine is shared with other sessions' test runs; starting while it is quiet makes the
    numbers comparable. Returns the last window's busy share (%), whether or not it got quiet (the report
    prints the load average, and each phase the other processes' share).
    """
    deadline, quiet_windows = time.monotonic() + max_wait_s, 0
    while True:
        b0, t0 = machine_busy_seconds(), time.monotonic()
        time.sleep(window_s)  # measuring a window of the machine's load, not waiting for a condition
        busy_pct = (machine_busy_seconds() - b0) / ((time.monotonic() - t0) * ncpu()) * 100
        quiet_windows = quiet_windows + 1 if busy_pct < threshold_pct else 0
        if quiet_windows >= 2 or time.monotonic() >= deadline:
            return busy_pct
        print(f"bench: machine {busy_pct:.0f}% busy (other sessions?); waiting for < {threshold_pct:g}%", file=sys.stderr, flush=True)


# -- targets: what a phase sends its load to -------------------------------------------------------

@dataclass
class Target:
    name: str
    url: str
    proxy_pid: Optional[int]  # the proxy's process; None for direct
    upstream_pid: int  # the engine behind it, whose CPU is reported as upstream
    key: str = ""  # sent as the client's bearer token
    stream_check: str = "exact"  # the load generator's --stream-check
    note: str = ""

    def pids(self) -> list[int]:
        """The proxy's whole process tree (nginx's workers, LiteLLM's forks); the upstream is never in it."""
        return tree(self.proxy_pid) if self.proxy_pid else []


def start_sim(procs: Processes, tmp: Path) -> tuple[int, int]:
    """The upstream the bench starts itself, with the argv the router composes for its own sims: (port, pid)."""
    port = free_port()
    log = tmp / "sim.log"
    sim = procs.start("sim", [sys.executable, "-m", "engines.sim", "serve", f"{MODEL}/sim", "--host", "127.0.0.1", "--port", str(port),
                              "--served-model-name", MODEL, "--enable-sleep-mode", *SIM_FLAGS], log, env=SIM_ENV)
    wait_until_ok(f"http://127.0.0.1:{port}/health", sim, log)
    return port, sim.pid


def start_bare(procs: Processes, tmp: Path, upstream_port: int, upstream_pid: int) -> Target:
    """bench/bare_proxy.py in front of the upstream: the floor for an aiohttp+uvloop proxy."""
    port = free_port()
    log = tmp / "bare_proxy.log"
    proc = procs.start("bare", [sys.executable, str(REPO / "bench" / "bare_proxy.py"), "--upstream", f"http://127.0.0.1:{upstream_port}",
                                "--port", str(port)], log)
    wait_until_ok(f"http://127.0.0.1:{port}/health", proc, log, deadline_s=90)
    return Target("bare", f"http://127.0.0.1:{port}", proc.pid, upstream_pid, note="bench/bare_proxy.py")


def start_router(procs: Processes, tmp: Path, name: str, port: int, roster: str, env: Optional[dict] = None,
                 src: Path = REPO) -> tuple[subprocess.Popen, Path]:
    """`python -m router.cli serve` from `src` on `roster` (YAML text), once it is healthy and ready: (process, log)."""
    path = tmp / f"roster-{name}.yaml"
    path.write_text(roster)
    log = tmp / f"{name}.log"
    proc = procs.start(name, [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", str(port),
                              "--log-dir", str(tmp / "engines")], log, env=env, cwd=src)
    wait_until_ok(f"http://127.0.0.1:{port}/health", proc, log, deadline_s=90)
    wait_until_ok(f"http://127.0.0.1:{port}/ready", proc, log, deadline_s=120)
    return proc, log


# -- one measured phase: one target, one mode, one repetition --------------------------------------

@dataclass
class Phase:
    target: str
    mode: str
    rep: int
    ok: int
    errors: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    proxy_us: Optional[float]  # None for direct
    upstream_us: float
    rss_mb: Optional[float]  # the proxy's, after the phase
    procs: int  # processes measured as the proxy
    other_pct: float  # share of the machine's CPU that processes outside the bench took during the phase
    first_errors: list[str] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_phase(procs: Processes, t: Target, mode: str, rep: int, args: argparse.Namespace, tmp: Path) -> Phase:
    """Start the load generator, let it warm up, then read CPU around its measured window."""
    n = args.requests if mode == "non-stream" else args.stream_requests
    config = {"url": t.url + "/v1/completions", "mode": mode, "n": n, "warmup": max(2 * args.concurrency, n // 10),
              "concurrency": args.concurrency, "max_s": args.max_seconds, "stream_check": t.stream_check}
    argv = [sys.executable, str(Path(__file__).resolve()), "loadgen", json.dumps(config)]
    log = tmp / f"loadgen-{rep}-{t.name}-{mode}.log"
    gen = procs.start(f"loadgen {t.name} {mode}", argv, log, env={"BENCH_KEY": t.key}, stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        read_until(gen, b"WARM\n", args.max_seconds + 30)
        pids = t.pids()
        gen0 = cpu_seconds(gen.pid)
        proxy0 = tree_cpu(pids)
        up0 = cpu_seconds(t.upstream_pid)
        busy0, wall0 = machine_busy_seconds(), time.monotonic()
        out, _ = gen.communicate(b"go\n", timeout=args.max_seconds + 60)
        busy1, wall1 = machine_busy_seconds(), time.monotonic()
        pids_after = t.pids()
        proxy1 = tree_cpu(pids_after)
        up1 = cpu_seconds(t.upstream_pid)
        rss = rss_mb(pids_after) if t.proxy_pid else None
    finally:
        if gen.poll() is None:
            killpg(gen.pid, signal.SIGKILL)
            gen.wait(timeout=5)
    try:
        res = json.loads(out.decode().strip().splitlines()[-1])
        res["ok"]
    except (ValueError, IndexError, KeyError):
        raise SystemExit(f"bench: the load generator gave no result (exit {gen.returncode}); log {log}:\n{tail(log)}") from None
    ok = res["ok"]
    # A process that appeared during the phase started from 0; one that vanished took its CPU with it (rare: noted as procs).
    proxy_s = sum(proxy1[p] - proxy0.get(p, 0.0) for p in proxy1) if t.proxy_pid else 0.0
    ours = proxy_s + (up1 - up0) + (res["cpu_s"] - gen0)
    other = max(0.0, (busy1 - busy0) - ours) / ((wall1 - wall0) * ncpu()) * 100
    lat = res["latencies"]
    ph = Phase(t.name, mode, rep, ok, res["errors"] + res["warmup_errors"], res["wall_s"],
               percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3,
               proxy_s * 1e6 / ok if t.proxy_pid and ok else None, (up1 - up0) * 1e6 / ok if ok else float("nan"),
               rss, len(pids_after), other, res["first_errors"])
    proxy = f"{ph.proxy_us:7.0f}" if ph.proxy_us is not None else "      -"
    print(f"  rep {rep} {t.name:11s} {mode:10s} {ok:5d} ok {ph.errors:3d} err {ph.rps:6.0f} rps  p50 {ph.p50_ms:6.1f} ms  "
          f"p99 {ph.p99_ms:6.1f} ms  proxy {proxy} us/req  upstream {ph.upstream_us:5.0f} us/req  "
          f"rss {ph.rss_mb or 0:5.0f} MB  other procs {ph.other_pct:3.0f}% CPU", flush=True)
    for e in ph.first_errors:
        print(f"    error: {e}", flush=True)
    return ph


def idle_cpu(targets: list[Target], seconds: float) -> dict[str, float]:
    """Each proxy's CPU while nothing is sent, in ms/s: a background cost would skew per-request numbers."""
    pids = {t.name: t.pids() for t in targets if t.proxy_pid}
    before = {n: sum(tree_cpu(p).values()) for n, p in pids.items()}
    time.sleep(seconds)  # measuring an idle interval, not waiting for anything
    return {n: (sum(tree_cpu(p).values()) - before[n]) * 1e3 / seconds for n, p in pids.items()}


# -- report helpers --------------------------------------------------------------------------------

def host(started: str) -> str:
    """The start of a report's first line: when, where, on what."""
    return (f"Run {started} on {platform.node() or 'this machine'}: `nproc` = {ncpu()} ({cpu_model()}), "
            f"Linux {platform.release()}, Python {platform.python_version()}")


def client_versions() -> str:
    import aiohttp
    import uvloop

    return f"aiohttp {aiohttp.__version__}, uvloop {uvloop.__version__}"


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "router", "engines", "config"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return f"{rev}{' (router/engines/config modified)' if dirty else ''}"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def command_line() -> str:
    """How this run was started, repo-relative where possible, for the report."""
    def short(path: str) -> str:
        path = os.path.abspath(path)  # not resolved: the venv's python is a link out of the repo
        return os.path.relpath(path, REPO) if Path(path).is_relative_to(REPO) else path

    return shlex.join([short(sys.executable), short(sys.argv[0]), *sys.argv[1:]])


def write_docs(path: Path, section: str, heading: str) -> None:
    """Replace the section that starts with `heading` (up to the next `## `), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nSide-by-side numbers from `bench/`. Each section says how it was produced.\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda m: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


# -- arguments and the run session -----------------------------------------------------------------

def add_load_args(p: argparse.ArgumentParser, reps: int, reps_help: str = "interleaved repetitions") -> None:
    """The load every phase sends, for benches that run the load generator."""
    p.add_argument("--requests", type=int, default=5000, help="non-stream requests per phase (default %(default)s)")
    p.add_argument("--stream-requests", type=int, default=1200, help="64-chunk streams per phase (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent connections (default %(default)s)")
    p.add_argument("--reps", type=int, default=reps, help=f"{reps_help} (default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=10.0, help="cap on each measured phase (default %(default)s)")
    p.add_argument("--idle-seconds", type=float, default=2.0, help="idle CPU measurement (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset (default %(default)s)")
    p.add_argument("--router-src", type=Path, default=REPO, metavar="DIR",
                   help="run hotswap from this source tree, e.g. a patched copy to A/B a fix (default: this repo)")


def add_docs_args(p: argparse.ArgumentParser, docs: Path = REPO / "docs" / "benchmarks.md") -> None:
    """Where the report goes, and --smoke: every bench has these."""
    p.add_argument("--docs", type=Path, default=None, help=f"where to write the section (default {docs}; with --smoke, nowhere)")
    p.add_argument("--no-docs", action="store_true", help="print only")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, a few seconds: that the script still runs end to end (tests/component/test_bench_smoke.py)")
    p.set_defaults(default_docs=docs)


def parse(p: argparse.ArgumentParser, argv: list[str], smoke: dict) -> argparse.Namespace:
    """The arguments; with --smoke, `smoke` holds the defaults (a flag given still wins), so a smoke run takes
    the script's own code path at a size tests can afford. A smoke run writes docs only to an explicit --docs:
    a test must never rewrite the real ones."""
    a = p.parse_args(argv)
    if a.smoke:
        p.set_defaults(**smoke)
        a = p.parse_args(argv)
    if a.docs is None:
        a.docs, a.no_docs = a.default_docs, a.no_docs or a.smoke
    return a


def add_session_args(p: argparse.ArgumentParser) -> None:
    """How a run starts and what it leaves: every bench that starts processes has these."""
    add_docs_args(p)
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with every process's log")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for the machine to be < 15%% busy (default: do not wait)")


@dataclass
class Session:
    """What every bench run shares: its arguments, a temp dir for logs, the processes it owns, when it started."""

    args: argparse.Namespace
    tmp: Path
    procs: Processes
    started: str
    load_start: str
    t0: float

    def publish(self, text: str, heading: str) -> None:
        print()
        print(text)
        if not self.args.no_docs:
            write_docs(self.args.docs, text, heading)
            print(f"bench: wrote {self.args.docs}")


@contextlib.contextmanager
def session(args: argparse.Namespace, prefix: str) -> Iterator[Session]:
    """Wait for a quiet machine (--wait-quiet); Ctrl-C and SIGTERM stop every process the run started.

    An interruption is reported and swallowed: the caller's code after the `with` returns 130.
    """
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet)

    def terminate(signum, frame):  # SIGTERM takes the same path as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    run = Session(args, Path(tempfile.mkdtemp(prefix=prefix)), Processes(),
                  datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), loadavg(), time.monotonic())
    try:
        yield run
    except KeyboardInterrupt:
        print("bench: interrupted; stopping everything", file=sys.stderr)
    finally:
        run.procs.close()
        if args.keep_logs:
            print(f"bench: logs kept in {run.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(run.tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "loadgen":
        sys.exit("usage: harness.py loadgen JSON (started by run_phase for bench/peers.py)")
    sys.exit(loadgen_main(sys.argv[2]))
