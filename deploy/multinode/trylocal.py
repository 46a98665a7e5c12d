"""Three hotswap nodes behind HAProxy on loopback; SIGKILL (or SIGTERM) one mid-load; count what happened.

Run it through try-local.sh (which installs what it needs). Layout (rosters in a temp dir):

    node-a: shared, alpha       node-b: shared, beta       node-c: gamma, delta (parked when idle)
                  \\                   |                    /
                   HAProxy (deploy/multinode/haproxy.py): backend per model, /ready checks, retry-on 503

The openai SDK sends completions for every model through HAProxy for --seconds; node-b is
SIGKILLed at --kill-at (`--signal TERM`: stopped gracefully, so it drains first). Exit 0 when every
claim in the summary holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
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
from typing import Optional

import openai
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]
import haproxy  # noqa: E402  (deploy/multinode/haproxy.py, a sibling script)
import scenario_front  # noqa: E402  (the front's own checks: awake-affinity, the admin rule)
import scenario_peers  # noqa: E402  (the fleet's /v1/models and bodies of any size)
from tests.support import until  # noqa: E402  (polling with a deadline, as the tests do)
NODES = {  # node -> (models, zone, parks its idle models after this many seconds)
    "node-a": (["shared", "alpha"], "a", None),
    "node-b": (["shared", "beta"], "b", None),
    "node-c": (["gamma", "delta"], "c", 1.0),
}
VICTIM = "node-b"
MODELS = sorted({m for models, _, _ in NODES.values() for m in models})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def roster(name: str, port: int, agent_port: int, peers: list[str]) -> dict:
    models, zone, idle = NODES[name]
    swap = {"min_active_s": 0, "drain_timeout_s": 5, **({"idle_sleep_s": idle} if idle else {})}
    return {
        # Two HAProxy checks (inter 1s, fall 2) see a drain within the notice. 16 MB: the 8 MB bodies of scenario_peers.
        "listen": {"host": "127.0.0.1", "port": port, "drain_notice_s": 2.5, "max_body_mb": 16},
        # peers: a body whose model the front cannot read reaches any node, which passes it on.
        "node": {"name": name, "labels": {"zone": zone}, "agent_port": agent_port, "peers": peers},
        "swap": swap,
        "defaults": {"launcher": ["python", "-m", "engines.sim", "serve"],
                     "args": ["--sim-boot-s", "0", "--sim-token-rate", "400", "--gpu-memory-utilization", "0.3",
                              "--max-model-len", "4000000"],  # the 8 MB prompts of scenario_peers
                     "gate": {"max_tokens": 8}},
        "models": [{"name": m, "model": f"sim/{m}"} for m in models],
    }


class Procs:
    """Each child leads its own process group; `stop_all` takes every group down (TERM, then KILL)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            self.started[name] = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True)
        return self.started[name]

    def stop_all(self, grace_s: float = 15.0) -> None:
        for proc in self.started.values():
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.started.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Result:
    model: str
    started: float
    ended: float
    node: Optional[str] = None
    error: Optional[str] = None


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    killed_at: Optional[float] = None
    in_flight_at_kill: dict[str, int] = field(default_factory=dict)
    live: dict[int, Result] = field(default_factory=dict)


async def one(client: openai.AsyncOpenAI, model: str, run: Run) -> None:
    result = Result(model, time.monotonic(), 0.0)
    run.live[id(result)] = result
    try:
        raw = await client.completions.with_raw_response.create(model=model, prompt="hello", max_tokens=16, temperature=0)
        if not raw.parse().choices[0].text:
            result.error = "empty answer"
        result.node = raw.headers.get("x-hotswap-node")
    except openai.APIStatusError as exc:
        result.error = f"{exc.status_code} {(exc.body or {}).get('code') if isinstance(exc.body, dict) else ''}".strip()
    except openai.APIError as exc:
        result.error = type(exc).__name__
    finally:
        result.ended = time.monotonic()
        del run.live[id(result)]
        run.results.append(result)


async def load(url: str, seconds: float, kill_at: float, concurrency: int, kill) -> Run:
    run = Run()
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=15)
    start = time.monotonic()
    turn = iter(range(10**9))

    async def worker() -> None:
        while time.monotonic() - start < seconds:
            await one(client, MODELS[next(turn) % len(MODELS)], run)

    async def killer() -> None:
        await asyncio.sleep(kill_at)
        run.in_flight_at_kill = dict(collections.Counter(r.model for r in run.live.values()))
        run.killed_at = time.monotonic()
        kill()

    await asyncio.gather(killer(), *(worker() for _ in range(concurrency)))
    await client.close()
    return run


