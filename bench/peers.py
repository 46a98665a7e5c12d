"""Peer proxies (issues 8, 14): hotswap side by side with nginx, a bare aiohttp proxy, vllm-router and LiteLLM.

    .venv/bin/python bench/peers.py [--requests N] [--stream-requests N] [--concurrency C] [--reps R] [--peers LIST]

One run, one upstream: a single `engines.sim` (no boot delay, 100k tokens/s, so the upstream
is as cheap as it gets) that every target forwards to:

  direct      clients -> sim
  nginx       clients -> nginx (Debian's package; own process, generated config, proxy_buffering off,
              HTTP/1.1 keep-alive upstream pool, access log off, one worker) -> sim
  bare        clients -> bench/bare_proxy.py (aiohttp + uvloop, nothing else) -> sim
  vllm-router clients -> vllm-router (PyPI `vllm-router`, Rust; the sim as its single worker) -> sim
  litellm     clients -> LiteLLM proxy (PyPI `litellm[proxy]`; one `openai/` model with api_base = the sim) -> sim
  hotswap     clients -> `python -m router.cli serve` (client API keys on; the sim attached by `url:`) -> sim
  hotswap-no-activity, hotswap-activity-file   hotswap with the activity log off (`activity.ring: 0`),
              and with it also written to an SQLite file (`activity.path`); opt-in, to price the log
              beside `hotswap` (its default: the in-memory ring) in one run

The Python peers live in their own venvs under ~/.cache/hotswap/bench-venvs/ (created on first run
with pip, unless --no-install); nginx is Debian's package, which the operator installs. A peer that
cannot be installed or started is reported with its error text and the rest still run.

The load generator is bench/harness.py's (a separate aiohttp process, C keep-alive connections,
a fixed count bounded by a deadline). For each target and mode (non-stream `/v1/completions`
max_tokens 16; a 64-chunk stream) CPU is utime+stime from /proc of the proxy's whole process tree
(nginx master + worker, LiteLLM's uvicorn and anything it forks; the upstream sim is never part of
it), summed around the measured window; RSS is the tree's VmRSS sum after each phase. A mode's phases
run back to back, the targets in reverse order every other rep, `--reps` times, so the spread between
repetitions shows the noise. Everything is on loopback, every phase is capped in time, and every
process started here is stopped on exit, Ctrl-C or SIGTERM.

This is a benchmark, not a test: it asserts nothing except that every request succeeded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import harness as h  # bench/harness.py: targets, phases, load generator, processes, /proc, report helpers
from harness import MODEL, MODES, REPO, SIM_FLAGS

SECTION = "## Peer proxies: the last generated run"
VENVS = Path(os.environ.get("HOTSWAP_BENCH_VENVS", Path.home() / ".cache" / "hotswap" / "bench-venvs"))
PIP_PEERS = {  # peer -> (venv dir, pip requirement, console script)
    "vllm-router": ("vllm-router", "vllm-router", "vllm-router"),
    "litellm": ("litellm", "litellm[proxy]", "litellm"),
}
ALL_TARGETS = ["direct", "nginx", "bare", "vllm-router", "litellm", "hotswap", "hotswap-ab", "hotswap-no-activity",
               "hotswap-activity-file"]
# Opt-in: `hotswap-ab` (hotswap from --ab-src, to A/B a router patch) and the activity log's two prices (issue 25).
DEFAULT_TARGETS = ALL_TARGETS[:-3]
ACTIVITY_TARGETS = {"hotswap-no-activity": "activity: {{ring: 0}}\n",  # the roster's section, {tmp}: the run's temp dir
                    "hotswap-activity-file": "activity: {{path: {tmp}/activity.db}}\n"}
# issue 14's targets (issue 8's were 1.0, 1.5 and 1.2)
TARGET_STREAM_VS_VLLM_ROUTER = 0.9
TARGET_STREAM_VS_NGINX = 1.25
TARGET_NONSTREAM_VS_BARE = 0.9


# -- peers: install and start ----------------------------------------------------------------------

class PeerUnavailable(Exception):
    """A peer could not be installed or started; the message is what the report says."""


def _short(text: str, n: int = 15) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip() and "is ignored: it is neither a file" not in l]
    return "\n".join(lines[-n:])


def ensure_venv(peer: str, install: bool, log: Path) -> Path:
    venv, requirement, script = PIP_PEERS[peer]
    exe = VENVS / venv / "bin" / script
    if exe.exists():
        return exe
    if not install:
        raise PeerUnavailable(f"{exe} does not exist (run without --no-install to create it with pip)")
    print(f"bench: installing {requirement} into {VENVS / venv} (once)", flush=True)
    VENVS.mkdir(parents=True, exist_ok=True)
    for argv in ([sys.executable, "-m", "venv", str(VENVS / venv)],
                 [str(VENVS / venv / "bin" / "pip"), "install", "-q", requirement]):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"`{' '.join(argv)}` did not finish within 900 s") from None
        with open(log, "a") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            shutil.rmtree(VENVS / venv, ignore_errors=True)  # a half-made venv would look installed next time
            raise PeerUnavailable(f"`{' '.join(argv)}` exited {r.returncode}:\n{_short(r.stderr or r.stdout)}")
    if not exe.exists():
        raise PeerUnavailable(f"`pip install {requirement}` succeeded but installed no {script} script")
    return exe


def peer_version(peer: str) -> str:
    venv, requirement, _ = PIP_PEERS[peer]
    dist = requirement.split("[")[0]
    r = subprocess.run([str(VENVS / venv / "bin" / "python"), "-c",
                        f"import importlib.metadata as m; print(m.version({dist!r}))"], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or "?"


def ensure_nginx() -> str:
    """Debian's nginx, installed by the operator: a system package is the host's, not the bench's to install
    (the Python peers' venvs under VENVS are the bench's own)."""
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if not exe:
        raise PeerUnavailable("nginx is not installed: run `apt-get install -y nginx` (its system service is not used)")
    return exe


def nginx_version(exe: str) -> str:
    r = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=10)
    return (r.stderr or r.stdout).strip().split("/")[-1]


NGINX_CONF = """# written by bench/peers.py
daemon off;
master_process on;
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    upstream sim {{
        server 127.0.0.1:{upstream};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(procs: h.Processes, tmp: Path, upstream: int, versions: dict) -> h.Target:
    exe = ensure_nginx()
    versions["nginx"] = nginx_version(exe)
    d = tmp / "nginx"
    for sub in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (d / sub).mkdir(exist_ok=True)
    port = h.free_port()
    conf = d / "nginx.conf"
    # As root, nginx's workers would switch to `nobody`, who cannot enter our 0700 temp dir.
    conf.write_text(NGINX_CONF.format(dir=d, upstream=upstream, port=port, user="user root;" if os.geteuid() == 0 else ""))
    r = subprocess.run([exe, "-t", "-p", str(d), "-c", str(conf)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise PeerUnavailable(f"`nginx -t` rejected the generated config:\n{_short(r.stderr)}")
    log = tmp / "nginx.log"
    proc = procs.start("nginx", [exe, "-p", str(d), "-c", str(conf)], log)
    # nginx has no /health of its own here: any answer from the sim through it will do.
    h.wait_until_ok(f"http://127.0.0.1:{port}/health", proc, log, deadline_s=90)
    return h.Target("nginx", f"http://127.0.0.1:{port}", proc.pid, 0,
                    note="worker_processes 1, proxy_buffering off, proxy_request_buffering off, proxy_http_version 1.1, "
                         "upstream keepalive 128, access_log off")


def start_vllm_router(procs: h.Processes, tmp: Path, upstream: int, install: bool, versions: dict) -> h.Target:
    exe = ensure_venv("vllm-router", install, tmp / "install-vllm-router.log")
    versions["vllm-router"] = peer_version("vllm-router")
    port = h.free_port()
    log = tmp / "vllm-router.log"
    # Per-request logging off (as for every other target); retries and policies left at their defaults
    # apart from round_robin (one worker: the default cache_aware would only add a prefix-tree walk).
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"http://127.0.0.1:{upstream}",
            "--policy", "round_robin", "--log-level", "warning", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(h.free_port())]
    proc = procs.start("vllm-router", argv, log)
    h.wait_until_ok(f"http://127.0.0.1:{port}/health", proc, log, deadline_s=90)
    return h.Target("vllm-router", f"http://127.0.0.1:{port}", proc.pid, 0,
                    note="--policy round_robin --log-level warning, Prometheus exporter on (its default)")


def start_litellm(procs: h.Processes, tmp: Path, upstream: int, install: bool, versions: dict) -> h.Target:
    exe = ensure_venv("litellm", install, tmp / "install-litellm.log")
    versions["litellm"] = peer_version("litellm")
    port = h.free_port()
    conf = tmp / "litellm.yaml"
    conf.write_text(
        "# written by bench/peers.py\n"
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{upstream}/v1\n"
        "      api_key: unused\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
        "general_settings:\n"
        "  disable_spend_logs: true\n")
    key = "sk-bench-" + os.urandom(12).hex()
    log = tmp / "litellm.log"
    env = {"LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
           "PYTHONUNBUFFERED": "1"}
    proc = procs.start("litellm", [str(exe), "--config", str(conf), "--host", "127.0.0.1", "--port", str(port)], log, env=env)
    h.wait_until_ok(f"http://127.0.0.1:{port}/health/liveliness", proc, log, deadline_s=180)
    return h.Target("litellm", f"http://127.0.0.1:{port}", proc.pid, 0, key=key, stream_check="min",
                    note="one uvicorn worker (its default), master key on (it refuses to start without one), "
                         "LITELLM_LOG=ERROR, spend logs off, no database; re-frames streams (65 data chunks for 64 tokens)")


def start_hotswap(procs: h.Processes, tmp: Path, upstream: int, key: str, src: Path = REPO, name: str = "hotswap") -> h.Target:
    port = h.free_port()
    roster = (
        "# written by bench/peers.py\n"
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "auth:\n"
        '  api_keys: ["${BENCH_KEY}"]\n'
        + ACTIVITY_TARGETS.get(name, "").format(tmp=tmp) +
        "models:\n"
        f"  - name: {MODEL}\n"
        f"    url: http://127.0.0.1:{upstream}\n")
    proc, _ = h.start_router(procs, tmp, name, port, roster, env={"BENCH_KEY": key}, src=src)
    note = "client API key auth on, Prometheus metrics on, the sim attached with `url:` (the same upstream)"
    if name in ACTIVITY_TARGETS:
        note += f"; {ACTIVITY_TARGETS[name].format(tmp='TMP').strip()}"
    return h.Target(name, f"http://127.0.0.1:{port}", proc.pid, 0, key=key, note=note if src == REPO else f"{note}; run from {src}")


# -- report ----------------------------------------------------------------------------------------

def report(phases: list[h.Phase], targets: list[h.Target], unavailable: dict[str, str], idle: dict[str, float], versions: dict[str, str],
           args: argparse.Namespace, command: str, started: str, elapsed: float, load_start: str) -> str:
    by = {(p.target, p.mode, p.rep): p for p in phases}
    reps = sorted({p.rep for p in phases})
    names = [t.name for t in targets]
    modes = [m for m in MODES if any(p.mode == m for p in phases)]
    rows = ["| target | mode | rep | requests | errors | rps | p50 ms | p99 ms | proxy CPU µs/req | upstream CPU µs/req "
            "| proxy RSS MB | other procs' CPU |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in modes:
        for rep in reps:
            for name in names:
                p = by.get((name, mode, rep))
                if p is None:
                    continue
                proxy = f"{p.proxy_us:.0f}" if p.proxy_us is not None else "- (none)"
                rss = f"{p.rss_mb:.0f}" + (f" ({p.procs} procs)" if p.procs > 1 else "") if p.rss_mb is not None else "-"
                rows.append(f"| {name} | {mode} | {rep} | {p.ok} | {p.errors} | {p.rps:.0f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} | {proxy} "
                            f"| {p.upstream_us:.0f} | {rss} | {p.other_pct:.0f}% |")

    def proxy_us(name: str, mode: str) -> list[Optional[float]]:
        return [by[(name, mode, r)].proxy_us if (name, mode, r) in by else None for r in reps]

    def ratio(a: str, b: str, mode: str) -> tuple[Optional[float], list[float]]:
        """Median over reps of a's CPU/req ÷ b's, each rep's pair measured minutes apart under the same background."""
        per = [x / y for x, y in zip(proxy_us(a, mode), proxy_us(b, mode)) if x and y]
        return (statistics.median(per) if per else None), per

    summary = ["| mode | " + " | ".join(f"{n} µs/req" for n in names if n != "direct") + " | hotswap ÷ each (median of per-rep ratios) |",
               "|---|" + "---:|" * (len([n for n in names if n != "direct"])) + "---|"]
    for mode in modes:
        cells = []
        for n in names:
            if n == "direct":
                continue
            xs = [x for x in proxy_us(n, mode) if x is not None]
            cells.append(f"{statistics.fmean(xs):.0f} ({' / '.join(f'{x:.0f}' for x in xs)})" if xs else "-")
        rats = []
        for n in names:
            if n in ("direct", "hotswap"):
                continue
            r, per = ratio("hotswap", n, mode)
            if r is not None:
                rats.append(f"{n} {r:.2f}×")
        summary.append(f"| {mode} | " + " | ".join(cells) + f" | {', '.join(rats)} |")

    lat = ["", "| mode | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for mode in modes:
        cells = []
        for n in names:
            ps = [by[(n, mode, r)] for r in reps if (n, mode, r) in by]
            cells.append(f"{statistics.fmean([p.rps for p in ps]):.0f} rps, p50 {statistics.fmean([p.p50_ms for p in ps]):.1f} / "
                         f"p99 {statistics.fmean([p.p99_ms for p in ps]):.1f} ms" if ps else "-")
        lat.append(f"| {mode} | " + " | ".join(cells) + " |")
    rss = ["", "| | " + " | ".join(n for n in names if n != "direct") + " |", "|---|" + "---:|" * len([n for n in names if n != "direct"])]
    rss.append("| RSS after the run, MB | " + " | ".join(
        (f"{max(p.rss_mb for p in phases if p.target == n and p.rss_mb is not None):.0f}"
         if any(p.target == n and p.rss_mb is not None for p in phases) else "-") for n in names if n != "direct") + " |")
    rss.append("| idle CPU, ms/s | " + " | ".join(f"{idle[n]:.1f}" if n in idle else "-" for n in names if n != "direct") + " |")

    verdict = []

    def check(label: str, a: str, b: str, mode: str, limit: float) -> None:
        r, per = ratio(a, b, mode)
        if r is None:
            why = "unavailable" if b in unavailable else "not run" if b not in names else "no CPU per request measured: too short a run"
            verdict.append(f"- {label}: not measured ({b}: {why}).")
            return
        verdict.append(f"- {label}: hotswap ÷ {b} = **{r:.2f}×** (per rep {', '.join(f'{x:.2f}' for x in per)}), "
                       f"target ≤ {limit:g}×: **{'met' if r <= limit else 'missed'}**.")

    check("stream, at most 0.9× vllm-router", "hotswap", "vllm-router", "stream", TARGET_STREAM_VS_VLLM_ROUTER)
    check("stream, within 1.25× nginx", "hotswap", "nginx", "stream", TARGET_STREAM_VS_NGINX)
    check("non-stream, at most 0.9× the bare proxy", "hotswap", "bare", "non-stream", TARGET_NONSTREAM_VS_BARE)
    if "hotswap-ab" in names:
        for mode in modes:
            r, per = ratio("hotswap-ab", "hotswap", mode)
            if r is not None:
                verdict.append(f"- A/B, {mode}: hotswap-ab ÷ hotswap = {r:.2f}× (per rep {', '.join(f'{x:.2f}' for x in per)}).")
    for name in ("hotswap", "hotswap-activity-file"):
        if name in names and "hotswap-no-activity" in names:
            for mode in modes:
                r, per = ratio(name, "hotswap-no-activity", mode)
                if r is not None:
                    verdict.append(f"- activity log, {mode}: {name} ÷ hotswap-no-activity = {r:.2f}× "
                                   f"(per rep {', '.join(f'{x:.2f}' for x in per)}).")
    ticks = [p.proxy_us * p.ok / 1e6 * h.CLK_TCK for p in phases if p.proxy_us]
    if ticks:
        verdict.append(f"- CPU resolution: {1e3 / h.CLK_TCK:g} ms ticks; the smallest proxy CPU in one phase was {min(ticks):.0f} ticks "
                       f"(±{100 / min(ticks):.1f}% from quantization alone).")
    errors = sum(p.errors for p in phases)
    if errors:
        verdict.append(f"- **{errors} requests failed**; the numbers above are suspect.")

    vers = ", ".join(f"{k} {v}" for k, v in versions.items())
    head = [
        SECTION, "",
        f"{h.host(started)}, {h.client_versions()}{', ' + vers if vers else ''}, hotswap commit {h.git_rev()}. Took {elapsed:.0f} s. "
        f"Load average at start / end: {load_start} / {h.loadavg()}.",
        "", "```", command, "```", "",
        f"One upstream for all: a single `engines.sim` ({' '.join(SIM_FLAGS)}), its CPU reported as *upstream*. "
        f"Load: the bench's load generator (bench/harness.py) in its own process, {args.concurrency} concurrent keep-alive connections, "
        f"{args.requests} non-stream requests (`/v1/completions`, max_tokens 16) and {args.stream_requests} streams "
        "(max_tokens 64: 64 data chunks + `[DONE]`) per phase after a warmup, each phase capped at "
        f"{args.max_seconds:g} s; loopback only; {len(reps)} repetitions, targets interleaved within each. "
        "Latency is to the last byte. *Proxy CPU* = utime+stime of the proxy's whole process tree (from `/proc`), "
        "around the measured window, per request or per 64-chunk stream; *RSS* = the tree's VmRSS sum after the phase. "
        "*Other procs' CPU* = the machine's CPU (from `/proc/stat`) used by processes outside the bench during the phase.",
        "",
        "Targets: " + "; ".join(f"**{t.name}**: {t.note}" for t in targets if t.note) + ".",
        "",
    ]
    if unavailable:
        head += ["Not measured:", ""] + [f"- **{n}**: " + msg.replace("\n", "\n  ") for n, msg in unavailable.items()] + [""]
    return "\n".join(head + rows + ["", "Proxy CPU per request (mean, and each rep):", ""] + summary + lat + rss
                     + ["", "Targets:", ""] + verdict) + "\n"


# -- the run ---------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_load_args(p, reps=2)
    p.add_argument("--peers", default=",".join(DEFAULT_TARGETS),
                   help=f"comma-separated, in this order, from {','.join(ALL_TARGETS)} (default %(default)s)")
    p.add_argument("--ab-src", type=Path, default=None, metavar="DIR",
                   help="source tree for the opt-in target hotswap-ab (a patched copy), measured beside hotswap in the same run")
    p.add_argument("--no-install", action="store_true", help="do not pip-install missing Python peers")
    h.add_session_args(p)
    # The smoke: the Python peers that need nothing installed, a handful of requests each.
    a = h.parse(p, argv, smoke=dict(peers="direct,bare,hotswap", requests=40, stream_requests=8, concurrency=4, reps=1,
                                    max_seconds=5.0, idle_seconds=0.1, no_install=True))
    unknown = set(a.peers.split(",")) - set(ALL_TARGETS)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; known: {', '.join(ALL_TARGETS)}")
    if "hotswap-ab" in a.peers.split(",") and a.ab_src is None:
        p.error("hotswap-ab needs --ab-src DIR")
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    wanted = [n for n in ALL_TARGETS if n in args.peers.split(",")]
    modes = [m for m in MODES if m in args.modes.split(",")]
    phases: list[h.Phase] = []
    unavailable: dict[str, str] = {}
    versions: dict[str, str] = {}
    with h.session(args, "hotswap-peers-") as run:
        procs, tmp, started, load_start, t0 = run.procs, run.tmp, run.started, run.load_start, run.t0
        print(f"bench: starting the sim and {', '.join(wanted)} (logs in {tmp})", flush=True)
        sim_port, sim_pid = h.start_sim(procs, tmp)
        key = "bench-" + os.urandom(8).hex()
        starters = {
            "direct": lambda: h.Target("direct", f"http://127.0.0.1:{sim_port}", None, 0),
            "nginx": lambda: start_nginx(procs, tmp, sim_port, versions),
            "bare": lambda: h.start_bare(procs, tmp, sim_port, sim_pid),
            "vllm-router": lambda: start_vllm_router(procs, tmp, sim_port, not args.no_install, versions),
            "litellm": lambda: start_litellm(procs, tmp, sim_port, not args.no_install, versions),
            "hotswap": lambda: start_hotswap(procs, tmp, sim_port, key, args.router_src),
            "hotswap-ab": lambda: start_hotswap(procs, tmp, sim_port, key, args.ab_src, "hotswap-ab"),
            **{n: (lambda n=n: start_hotswap(procs, tmp, sim_port, key, args.router_src, n)) for n in ACTIVITY_TARGETS},
        }
        targets = []
        for name in wanted:
            try:
                t = starters[name]()
            except (PeerUnavailable, h.NotReady) as exc:  # NotReady: it exited or never answered; that drops only this peer
                unavailable[name] = _short(str(exc), 25)
                print(f"bench: {name} unavailable: {exc}", file=sys.stderr, flush=True)
                continue
            t.upstream_pid = sim_pid
            targets.append(t)
        print(f"bench: ready after {time.monotonic() - t0:.1f} s: {', '.join(t.name for t in targets)}", flush=True)
        idle = h.idle_cpu(targets, args.idle_seconds)
        # A mode's phases run back to back, the targets' order reversed every other rep: the machine's
        # speed drifts over seconds (other tenants, clocks), and pairs measured apart would carry it.
        for rep in range(1, args.reps + 1):
            for mode in modes:
                for t in (targets if rep % 2 else targets[::-1]):
                    phases.append(h.run_phase(procs, t, mode, rep, args, tmp))
        text = report(phases, targets, unavailable, idle, versions, args, h.command_line(), started, time.monotonic() - t0, load_start)
        run.publish(text, SECTION)
        return 1 if any(p.errors for p in phases) else 0
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
