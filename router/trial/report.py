"""What `hotswap trial` found, as data (pydantic), a table, Markdown and JSON.

The JSON is the report: `format_version` says which shape it has, and a field is only ever
added within a version (docs/operators.md, "Reading a trial report"). The Markdown and the
table are renderings of it for people.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, computed_field

FORMAT_VERSION = 1
RUNG_NAMES = {0: "kv", 1: "L1", 2: "L2"}  # as --levels spells them: kv, 1, 2
Outcome = Literal["ok", "refused", "failed", "skipped"]
DrillOutcome = Literal["caught", "not reproduced", "missed", "not restored", "failed"]


class Versions(BaseModel):
    """What ran, each with where it was read (`*_source`): a report from another machine is read against these."""

    hotswap: Optional[str] = None
    vllm: Optional[str] = None
    vllm_source: Optional[str] = None
    torch: Optional[str] = None
    torch_source: Optional[str] = None
    driver: Optional[str] = None
    gpus: list[str] = Field(default_factory=list, description="NVML's name and memory of each GPU, in its order")
    python: Optional[str] = None
    platform: Optional[str] = None


class Generation(BaseModel):
    """A short generation through the trial's router, timed by the trial (a client's view: wall time)."""

    tokens: int
    seconds: float
    tokens_per_s: float
    vs_baseline: Optional[float] = Field(None, description="tokens/s over the cold baseline's (1.0: as fast)")


class GpuMemory(BaseModel):
    """What the engine held on its GPUs, in GB: `nvml` (its processes, measured) or `ledger` (the router's plan)."""

    source: Literal["nvml", "ledger"]
    awake_gb: Optional[float] = None
    asleep_gb: Optional[float] = None
    woken_gb: Optional[float] = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def freed_gb(self) -> Optional[float]:
        return None if self.awake_gb is None or self.asleep_gb is None else round(self.awake_gb - self.asleep_gb, 3)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def taken_back_gb(self) -> Optional[float]:
        return None if self.woken_gb is None or self.asleep_gb is None else round(self.woken_gb - self.asleep_gb, 3)


class Verdict(BaseModel):
    result: str
    reason: str = ""
    baseline_mal: Optional[float] = None
    observed_mal: Optional[float] = None
    acceptance_vs_baseline: Optional[float] = Field(
        None, description="(observed MAL - 1) / (baseline MAL - 1): the share of the baseline's accepted tokens kept")
    logprob_drift: Optional[float] = None
    seconds: Optional[float] = None


class Boot(BaseModel):
    seconds: Optional[float] = Field(None, description="cold boot to healthy, as the router measured it")
    baseline: Optional[Verdict] = None
    generation: Optional[Generation] = None


class Wake(BaseModel):
    """One rung visited: the sleep down to it, the wake back, the gate's verdict and a generation after."""

    cycle: int
    level: int
    drill: bool = False
    outcome: Outcome
    sleep_s: Optional[float] = Field(None, description="the admin sleep, as the trial timed it (drain included)")
    sleep_phases: dict[str, float] = Field(default_factory=dict)
    wake_s: Optional[float] = Field(None, description="the admin swap back, as the trial timed it (gate included)")
    wake_phases: dict[str, float] = Field(default_factory=dict)
    gpu: Optional[GpuMemory] = None
    host_ram_held_gb: Optional[float] = Field(None, description="host RAM the engine held for sleep, measured")
    host_ram_source: Optional[str] = None
    verdicts: list[Verdict] = Field(default_factory=list, description="every gate verdict of this wake, in order "
                                    "(a refusal, then the restart's)")
    gate_story: list[str] = Field(default_factory=list)
    remediation: Optional[str] = None
    generation: Optional[Generation] = None
    note: Optional[str] = None
    error: Optional[str] = None

    @property
    def verdict(self) -> Optional[Verdict]:
        """The first verdict: the woken engine's own (a restart's comes after it)."""
        return self.verdicts[0] if self.verdicts else None


class Drill(BaseModel):
    outcome: DrillOutcome
    explanation: str
    wake: Wake


class ModelTrial(BaseModel):
    name: str
    draft: bool
    draft_restore: str
    sleep_level_policy: str
    rungs: list[int] = Field(default_factory=list, description="the levels driven, shallowest first")
    skipped: dict[str, str] = Field(default_factory=dict, description="rung -> why it was not driven")
    boot: Boot = Field(default_factory=Boot)
    wakes: list[Wake] = Field(default_factory=list)
    drill: Optional[Drill] = None
    error: Optional[str] = None


class Report(BaseModel):
    format_version: int = FORMAT_VERSION
    started_at: str
    finished_at: Optional[str] = None
    seconds: Optional[float] = None
    command: str
    roster: str
    router: dict[str, Any] = Field(description="mode (own | url), url, and how the trial kept clear of client traffic")
    hardware: str = Field(description="gpu | cpu | simulator: what the numbers are numbers of")
    notes: list[str] = Field(default_factory=list)
    versions: Versions = Field(default_factory=Versions)
    settings: dict[str, Any] = Field(default_factory=dict)
    models: list[ModelTrial] = Field(default_factory=list)
    failures: list[str] = Field(default_factory=list, description="why the exit code is not 0; empty: it is 0")

    def dump_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


# -- renderings ---------------------------------------------------------------------------------


def _num(value: Optional[float], digits: int = 2, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _mal(v: Optional[Verdict]) -> str:
    if v is None or v.observed_mal is None:
        return "-"
    base = f"/{v.baseline_mal:.2f}" if v.baseline_mal is not None else ""
    return f"{v.observed_mal:.2f}{base}"


WAKE_COLUMNS = ("stage", "wake_weights", "reload_draft", "reload_weights", "wake_kv_cache", "reset_prefix_cache", "gate",
                "restart")
HEADER = ("model", "rung", "cycle", "sleep s", "wake s", *(c for c in WAKE_COLUMNS), "GPU freed/back GB", "host GB",
          "gate", "MAL/base", "drift", "tok/s (x base)")


def rows(report: Report) -> list[tuple[str, ...]]:
    out = []
    for m in report.models:
        for w in m.wakes + ([m.drill.wake] if m.drill else []):
            rung = RUNG_NAMES[w.level] + (" drill" if w.drill else "")
            phases = tuple(_num(w.wake_phases.get(c), 3) if c in w.wake_phases else "-" for c in WAKE_COLUMNS)
            known = w.gpu is not None and (w.gpu.freed_gb is not None or w.gpu.taken_back_gb is not None)
            gpu = f"{_num(w.gpu.freed_gb)}/{_num(w.gpu.taken_back_gb)} ({w.gpu.source})" if w.gpu and known else "-"
            v = w.verdict
            gate = " > ".join(w.gate_story) if w.gate_story else (v.result if v else w.outcome)
            gen = w.generation
            speed = "-" if gen is None else f"{gen.tokens_per_s:.0f} ({_num(gen.vs_baseline)})"
            out.append((m.name, rung, str(w.cycle), _num(w.sleep_s, 3), _num(w.wake_s, 3), *phases, gpu,
                        _num(w.host_ram_held_gb), gate if w.outcome != "failed" else "FAILED", _mal(v),
                        _num(v.logprob_drift if v else None, 4), speed))
    return out


def table(report: Report) -> str:
    """The end-of-run table for a terminal: fixed-width columns."""
    body = [HEADER, *rows(report)]
    widths = [max(len(r[i]) for r in body) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in body)


def markdown(report: Report) -> str:
    r = report
    v = r.versions
    lines = [f"# hotswap trial report (format {r.format_version})", ""]
    lines += [f"- **hardware: {r.hardware}**" + {"gpu": "", "cpu": " — real vLLM on CPU: sleep is bookkeeping, no memory is "
              "freed or moved, so wake times and memory columns are not what a GPU shows",
              "simulator": " — simulated engines (engines/sim): every number is the simulator's, not vLLM's"}.get(r.hardware, "")]
    lines += [f"- started {r.started_at}, finished {r.finished_at or '-'} ({_num(r.seconds, 0)} s)",
              f"- command: `{r.command}`", f"- roster: `{r.roster}`",
              f"- router: {r.router.get('mode')} at {r.router.get('url')}: {r.router.get('isolation')}",
              f"- vLLM {v.vllm or 'unknown'} ({v.vllm_source or '-'}); torch {v.torch or 'unknown'} ({v.torch_source or '-'}); "
              f"driver {v.driver or 'none'}; GPUs: {', '.join(v.gpus) or 'none visible to NVML'}; hotswap {v.hotswap}; "
              f"Python {v.python}; {v.platform}",
              f"- settings: {', '.join(f'{k}={val}' for k, val in r.settings.items())}"]
    lines += [f"- note: {n}" for n in r.notes]
    lines += ["", "## Verdict", ""]
    lines += ["**PASS**: every wake promoted with its acceptance intact; no step failed." if not r.failures else
              "**FAIL** (the command exits 1):"]
    lines += [f"- {f}" for f in r.failures]
    lines += ["", "## Cold boots", "", "| model | boot s | baseline MAL | gate s | tok/s | rungs driven | not driven |",
              "|---|---|---|---|---|---|---|"]
    for m in r.models:
        b = m.boot
        skipped = "; ".join(f"{k}: {why}" for k, why in m.skipped.items()) or "-"
        lines.append(f"| {m.name} | {_num(b.seconds, 1)} | {_num(b.baseline.baseline_mal if b.baseline else None)} | "
                     f"{_num(b.baseline.seconds if b.baseline else None, 3)} | "
                     f"{_num(b.generation.tokens_per_s if b.generation else None, 0)} | "
                     f"{', '.join(RUNG_NAMES[x] for x in m.rungs) or '-'} | {skipped} |")
    lines += ["", "## Every sleep and wake (seconds; GPU and host RAM in GB)", "", "| " + " | ".join(HEADER) + " |",
              "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows(r)]
    drills = [m for m in r.models if m.drill]
    if drills:
        lines += ["", "## Drill (vLLM #52479: a Level-2 wake without the draft reload)", ""]
        for m in drills:
            d = m.drill
            assert d is not None
            lines.append(f"- **{m.name}: {d.outcome}**: {d.explanation}")
    problems = [(m.name, w) for m in r.models for w in m.wakes if w.error or w.note]
    errors = [m for m in r.models if m.error]
    if problems or errors:
        lines += ["", "## Notes and errors", ""]
        lines += [f"- {name} {RUNG_NAMES[w.level]} cycle {w.cycle}: {w.error or w.note}" for name, w in problems]
        lines += [f"- {m.name}: {m.error}" for m in errors]
    return "\n".join(lines) + "\n"