def report(run: Run, before: dict, engines_gone: bool, sig: str, front_claims: list[tuple[str, bool]],
           front_text: str) -> tuple[str, bool]:
    kill = run.killed_at
    holders = {m: [n for n, (models, _, _) in NODES.items() if m in models] for m in MODELS}
    rows, lost_elsewhere = [], 0
    for m in MODELS:
        mine = [r for r in run.results if r.model == m]
        pre = [r for r in mine if r.ended < kill]
        post = [r for r in mine if r.started > kill]
        failed = [r for r in mine if r.error]
        if len([h for h in holders[m] if h != VICTIM]) > 0:
            lost_elsewhere += len(failed)
        served = lambda rs: ",".join(f"{n}:{c}" for n, c in sorted(collections.Counter(r.node for r in rs if not r.error).items()))
        rows.append((m, ",".join(holders[m]), len(mine), len(mine) - len(failed), len(failed),
                     f"{sum(not r.error for r in post)}/{len(post)}", served(pre) or "-", served(post) or "-"))
    in_flight = sum(run.in_flight_at_kill.get(m, 0) for m in MODELS if VICTIM in holders[m])
    post_shared = [r for r in run.results if r.model == "shared" and r.started > kill]
    orphan = [r for r in run.results if VICTIM in holders[r.model] and len(holders[r.model]) == 1 and r.started > kill]
    # SIGTERM: the victim stops by itself after its drain; SIGKILL: it must not leave engines behind.
    claims = [
        ("every model answered before the kill", all(any(not r.error and r.ended < kill for r in run.results if r.model == m)
                                                     for m in MODELS)),
        # SIGKILL: shared is parked on node-a (scenario_front.affinity); SIGTERM: awake on both.
        ("shared went only to node-b, where it is awake, before the kill; node-a kept it parked",
         {r.node for r in run.results if r.model == "shared" and r.ended < kill and not r.error} == {"node-b"}
         and before["shared_parked_on_a_at_kill"]) if sig == "KILL" else
        ("shared was spread over node-a and node-b before the kill",
         {r.node for r in run.results if r.model == "shared" and r.ended < kill and not r.error} == {"node-a", "node-b"}),
        ("node-c stayed in HAProxy while all its models slept (/ready 200, gamma's wake line UP)", before["node_c_up_while_asleep"]),
        ("after the kill, shared is served by node-a only, every request answered",
         bool(post_shared) and all(not r.error and r.node == "node-a" for r in post_shared)),
        ("alpha, gamma, delta never failed", not any(r.error for r in run.results if r.model in ("alpha", "gamma", "delta"))),
        (f"requests lost on models another node has ({lost_elsewhere}) <= in flight on {VICTIM} at the kill ({in_flight})",
         lost_elsewhere <= in_flight) if sig == "KILL" else
        # In flight at the signal as the client counts it: one still on its way through HAProxy reaches the
        # draining node after the signal and is refused (503 shutting_down, Retry-After) before it begins there.
        (f"a drain loses nothing: requests lost on models another node has ({lost_elsewhere}) == 0, and every beta "
         f"request in flight at the signal finished (or, not begun there yet, was refused: 503 shutting_down)",
         lost_elsewhere == 0 and not any(r.error and r.error != "503 shutting_down"
                                         for r in run.results if r.model == "beta" and r.started < kill < r.ended)),
        ("beta (only on node-b) is refused fast after the kill, never hangs",
         all(r.ended - r.started < 5 for r in orphan)),
        (f"{VICTIM}'s engines died with it", engines_gone),
        *front_claims,
    ]
    header = ("model", "nodes", "sent", "ok", "failed", "ok after kill", "served by before kill", "served by after kill")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows), "",
           f"{VICTIM} SIG{sig}ed with {sum(run.in_flight_at_kill.values())} requests in flight "
           f"({', '.join(f'{m} {c}' for m, c in sorted(run.in_flight_at_kill.items())) or 'none'}); "
           f"{len(orphan)} beta requests after it were refused (no live node has beta); errors: "
           + (", ".join(f"{e} x{c}" for e, c in collections.Counter(r.error for r in run.results if r.error).most_common()) or "none"),
           *([front_text] if front_text else []), ""]
    out += [f"[{'PASS' if ok else 'FAIL'}] {text}" for text, ok in claims]
    return "\n".join(out), all(ok for _, ok in claims)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="load duration")
    parser.add_argument("--kill-at", type=float, default=3.0, help=f"SIGKILL {VICTIM} this long into the load")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--signal", choices=("KILL", "TERM"), default="KILL", help=f"how {VICTIM} is stopped")
    parser.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy")
    parser.add_argument("--summary-json", type=Path, help="also write the claims and counts here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hotswap-try-local-"))
    procs = Procs(work)
    # SIGTERM (the shell's trap, a CI timeout) ends here too, so the finally below stops everything.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        ports = {name: free_port() for name in NODES}
        agents = {name: free_port() for name in NODES}
        for name, port in ports.items():
            path = work / f"{name}.yaml"
            peers = [f"http://127.0.0.1:{p}" for n, p in ports.items() if n != name]
            path.write_text(yaml.safe_dump(roster(name, port, agents[name], peers)))
            procs.start(name, [sys.executable, "-m", "router.cli", "serve", "--config", str(path),
                               "--log-dir", str(work / f"{name}-engines")])
        for name, port in ports.items():
            until(lambda: json.loads(get(f"http://127.0.0.1:{port}/admin/status")[1])["booted"], 90, f"{name} booted")
        placement = {m: [(n, f"127.0.0.1:{ports[n]}", f"127.0.0.1:{agents[n]}") for n in NODES if m in NODES[n][0]] for m in MODELS}
        front, stats_port = free_port(), free_port()
        cfg = work / "haproxy.cfg"
        cfg.write_text(haproxy.render(placement, f"127.0.0.1:{front}", stats=f"127.0.0.1:{stats_port}",
                                      models_lua=str(haproxy.LUA_FILE)))
        procs.start("haproxy", [args.haproxy, "-db", "-f", str(cfg)])
        stats = f"http://127.0.0.1:{stats_port}/haproxy-stats;csv"

        def states() -> dict:  # "DRAIN (agent)": drained by the node's agent, read as DRAIN
            return {k: v.split()[0] for k, v in haproxy.server_states(get(stats)[1].decode()).items()}

        # Each model's primary and backup ("<node>:wake") line per node, and the any_node backend. A
        # primary line is UP where its model is awake and DRAIN where it is parked (the node's agent).
        servers = 2 * sum(len(nodes) for nodes in placement.values()) + len(ports)
        until(lambda: len(states()) == servers and all(s in ("UP", "DRAIN") for s in states().values())
              and states()[("model_shared", "node-a")] == states()[("model_shared", "node-b")] == "UP", 30, "every HAProxy server UP")
        c_port = ports["node-c"]
        until(lambda: all(e["state"] == "sleeping" for e in json.loads(get(f"http://127.0.0.1:{c_port}/admin/status")[1])["engines"]),
              30, "node-c's models parked")
        before = {"node_c_up_while_asleep": get(f"http://127.0.0.1:{c_port}/ready")[0] == 200
                  and states()[("model_gamma", "node-c:wake")] == "UP"}
        node_url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        front_claims = scenario_front.admin(f"http://127.0.0.1:{front}", stats, node_url["node-a"])
        front_text = ""
        if args.signal == "KILL":
            # The fleet's /v1/models and bodies of any size, while every node is up.
            lines, extra = scenario_peers.claims(f"http://127.0.0.1:{front}", {m: [n[0] for n in nodes] for m, nodes in placement.items()})
            front_text, front_claims = "\n".join(lines), front_claims + extra
            # The victim is the node where shared is awake (in the TERM run it is awake on both).
            scenario_front.park(node_url[scenario_front.PARKED], until, states)
            claims, affinity_text = scenario_front.affinity(f"http://127.0.0.1:{front}/v1", node_url[scenario_front.PARKED],
                                                            args.concurrency)
            front_claims += claims
            front_text = "\n".join(t for t in (front_text, affinity_text) if t)
        victim_status = json.loads(get(f"http://127.0.0.1:{ports[VICTIM]}/admin/status")[1])
        victim_engines = [e["pid"] for e in victim_status["engines"] if e.get("pid")]

        def kill() -> None:
            before["shared_parked_on_a_at_kill"] = scenario_front.state(node_url["node-a"], "shared") == "sleeping"
            _signal_group(procs.started[VICTIM].pid, getattr(signal, f"SIG{args.signal}"))

        run = asyncio.run(load(f"http://127.0.0.1:{front}/v1", args.seconds, args.kill_at, args.concurrency, kill))
        if args.signal == "KILL":
            front_claims.append(scenario_front.moved_after_kill(run.results, run.killed_at))
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in victim_engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        engines_gone = bool(victim_engines) and not any(_alive(p) for p in victim_engines)
        text, ok = report(run, before, engines_gone, args.signal, front_claims, front_text)
        print(f"try-local: 3 hotswap nodes + HAProxy {haproxy_version(args.haproxy)} on loopback "
              f"({args.concurrency} openai SDK clients for {args.seconds:g} s; logs in {work})\n")
        print(text)
        if args.summary_json:
            args.summary_json.write_text(json.dumps({"ok": ok, "summary": text, "requests": len(run.results),
                                                     "in_flight_at_kill": run.in_flight_at_kill}))
        return 0 if ok else 1
    except AssertionError as exc:  # a set-up step did not happen in time (tests.support.until)
        print(f"try-local: {exc}; logs in {work}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def haproxy_version(exe: str) -> str:
    out = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=10).stdout
    return out.split()[2] if len(out.split()) > 2 else "?"


if __name__ == "__main__":
    sys.exit(main())
