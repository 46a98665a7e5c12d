"""Three hotswap nodes behind HAProxy on loopback; SIGKILL (or SIGTERM) one mid-load; count what happened.

Run it through try-local.sh (which installs what it needs). Layout (rosters in a temp dir):

    node-a: shared, alpha       node-b: shared, beta       node-c: gamma, delta (parked when idle)
                  \\                   |                    /
                   HAProxy (deploy/multinode/haproxy.py): backend per model, /ready checks, retry-on 503

The openai SDK sends completions for every model through HAProxy for --seconds; node-b is
SIGKILLed at --kill-at (`--signal TERM`: stopped gracefully, so it drains first). Exit 0 when every
claim in the summary holds, 1 otherwise.

A busy machine slows every step: each wait is a poll with a deadline that fits it, and a step that
does not happen names itself and what it saw (deploy/multinode/steps.py). The kill waits until
every model has answered once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
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
from steps import (POLL_CALL_S, SETTLE_S, STEP, WATCHED, Failed, Procs, alive, free_port, get, poll,  # noqa: E402
                   signal_group, step)
NODES = {  # node -> (models, zone, parks its idle models after this many seconds)
    "node-a": (["shared", "alpha"], "a", None),
    "node-b": (["shared", "beta"], "b", None),
    "node-c": (["gamma", "delta"], "c", 1.0),
}
VICTIM = "node-b"
MODELS = sorted({m for models, _, _ in NODES.values() for m in models})
BOOT_S = 120.0  # the three nodes, booting side by side
FIRST_ANSWERS_S = 60.0  # the kill waits this long at most for every model's first answer
ENGINES_GONE_S = 60.0  # the victim's engines, after the load (a drain, then the reaper's stop)
CLIENT_TIMEOUT_S = 15.0  # each load request's; a request left to it counts as lost


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
                     # The 8 MB prompts of scenario_peers (1.3 M of the sim's tokens): a length the engine takes, and a
                     # prefill that costs nothing. At the sim's default 20000 tok/s each took 67 s, and the six of them
                     # (before the load) took the run past its bounds; what they check is the front's routing, not a prefill.
                     "args": ["--sim-boot-s", "0", "--sim-token-rate", "400", "--gpu-memory-utilization", "0.3",
                              "--max-model-len", "4000000", "--sim-prefill-rate", "1e9"],
                     "gate": {"max_tokens": 8}},
        "models": [{"name": m, "model": f"sim/{m}"} for m in models],
    }


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
    started_at: float = field(default_factory=time.monotonic)
    in_flight_at_kill: dict[str, int] = field(default_factory=dict)
    live: dict[int, Result] = field(default_factory=dict)
    kill_waited_s: float = 0.0  # past --kill-at, for every model's first answer


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


def answered(run: Run) -> set[str]:
    return {r.model for r in run.results if not r.error}


async def load(url: str, seconds: float, kill_at: float, concurrency: int, kill, before_kill) -> Run:
    """`concurrency` clients in turn over every model; `kill()` at `kill_at` s, or later, once every model
    has answered (a busy machine wakes node-c's parked models slowly), then `seconds - kill_at` s more.
    `before_kill()` (blocking: it runs in a thread) looks at the fleet just before."""
    run = Run()
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    end = run.started_at + seconds + FIRST_ANSWERS_S  # until the kill says when
    turn = iter(range(10**9))

    async def worker() -> None:
        while time.monotonic() < end:
            await one(client, MODELS[next(turn) % len(MODELS)], run)

    async def killer() -> None:
        nonlocal end
        await asyncio.sleep(kill_at)  # the scenario's schedule; what it waits for is below
        step(f"the load: every model's first answer before the kill (at most {FIRST_ANSWERS_S:g} s past --kill-at)")
        waited = time.monotonic()
        while answered(run) != set(MODELS) and time.monotonic() - waited < FIRST_ANSWERS_S:
            await asyncio.sleep(0.05)
        run.kill_waited_s = time.monotonic() - waited
        await asyncio.to_thread(before_kill)
        run.in_flight_at_kill = dict(collections.Counter(r.model for r in run.live.values()))
        run.killed_at = time.monotonic()
        kill()
        end = run.killed_at + seconds - kill_at
        step(f"the load after the kill ({seconds - kill_at:g} s, then each request's {CLIENT_TIMEOUT_S:g} s at most)")

    await asyncio.gather(killer(), *(worker() for _ in range(concurrency)))
    await client.close()
    return run


def _tally(results: list[Result]) -> str:
    """Where a set of requests went: `node-a 12, 503 shutting_down 2`, or `none`."""
    counts = collections.Counter(r.error or r.node or "?" for r in results)
    return ", ".join(f"{k} {c}" for k, c in sorted(counts.items())) or "none"


def report(run: Run, before: dict, engines: tuple[list[int], list[int]], sig: str, front_claims: list[tuple[str, bool]],
           front_text: str) -> tuple[str, bool]:
    """The table and the claims; each claim says what it saw, so a [FAIL] needs no log to be read."""
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
    pre_shared = [r for r in run.results if r.model == "shared" and r.ended < kill]
    orphan = [r for r in run.results if VICTIM in holders[r.model] and len(holders[r.model]) == 1 and r.started > kill]
    unanswered = [m for m in MODELS if not any(not r.error and r.ended < kill for r in run.results if r.model == m)]
    others = [r for r in run.results if r.model in ("alpha", "gamma", "delta") and r.error]
    beta_at_kill = [r for r in run.results if r.model == "beta" and r.started < kill < r.ended]
    # An orphan is answered by HAProxy (503) or by the dying node; never left to the client's timeout.
    hung = [r for r in orphan if r.error == "APITimeoutError" or r.ended - r.started >= CLIENT_TIMEOUT_S]
    slowest = max((r.ended - r.started for r in orphan), default=0.0)
    victim_engines, left = engines
    # SIGTERM: the victim stops by itself after its drain; SIGKILL: it must not leave engines behind.
    claims = [
        (f"every model answered before the kill ({run.killed_at - run.started_at:.1f} s into the load"
         + (f", {run.kill_waited_s:.1f} s past --kill-at waiting for first answers" if run.kill_waited_s >= 0.1 else "")
         + (f"; no answer from: {', '.join(unanswered)})" if unanswered else ")"), not unanswered),
        # SIGKILL: shared is parked on node-a (scenario_front.affinity); SIGTERM: awake on both.
        (f"shared went only to node-b, where it is awake, before the kill ({_tally(pre_shared)}); node-a kept it parked "
         f"(it was {before['shared_on_a_at_kill']} at the kill)",
         {r.node for r in pre_shared if not r.error} == {"node-b"} and before["shared_on_a_at_kill"] == "sleeping")
        if sig == "KILL" else
        (f"shared was spread over node-a and node-b before the kill ({_tally(pre_shared)})",
         {r.node for r in pre_shared if not r.error} == {"node-a", "node-b"}),
        (f"node-c stayed in HAProxy while all its models slept (/ready {before['node_c_ready']}, "
         f"gamma's wake line {before['gamma_wake_line']})",
         before["node_c_ready"] == 200 and before["gamma_wake_line"] == "UP"),
        (f"after the kill, shared is served by node-a only, every request answered ({_tally(post_shared)})",
         bool(post_shared) and all(not r.error and r.node == "node-a" for r in post_shared)),
        (f"alpha, gamma, delta never failed (failures: {_tally(others)})", not others),
        (f"requests lost on models another node has ({lost_elsewhere}) <= in flight on {VICTIM} at the kill ({in_flight})",
         lost_elsewhere <= in_flight) if sig == "KILL" else
        # In flight at the signal as the client counts it: one still on its way through HAProxy reaches the
        # draining node after the signal and is refused (503 shutting_down, Retry-After) before it begins there.
        (f"a drain loses nothing: requests lost on models another node has ({lost_elsewhere}) == 0, and every beta "
         f"request in flight at the signal finished (or, not begun there yet, was refused: 503 shutting_down) "
         f"({_tally(beta_at_kill)})",
         lost_elsewhere == 0 and not any(r.error and r.error != "503 shutting_down" for r in beta_at_kill)),
        (f"beta (only on node-b) is refused after the kill, never left to the client's {CLIENT_TIMEOUT_S:g} s timeout "
         f"({_tally(orphan)}; slowest {slowest:.1f} s)", not hung),
        (f"{VICTIM}'s engines died with it (pids {victim_engines or 'none found'}; left alive: {left or 'none'}, "
         f"waiting up to {ENGINES_GONE_S:g} s after the load)", bool(victim_engines) and not left),
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
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="load duration (the kill may come late: then the load runs SECONDS - KILL_AT past it)")
    parser.add_argument("--kill-at", type=float, default=3.0,
                        help=f"stop {VICTIM} this long into the load, or once every model has answered, if later")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--signal", choices=("KILL", "TERM"), default="KILL", help=f"how {VICTIM} is stopped")
    parser.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy")
    parser.add_argument("--summary-json", type=Path, help="also write the claims and counts here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hotswap-try-local-"))
    procs = Procs(work, REPO)
    began = time.monotonic()

    def stopped(*_) -> None:  # SIGTERM (the shell's trap, its bound, a CI timeout): say where it struck
        print(f"try-local: stopped by SIGTERM {time.monotonic() - began:.0f} s in, during: {STEP['now']} "
              f"(for {time.monotonic() - STEP['since']:.0f} s); logs in {work}", file=sys.stderr)
        sys.exit(143)  # the finally below stops everything

    signal.signal(signal.SIGTERM, stopped)
    try:
        ports = {name: free_port() for name in NODES}
        agents = {name: free_port() for name in NODES}
        for name, port in ports.items():
            path = work / f"{name}.yaml"
            peers = [f"http://127.0.0.1:{p}" for n, p in ports.items() if n != name]
            path.write_text(yaml.safe_dump(roster(name, port, agents[name], peers)))
            procs.start(name, [sys.executable, "-m", "router.cli", "serve", "--config", str(path),
                               "--log-dir", str(work / f"{name}-engines")])
        node_url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        WATCHED.update(procs.started)  # every wait until the kill needs them

        def booted() -> tuple[bool, str]:
            seen = {}
            for name, url in node_url.items():
                try:
                    seen[name] = "booted" if json.loads(get(url + "/admin/status", POLL_CALL_S)[1])["booted"] else "booting"
                except Exception as exc:  # noqa: BLE001 (not listening yet)
                    seen[name] = type(exc).__name__
            return all(v == "booted" for v in seen.values()), ", ".join(f"{n} {v}" for n, v in seen.items())

        poll("the three nodes booted (/admin/status)", BOOT_S, booted)
        placement = {m: [(n, f"127.0.0.1:{ports[n]}", f"127.0.0.1:{agents[n]}") for n in NODES if m in NODES[n][0]] for m in MODELS}
        front, stats_port = free_port(), free_port()
        cfg = work / "haproxy.cfg"
        cfg.write_text(haproxy.render(placement, f"127.0.0.1:{front}", stats=f"127.0.0.1:{stats_port}",
                                      models_lua=str(haproxy.LUA_FILE)))
        procs.start("haproxy", [args.haproxy, "-db", "-f", str(cfg)])
        WATCHED.update(procs.started)
        stats = f"http://127.0.0.1:{stats_port}/haproxy-stats;csv"

        def states() -> dict:  # "DRAIN (agent)": drained by the node's agent, read as DRAIN
            return {k: v.split()[0] for k, v in haproxy.server_states(get(stats, POLL_CALL_S)[1].decode()).items()}

        # Each model's primary and backup ("<node>:wake") line per node, and the any_node backend. A
        # primary line is UP where its model is awake and DRAIN where it is parked (the node's agent).
        servers = 2 * sum(len(nodes) for nodes in placement.values()) + len(ports)

        def all_up() -> tuple[bool, str]:
            now = states()
            behind = {f"{b}/{n}": v for (b, n), v in now.items() if v not in ("UP", "DRAIN")
                      or (b == "model_shared" and ":" not in n and v != "UP")}
            return len(now) == servers and not behind, f"{len(now)} of {servers} servers, not yet UP: {behind or 'none'}"

        poll("HAProxy: every server UP or DRAIN (its checks and agents), shared's primary lines UP", SETTLE_S, all_up)
        c_url = node_url["node-c"]

        def c_parked() -> tuple[bool, str]:
            engines = json.loads(get(c_url + "/admin/status", POLL_CALL_S)[1])["engines"]
            return all(e["state"] == "sleeping" for e in engines), ", ".join(f"{e['name']} {e['state']}" for e in engines)

        poll("node-c's models parked (idle_sleep_s: 1)", SETTLE_S, c_parked)
        step("node-c in rotation while parked")
        before = {"node_c_ready": get(c_url + "/ready")[0], "gamma_wake_line": states().get(("model_gamma", "node-c:wake"))}
        step("the admin rule through the front")
        front_claims = scenario_front.admin(f"http://127.0.0.1:{front}", stats, node_url["node-a"])
        front_text = ""
        if args.signal == "KILL":
            # The fleet's /v1/models and bodies of any size, while every node is up.
            step("the fleet's /v1/models and bodies of any size (scenario_peers)")
            lines, extra = scenario_peers.claims(f"http://127.0.0.1:{front}", {m: [n[0] for n in nodes] for m, nodes in placement.items()})
            front_text, front_claims = "\n".join(lines), front_claims + extra
            # The victim is the node where shared is awake (in the TERM run it is awake on both).
            scenario_front.park(node_url[scenario_front.PARKED], states)
            step("awake-affinity: 200 shared requests through the front (scenario_front)")
            claims, affinity_text = scenario_front.affinity(f"http://127.0.0.1:{front}/v1", node_url[scenario_front.PARKED],
                                                            args.concurrency)
            front_claims += claims
            front_text = "\n".join(t for t in (front_text, affinity_text) if t)
        step(f"{VICTIM}'s engines (/admin/status)")
        victim_engines = [e["pid"] for e in json.loads(get(node_url[VICTIM] + "/admin/status")[1])["engines"] if e.get("pid")]

        def look_at_a() -> None:
            before["shared_on_a_at_kill"] = scenario_front.state(node_url["node-a"], "shared")

        def kill() -> None:
            signal_group(procs.started[VICTIM].pid, getattr(signal, f"SIG{args.signal}"))

        step("the load")
        WATCHED.pop(VICTIM)
        run = asyncio.run(load(f"http://127.0.0.1:{front}/v1", args.seconds, args.kill_at, args.concurrency, kill, look_at_a))
        if args.signal == "KILL":
            front_claims.append(scenario_front.moved_after_kill(run.results, run.killed_at))
        WATCHED.clear()
        try:  # a wait, not a set-up step: the claim below says what is left
            poll(f"{VICTIM}'s engines gone", ENGINES_GONE_S,
                 lambda: (not any(alive(p) for p in victim_engines), f"alive: {[p for p in victim_engines if alive(p)]}"))
        except Failed:
            pass
        left = [p for p in victim_engines if alive(p)]
        text, ok = report(run, before, (victim_engines, left), args.signal, front_claims, front_text)
        print(f"try-local: 3 hotswap nodes + HAProxy {haproxy_version(args.haproxy)} on loopback "
              f"({args.concurrency} openai SDK clients for {args.seconds:g} s; logs in {work}; "
              f"{time.monotonic() - began:.0f} s in all)\n")
        print(text)
        if args.summary_json:
            args.summary_json.write_text(json.dumps({"ok": ok, "summary": text, "requests": len(run.results),
                                                     "in_flight_at_kill": run.in_flight_at_kill}))
        return 0 if ok else 1
    except AssertionError as exc:  # a step did not happen (Failed, or a scenario's own check): it names itself
        print(f"try-local: {exc}; logs in {work}", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 (anything else: where it happened, then how)
        print(f"try-local: failed during: {STEP['now']}; logs in {work}\n{traceback.format_exc()}", file=sys.stderr)
        return 1
    finally:
        step("stopping every process it started")
        procs.stop_all()


def haproxy_version(exe: str) -> str:
    out = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=10).stdout
    return out.split()[2] if len(out.split()) > 2 else "?"


if __name__ == "__main__":
    sys.exit(main())
