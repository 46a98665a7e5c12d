"""`hotswap trial`: evidence on the operator's own hardware (issue 57).

For each model: its cold boot and baseline, then N cycles through every rung it may use (KV park, Level 1
within the host budget, Level 2 where its load format reloads), each through the router's admin API
(`POST /admin/sleep?level=N`, `POST /admin/swap`), with the phases the router timed, the memory freed and
taken back, the gate's verdict and a short generation timed against the cold baseline; with --drill, one
Level-2 wake without the draft reload (`POST /admin/drill`), refused by the gate and remediated. A progress
line per step on stderr, a table on stdout, Markdown and JSON reports (router.trial.report).

It runs on a router of its own (`hotswap serve` on the roster, loopback, a free port, stopped at the end), so
nothing of it meets client traffic; or with --url on a running router, whose admin API it drives.
"""

from __future__ import annotations

import asyncio
import datetime
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp

from config import Roster
from config.schema import ModelSpec
from engines import waking
from router.trial import machine
from router.trial.report import (RUNG_NAMES, Boot, Drill, Generation, GpuMemory, ModelTrial, Report, Verdict, Wake,
                                     markdown, table)
from router.trial.own_router import AdminRefused, Holding, OwnRouter, RouterClient, TrialError

LEVELS = {"kv": waking.KV_PARKED, "0": waking.KV_PARKED, "1": 1, "2": 2}
PROMPT = "The operator wakes the model and it answers:"
COLLAPSED_BELOW = 0.5  # acceptance kept vs baseline under which a drill that passed the gate is a miss


@dataclass
class Options:
    roster: Roster
    config: str
    models: Optional[list[str]] = None
    cycles: int = 2
    levels: tuple[int, ...] = (0, 1, 2)
    drill: bool = False
    report: Optional[Path] = None
    json: Optional[Path] = None
    url: Optional[str] = None
    admin_key: Optional[str] = None  # --admin-key, else HOTSWAP_ADMIN_KEY (the command line reads it), else the roster's
    api_key: Optional[str] = None
    tokens: int = 64
    log_dir: Optional[Path] = None
    command: str = ""


def parse_levels(text: str) -> tuple[int, ...]:
    """`kv,1,2` -> (0, 1, 2); ValueError naming a rung it does not know."""
    levels = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part not in LEVELS:
            raise ValueError(f"unknown rung {part!r}: use kv, 1 and/or 2")
        levels.append(LEVELS[part])
    if not levels:
        raise ValueError("no rung given: use kv, 1 and/or 2")
    return tuple(sorted(set(levels)))


def run(options: Options) -> int:
    return asyncio.run(_run(options))


