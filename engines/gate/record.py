"""What the gate knows of one engine, kept across its restarts: the cold-boot baseline, the last verdict,
and the acceptance it saw while the engine served (the mid-life window, a collapse to remedy).

The engine owns one (`Engine.gate`) and hands it what it measured; this decides. Two writers only: the
gate step of a boot or a wake (`run`, `judged`) and the acceptance watch (`observe`, `answered`, fed by
engines.watch and the proxy).
"""

from __future__ import annotations

import time
from typing import Optional

from config.schema import Gate
from engines.gate.canary import Canary, Counters
from engines.gate.promotion import Baseline, canaries, run_gate
from engines.gate.verdict import MidlifeWatch, Verdict
from engines.vllm.client import VLLMClient


class GateRecord:
    def __init__(self, config: Gate):
        self.config = config
        self.baseline: Optional[Canary] = None  # from the first cold boot; kept across restarts
        self.lora_baseline: Optional[Canary] = None  # gate.lora_canary's, recorded with `baseline`
        self.wake_baseline: Optional[Canary] = None  # the short wake canary's (gate.wake_max_tokens), likewise
        self.logprob_spread: Optional[float] = None  # between the two cold-boot canaries of `baseline`
        self.last_verdict: Optional[Verdict] = None
        self.observed_mal: Optional[float] = None  # the last canary's, or the window's while serving
        self.observed_mal_source: Optional[str] = None  # canary.FROM_ANSWER | canary.FROM_COUNTERS
        self.midlife = MidlifeWatch(config)
        self.needs_restart: Optional[str] = None  # a collapse while serving, with gate.on_midlife: restart
        self.watch_error: Optional[str] = None  # the acceptance watch's last failure to read the engine

    # -- the gate step ------------------------------------------------------------------------

    @property
    def canaries(self) -> int:
        """How many canaries the next gate step runs (each gets swap.timeouts.gate)."""
        return canaries(self.config, first=self.baseline is None)

    async def run(self, client: VLLMClient, served_name: str, served_names: frozenset[str], has_draft: bool,
                  timeout: float, woke_from: Optional[int] = None) -> Verdict:
        """The canaries of one gate step: the first passed one on a cold engine is its baseline, every
        later one is judged against it. `timeout`: each canary's. `woke_from`: the level of the wake it
        follows (None: a boot), which decides whether the short wake canary runs."""
        baseline = Baseline(self.baseline, self.lora_baseline, self.wake_baseline) if self.baseline is not None else None
        verdict, recorded = await run_gate(client, served_name, served_names, self.config, has_draft, baseline, timeout,
                                           woke_from)
        if recorded is not None:
            self.baseline, self.lora_baseline, self.wake_baseline = recorded
            self.logprob_spread = verdict.logprob_drift  # the baseline's replay against it
        return verdict

    def judged(self, verdict: Verdict) -> Verdict:
        """Keep a step's verdict; a refusal under gate.on_fail: allow comes back allowed (the caller says so loudly)."""
        if verdict.result == "refused" and self.config.on_fail == "allow":
            verdict = verdict.allowed()
        self.last_verdict = verdict
        if verdict.observed_mal is not None:
            self.observed_mal, self.observed_mal_source = verdict.observed_mal, verdict.acceptance_source
        return verdict

    def promoted(self) -> None:
        """A fresh process or a verified wake: its counters and acceptance start over, nothing to remedy."""
        self.midlife.reset()
        self.needs_restart = None

    # -- while it serves -----------------------------------------------------------------------

    @property
    def watching(self) -> bool:
        """A baseline with a draft's acceptance to compare the served traffic with."""
        return self.baseline is not None and self.baseline.mal is not None

    def observe(self, counters: Counters) -> Optional[str]:
        """One scrape of the engine's spec-decode counters. Returns the reason of a collapse that begins now
        (None otherwise); a window back within bounds clears a restart not yet begun."""
        if self.baseline is None or self.baseline.mal is None:
            return None
        was_collapsed = self.midlife.collapsed
        mal, problems = self.midlife.observe(time.monotonic(), counters, self.baseline.mal)
        if mal is not None:
            self.observed_mal, self.observed_mal_source = mal, self.midlife.source
        if not problems:
            self.needs_restart = None
            return None
        if was_collapsed:
            return None
        reason = "; ".join(problems)
        if self.config.on_midlife == "restart":
            self.needs_restart = reason
        return reason

    def answered(self, steps: int, accepted: int) -> None:
        """A served answer's own acceptance numbers (`metrics.speculative_decoding`, read by the proxy), for the window."""
        self.midlife.answered(time.monotonic(), steps, accepted)

    # -- roster changes ------------------------------------------------------------------------

    def adopt(self, config: Gate) -> None:
        """New thresholds, in force at once: the baseline stays."""
        self.config = self.midlife.gate = config

    def forget(self, config: Gate) -> None:
        """Another model or other flags: the next boot records a new baseline (the last verdict stays
        shown until then)."""
        self.config = config
        self.baseline = self.lora_baseline = self.wake_baseline = None
        self.logprob_spread = self.observed_mal = self.observed_mal_source = None
        self.midlife = MidlifeWatch(config)
        self.needs_restart = None