class Progress:
    """`[trial 1m02s] step 3/14: ...` on stderr: what runs now and how much is left."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.step, self.steps = 0, 0

    def __call__(self, message: str, step: bool = False) -> None:
        if step:
            self.step += 1
        elapsed = int(time.monotonic() - self.started)
        where = f"step {self.step}/{self.steps}: " if step else ""
        print(f"[trial {elapsed // 60}m{elapsed % 60:02d}s] {where}{message}", file=sys.stderr, flush=True)


async def _run(options: Options) -> int:
    # SIGTERM ends the trial as Ctrl-C does: its router (in a session of its own) is stopped, not orphaned.
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    say = Progress()
    roster = options.roster
    started = datetime.datetime.now(datetime.timezone.utc)
    report = Report(started_at=started.isoformat(timespec="seconds"), command=options.command, roster=options.config,
                    router={}, hardware="cpu",
                    settings={"cycles": options.cycles, "levels": ",".join(RUNG_NAMES[x] for x in options.levels),
                              "drill": options.drill, "tokens": options.tokens})
    own: Optional[OwnRouter] = None
    if options.url is None:
        log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="hotswap-trial-"))
        own = OwnRouter(options.config, log_dir)
        url = own.url
        report.router = {"mode": "own", "url": url, "log": str(own.log_path), "isolation":
                         "a router of the trial's own, on a loopback port, stopped at the end: no client traffic reaches it"}
        say(f"starting a router of the trial's own at {url} (log {own.log_path}); it is stopped at the end")
    else:
        url = options.url
        report.router = {"mode": "url", "url": url, "isolation":
                         "the operator's running router: the models the trial drives are held for its length "
                         "(POST /admin/hold): client requests for them are answered 503 model_held with Retry-After, "
                         "requests already waiting when the hold began are served by an engine the gate promoted; "
                         "other models' traffic may still move them to make room"}
        say(f"driving the running router at {url}")
    timeout = roster.queue.max_wait_s + roster.swap.boot_timeout_s + 60
    try:
        async with aiohttp.ClientSession() as session:
            client = RouterClient(url, session, options.admin_key or admin_key_of(roster), options.api_key or client_key_of(roster),
                                  action_timeout_s=timeout)
            boot_wait = roster.swap.boot_timeout_s * max(1, len(roster.models)) + 60
            status = await client.wait_booted(boot_wait, own.gone if own else lambda: None, say)
            if own is not None:
                await Trial(client, options, report, say).run(status)
            else:
                names = options.models or [m.name for m in roster.models]
                async with Holding(client, names, say):
                    say(f"holding {', '.join(names)} off client traffic for the trial's length (POST /admin/hold)")
                    await Trial(client, options, report, say).run(status)
    except (TrialError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        report.failures.append(f"the trial stopped: {exc or type(exc).__name__}")
        say(f"the trial stopped: {exc or type(exc).__name__}")
    except asyncio.CancelledError:
        report.failures.append("the trial was interrupted (SIGINT or SIGTERM)")
        say("interrupted")
    finally:
        if own is not None:
            say("stopping the trial's router and its engines")
            code = await own.stop()
            if code not in (0, None):
                report.failures.append(f"the trial's router exited with {code} (log {own.log_path})")
    finished = datetime.datetime.now(datetime.timezone.utc)
    report.finished_at = finished.isoformat(timespec="seconds")
    report.seconds = round((finished - started).total_seconds(), 1)
    return _write(report, options)


def _write(report: Report, options: Options) -> int:
    print(table(report))
    if report.failures:
        print("\nFAIL:\n" + "\n".join(f"  - {f}" for f in report.failures))
    else:
        print("\nPASS: every wake promoted with its acceptance intact; no step failed.")
    if options.report:
        options.report.write_text(markdown(report))
        print(f"Markdown report: {options.report}", file=sys.stderr)
    if options.json:
        options.json.write_text(report.dump_json())
        print(f"JSON report: {options.json}", file=sys.stderr)
    return 1 if report.failures else 0


def admin_key_of(roster: Roster) -> Optional[str]:
    if roster.auth.admin_key:
        return roster.auth.admin_key
    return next((k.key for k in roster.auth.keys if k.admin), None)


def client_key_of(roster: Roster) -> Optional[str]:
    """A client key that may use every model (api_keys, or a scoped key with models ['*']); None without client auth."""
    if roster.auth.api_keys:
        return roster.auth.api_keys[0]
    return next((k.key for k in roster.auth.keys if "*" in k.models), None)


class Trial:
    def __init__(self, client: RouterClient, options: Options, report: Report, say: Progress):
        self.client, self.options, self.report, self.say = client, options, report, say
        self.specs = {m.name: m for m in options.roster.models}
        self.baseline_speed: dict[str, float] = {}

    # -- the plan --------------------------------------------------------------------------------

    async def run(self, status: dict[str, Any]) -> None:
        engines = {e["name"]: e for e in status["engines"]}
        names = self.options.models or list(self.specs)
        unknown = [n for n in names if n not in engines]
        if unknown:
            raise TrialError(f"not in the roster: {', '.join(unknown)} (its models: {', '.join(engines)})")
        simulated = any("engines.sim" in " ".join(self.specs[n].launcher or self.specs[n].command or []) for n in names)
        ports = [engines[n].get("port") for n in names if engines[n].get("port")]
        worker = next((w for w in [await self.client.engine_versions(p) for p in ports] if w), {})
        self.report.versions = machine.versions(await self.client.engine_version(ports[0] if ports else None), worker)
        if simulated and self.report.versions.vllm is None:
            self.report.versions.vllm, self.report.versions.vllm_source = "none", "simulated engines (engines.sim)"
        self.report.hardware = machine.hardware(simulated, self.report.versions.gpus)
        self.gpu_source = "nvml" if self.report.versions.gpus and not simulated else "ledger"
        if self.report.hardware == "cpu":
            self.report.notes.append("no GPU visible to NVML: real vLLM on CPU, where sleep is bookkeeping only (nothing is "
                                     "freed or copied, and a Level-2 sleep loses no draft, so the drill cannot reproduce "
                                     "vLLM #52479 here); the numbers show the sequence works, not what a GPU costs")
        if self.gpu_source == "ledger":
            self.report.notes.append("GPU memory columns are the router's placement ledger (its plan), not NVML measurements")
        trials = [self._plan(self.specs[n]) for n in names]
        self.say.steps = sum(1 + self.options.cycles * len(t.rungs) + (1 if self._drills(t) else 0) for t in trials)
        self.say(f"{len(trials)} model(s), {self.say.steps} steps: " + "; ".join(
            f"{t.name}: boot + {self.options.cycles} x {','.join(RUNG_NAMES[x] for x in t.rungs) or 'no rung'}"
            + (" + drill" if self._drills(t) else "") for t in trials))
        for t in trials:
            self.report.models.append(t)
            await self._model(t)
        measured = [w.gpu for t in trials for w in t.wakes if w.gpu and (w.gpu.awake_gb is not None or w.gpu.asleep_gb is not None)]
        if not measured:
            self.report.notes = [n for n in self.report.notes if not n.startswith("GPU memory columns")]
            self.report.notes.append("GPU memory not reported: no NVML GPU, and the roster gives the router no GPU sizes (gpus:)")
        self._judge()

    def _plan(self, spec: ModelSpec) -> ModelTrial:
        allowed = waking.rungs(spec.sleep_level)
        t = ModelTrial(name=spec.name, draft=spec.speculative is not None, draft_restore=spec.draft_restore,
                       sleep_level_policy=str(spec.sleep_level))
        for level in self.options.levels:
            if level not in allowed:
                t.skipped[RUNG_NAMES[level]] = f"its sleep_level ({spec.sleep_level}) rules it out"
            elif level == 2 and not spec.reloads_weights:
                t.skipped[RUNG_NAMES[level]] = "its --load-format cannot reload from disk"
            else:
                t.rungs.append(level)
        return t

    def _drills(self, t: ModelTrial) -> bool:
        return self.options.drill and t.draft and t.draft_restore == "reload" and 2 in t.rungs

    # -- one model ---------------------------------------------------------------------------------

    async def _model(self, t: ModelTrial) -> None:
        name = t.name
        try:
            self.say(f"{name}: cold boot and baseline: swap it in, then a {self.options.tokens}-token generation", step=True)
            await self.client.admin("swap", name)
            await self._generate(name)  # a warm-up: the first generation after a boot pays one-time costs
            e = await self.client.engine(name)
            boot_s = await self.client.metric("hotswap_engine_boot_duration_seconds_sum", model=name)
            t.boot = Boot(seconds=None if boot_s is None else round(boot_s, 3),
                          baseline=_baseline(e), generation=await self._generate(name))
            if t.boot.generation:
                self.baseline_speed[name] = t.boot.generation.tokens_per_s
            for cycle in range(1, self.options.cycles + 1):
                for level in t.rungs:
                    self.say(f"{name}: cycle {cycle}/{self.options.cycles}, {RUNG_NAMES[level]}: sleep, wake, gate, "
                             "generation", step=True)
                    wake = await self._visit(name, cycle, level)
                    if wake.outcome == "skipped" and RUNG_NAMES[level] not in t.skipped:
                        t.skipped[RUNG_NAMES[level]] = wake.note or "refused by the router"
                    t.wakes.append(wake)
                    self._tell(name, wake)
                    if wake.outcome == "failed":
                        raise TrialError(f"{name}: {RUNG_NAMES[level]} cycle {cycle} failed: {wake.error}")
            if self._drills(t):
                self.say(f"{name}: drill: a Level-2 wake without the draft reload (vLLM #52479), the gate, remediation", step=True)
                t.drill = await self._drill(name)
                self.say(f"{name}: drill {t.drill.outcome}: {t.drill.explanation}")
        except (TrialError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            t.error = str(exc) or type(exc).__name__
            self.say(f"{name}: stopped: {t.error}")

    def _tell(self, name: str, w: Wake) -> None:
        v = w.verdict
        bits = [f"slept {w.sleep_s:.2f} s" if w.sleep_s is not None else None,
                f"woke {w.wake_s:.2f} s" if w.wake_s is not None else None,
                f"gate {' > '.join(w.gate_story) or (v.result if v else '-')}",
                f"MAL {v.observed_mal:.2f} vs {v.baseline_mal:.2f}" if v and v.observed_mal and v.baseline_mal else None,
                f"{w.generation.tokens_per_s:.0f} tok/s" if w.generation else None]
        self.say(f"{name}: {RUNG_NAMES[w.level]}{' drill' if w.drill else ''} {w.outcome}: "
                 + ", ".join(b for b in bits if b) + (f" ({w.note or w.error})" if w.note or w.error else ""))

    async def _generate(self, name: str) -> Optional[Generation]:
        tokens, seconds = await self.client.generate(name, PROMPT, self.options.tokens, self.client.action_timeout_s)
        speed = tokens / seconds if seconds > 0 else 0.0
        base = self.baseline_speed.get(name)
        return Generation(tokens=tokens, seconds=round(seconds, 4), tokens_per_s=round(speed, 1),
                          vs_baseline=round(speed / base, 3) if base else None)

    async def _held(self, name: str) -> Optional[float]:
        status = await self.client.status()
        if self.gpu_source == "nvml":
            e = next(x for x in status["engines"] if x["name"] == name)
            held = await asyncio.to_thread(machine.nvml_held_gb, e)
            if held is not None:
                return held
        return machine.ledger_held_gb(status, name)

    async def _visit(self, name: str, cycle: int, level: int, drill: bool = False) -> Wake:
        """Sleep `name` at `level`, wake it (the drill's way with `drill`), a generation: one Wake."""
        w = Wake(cycle=cycle, level=level, drill=drill, outcome="ok", gpu=GpuMemory(source=self.gpu_source))
        assert w.gpu is not None
        w.gpu.awake_gb = await self._held(name)
        started = time.monotonic()
        try:
            await self.client.admin("sleep", name, level=level)
        except AdminRefused as exc:
            if exc.code == "level_unavailable":
                w.outcome, w.note = "skipped", str(exc).split(": 409 ", 1)[-1]
                return w
            w.outcome, w.error = "failed", str(exc)
            return w
        w.sleep_s = round(time.monotonic() - started, 4)
        e = await self.client.engine(name)
        if e["state"] != "sleeping" or e["sleep_level"] != level:
            w.outcome, w.error = "failed", f"asked to sleep at level {level}, it is {e['state']} (level {e['sleep_level']})"
            return w
        w.sleep_phases = dict(e["last_phases"])
        host = e.get("host_memory") or {}
        w.host_ram_held_gb, w.host_ram_source = host.get("measured_gb"), host.get("source")
        w.gpu.asleep_gb = await self._held(name)
        seen = max((v["at"] for v in e["verdicts"]), default=0.0)
        restarts = e["restarts"]
        started = time.monotonic()
        try:
            await self.client.admin("drill" if drill else "swap", name)
        except AdminRefused as exc:
            w.error = str(exc)  # e.g. a refused wake with gate.on_fail: refuse answers 503
        w.wake_s = round(time.monotonic() - started, 4)
        e = await self.client.engine(name)
        w.wake_phases = dict(e["last_phases"])
        w.verdicts = [_verdict(v) for v in reversed(e["verdicts"]) if v["at"] > seen]
        w.gate_story = list(e["gate_story"])
        if e["restarts"] > restarts:
            w.remediation = "cold restart (gate.on_fail: restart), judged against the cold-boot baseline"
        if any(v.result in ("refused", "allowed") for v in w.verdicts):
            w.outcome = "refused"
        if e["state"] != "awake":
            w.outcome = "refused" if w.outcome == "refused" else "failed"
            w.error = w.error or f"after the wake it is {e['state']}: {e.get('failure')}"
            return w
        w.gpu.woken_gb = await self._held(name)
        w.generation = await self._generate(name)
        return w

    async def _drill(self, name: str) -> Drill:
        w = await self._visit(name, 1, 2, drill=True)
        first = w.verdict
        e = await self.client.engine(name)
        if w.outcome == "failed" and first is None:
            return Drill(outcome="failed", explanation=w.error or "the drill did not reach the gate", wake=w)
        remedy = first is not None and (first.result == "allowed" or (first.result == "refused" and e["state"] != "awake"))
        if remedy:
            self.say(f"{name}: drill: remediating with POST /admin/restart (gate.on_fail: {self.specs[name].gate.on_fail})")
            seen = max((v["at"] for v in e["verdicts"]), default=0.0)
            try:
                await self.client.admin("restart", name)
                w.remediation = f"cold restart by the trial (gate.on_fail: {self.specs[name].gate.on_fail})"
            except AdminRefused as exc:
                w.error = str(exc)
            e = await self.client.engine(name)
            w.verdicts += [_verdict(v) for v in reversed(e["verdicts"]) if v["at"] > seen]
            if e["state"] == "awake":
                w.generation = await self._generate(name)
        last = w.verdicts[-1] if w.verdicts else None
        restored = e["state"] == "awake" and last is not None and last.result == "passed"
        if first is None:
            return Drill(outcome="failed", explanation="no gate verdict was recorded for the drill's wake", wake=w)
        kept = first.acceptance_vs_baseline
        if first.result == "refused":
            if restored:
                return Drill(outcome="caught", wake=w, explanation=(
                    f"without its draft reload the draft came back lost: MAL {_f(first.observed_mal)} against the baseline "
                    f"{_f(first.baseline_mal)}; the gate refused the wake ({first.reason}); {w.remediation or 'remediation'} "
                    f"brought MAL back to {_f(last.observed_mal if last else None)}"))
            return Drill(outcome="not restored", wake=w, explanation=f"the gate refused the wake ({first.reason}) but "
                         f"remediation did not bring a promoted engine back: {w.error or e['state']}")
        if kept is not None and kept < COLLAPSED_BELOW:
            return Drill(outcome="missed", wake=w, explanation=f"acceptance collapsed (MAL {_f(first.observed_mal)} vs "
                         f"{_f(first.baseline_mal)}) and the gate did not refuse it: {first.result}, {first.reason}")
        return Drill(outcome="not reproduced", wake=w, explanation=(
            f"the wake without the draft reload kept its acceptance (MAL {_f(first.observed_mal)} vs {_f(first.baseline_mal)}), "
            "so the gate rightly passed it: here a Level-2 sleep did not lose the draft"
            + (" (on CPU sleep is bookkeeping and frees nothing)" if self.report.hardware == "cpu" else
               " (this vLLM may restore the draft itself)")))

    # -- the exit code -------------------------------------------------------------------------------

    def _judge(self) -> None:
        failures = self.report.failures
        for t in self.report.models:
            if t.error:
                failures.append(f"{t.name}: {t.error}")
            for w in t.wakes:
                where = f"{t.name} {RUNG_NAMES[w.level]} cycle {w.cycle}"
                if w.outcome == "refused":
                    v = w.verdict
                    failures.append(f"{where}: the gate refused the wake: {v.reason if v else w.error}")
                elif w.outcome == "failed":
                    failures.append(f"{where}: failed: {w.error}")
            if t.drill and t.drill.outcome in ("missed", "not restored", "failed"):
                failures.append(f"{t.name} drill {t.drill.outcome}: {t.drill.explanation}")


def _f(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _verdict(v: dict[str, Any]) -> Verdict:
    base, seen = v.get("baseline_mal"), v.get("observed_mal")
    kept = (seen - 1) / (base - 1) if base is not None and seen is not None and base > 1 else None
    return Verdict(result=v["result"], reason=v.get("reason") or "", baseline_mal=base, observed_mal=seen,
                   acceptance_vs_baseline=None if kept is None else round(kept, 3), logprob_drift=v.get("logprob_drift"),
                   seconds=v.get("seconds"))


def _baseline(e: dict[str, Any]) -> Optional[Verdict]:
    """The cold boot's baseline verdict (the oldest `baseline` the router still keeps), else the engine's baseline MAL."""
    found = [v for v in e["verdicts"] if v["result"] == "baseline"]
    if found:
        return _verdict(found[-1])
    return Verdict(result="baseline", baseline_mal=e.get("baseline_mal"), observed_mal=e.get("baseline_mal")) \
        if e.get("baseline_mal") is not None else None


def command_line(argv: list[str]) -> str:
    return "hotswap " + " ".join(shlex.quote(a) for a in argv)

