"""What the router has measured, turned into predictions: how long a model takes to wake (or
boot, or sleep), and how soon it is likely to be asked for again.

Wake times are an EWMA of the recent wakes of that model at that sleep level; until a level
has been measured, the model's cold boot stands in for it (an upper bound: a wake never
reloads more than a boot does), except Level 1 and the KV tier (level 0), whose first guesses
come from the parts of a Level-2 wake they share (`observe_wake`); before any wake, a KV wake is
guessed at the gate its boot ran (a KV wake moves no weights, but runs the same canary). Demand is an exponentially decayed request rate, so both
frequency and recency count: a burst a minute ago weighs more than the same burst an hour ago.

A Level-2 wake whose checkpoint was staged (in the page cache before the wake began: engines.waking.stage)
is kept apart from one that read the disk, and the reload's seconds per GB are kept host-wide, from
the page cache and from the disk: a model never woken staged is priced from what its own unstaged
wakes cost without their reload, plus its checkpoint at the page cache's measured rate.
"""

from __future__ import annotations

import math
from typing import Optional

ALPHA = 0.3  # weight of the newest measurement
UNKNOWN_S = 30.0  # a model never booted yet (only before its first boot is measured)
# Tokens per second an engine prefills, until one of its resumed answers is measured (a paused answer's
# prompt and text so far, over the time from its lease to its first token): a modest GPU's order, so a
# preemption is not priced as free before anything is known.
PREFILL_TPS = 5000.0


class WakeCosts:
    def __init__(self, weights: Optional[dict[str, Optional[float]]] = None) -> None:
        self.boot: dict[str, float] = {}
        self.wake: dict[tuple[str, int], float] = {}  # Level 2: the wakes that did not find their checkpoint staged
        self.sleep: dict[str, float] = {}
        self.drain: dict[str, float] = {}  # the drains of its parks that had requests in flight
        self.prefill_tps: dict[str, float] = {}  # tokens per second its resumed answers were computed again at
        self.level1_prior: dict[str, float] = {}  # a Level-2 wake without its reloads (and its stage)
        self.kv_prior: dict[str, float] = {}  # a Level-2 wake without its weights' steps: the KV re-allocation, reset and gate
        self.gate: dict[str, float] = {}  # the gate step of its boots
        self.staged_wake: dict[str, float] = {}  # Level-2 wakes that found their checkpoint staged
        self.reload_s_per_gb: dict[bool, float] = {}  # host-wide, by whether the reload read the page cache
        self.weights = weights if weights is not None else {}  # GB per model (the scheduler's, kept current)

    def observe_boot(self, name: str, seconds: float, gate_s: float = 0.0) -> None:
        """`gate_s`: the boot's gate step, the KV tier's first guess (see `wake_s`)."""
        self.boot[name] = _ewma(self.boot.get(name), seconds)
        if gate_s > 0:
            self.gate[name] = _ewma(self.gate.get(name), gate_s)

    def observe_wake(self, name: str, level: int, seconds: float, reload_s: float = 0.0, weights_s: float = 0.0, *,
                     stage_s: float = 0.0, staged: bool = False, cached: Optional[bool] = None) -> None:
        """`reload_s`: the part of a Level-2 wake spent reloading weights from disk. Without it the
        wake is what a Level-1 wake would be, the estimate until one is measured: falling back to
        the boot instead would price Level 1 above Level 2 wherever a boot is the slower of the two
        (always, on a GPU), so no engine would ever be parked at Level 1 to be measured there.
        `weights_s`: the rest of its weights' part (`wake_weights`). Without both, what remains is
        its `wake_kv_cache`, `reset_prefix_cache` and gate: the KV tier's wake, its estimate until one
        is measured, for the same reason. `stage_s`: its stage step; `staged`: the stage found the
        checkpoint already resident; `cached`: the reload read the page cache (a stage completed before
        it), False the disk, None unknown (no stage ran: not counted in either rate)."""
        if level == 2 and staged:
            self.staged_wake[name] = _ewma(self.staged_wake.get(name), seconds)
        else:
            self.wake[(name, level)] = _ewma(self.wake.get((name, level)), seconds)
        if level == 2 and reload_s > 0:
            self.level1_prior[name] = _ewma(self.level1_prior.get(name), max(seconds - reload_s - stage_s, 0.0))
            gb = self.weights.get(name)
            if gb and cached is not None:
                self.reload_s_per_gb[cached] = _ewma(self.reload_s_per_gb.get(cached), reload_s / gb)
        if level == 2 and reload_s + weights_s > 0:
            self.kv_prior[name] = _ewma(self.kv_prior.get(name), max(seconds - reload_s - weights_s - stage_s, 0.0))

    def observe_sleep(self, name: str, seconds: float, busy_drain_s: Optional[float] = None) -> None:
        """`busy_drain_s`: the drain before it, when the park found requests in flight."""
        self.sleep[name] = _ewma(self.sleep.get(name), seconds)
        if busy_drain_s is not None:
            self.drain[name] = _ewma(self.drain.get(name), busy_drain_s)

    def observe_prefill(self, name: str, tokens: int, seconds: float) -> None:
        """A resumed answer's recompute: `tokens` (its prompt and text so far) took `seconds` to its first token."""
        if tokens > 0 and seconds > 0:
            self.prefill_tps[name] = _ewma(self.prefill_tps.get(name), tokens / seconds)

    def prefill_s(self, name: str, tokens: int) -> float:
        """Seconds `name` takes to compute `tokens` again, at its measured prefill rate (else PREFILL_TPS)."""
        return tokens / self.prefill_tps.get(name, PREFILL_TPS)

    def drain_s(self, name: str, bound: float) -> float:
        """How long parking `name` while it serves makes a waiter wait for its requests to finish: as
        measured, else `bound` (swap.drain_timeout_s: no drain lasts longer)."""
        return self.drain.get(name, bound)

    def forget(self, name: str) -> None:
        self.boot.pop(name, None)
        self.sleep.pop(name, None)
        self.drain.pop(name, None)
        self.prefill_tps.pop(name, None)
        self.level1_prior.pop(name, None)
        self.kv_prior.pop(name, None)
        self.gate.pop(name, None)
        self.staged_wake.pop(name, None)
        self.wake = {key: s for key, s in self.wake.items() if key[0] != name}

    def boot_s(self, name: str) -> float:
        return self.boot.get(name, UNKNOWN_S)

    def wake_s(self, name: str, level: Optional[int], staged: bool = False) -> float:
        """Predicted seconds to wake `name` from `level` (None: from cold, a boot); `staged`: at Level 2,
        with its checkpoint in the page cache."""
        if level is None:
            return self.boot_s(name)
        if level == 1 and (name, 1) not in self.wake and name in self.level1_prior:
            return self.level1_prior[name]
        if level == 0 and (name, 0) not in self.wake:  # never dearer than a wake that also copies weights
            return self.kv_prior.get(name, self.gate.get(name, self.wake_s(name, 1)))
        if level == 2 and (name, 2) not in self.wake and name in self.staged_wake:
            # Only staged wakes measured (every room made so far staged it in time): the best known number
            # of this model's Level-2 wake, nearer than its boot (the disk's extra is not known).
            return self.staged_wake[name]
        unstaged = self.wake.get((name, level), self.boot_s(name))
        if level == 2 and staged:
            return min(self.staged_s(name) or unstaged, unstaged)
        return unstaged

    def staged_s(self, name: str) -> Optional[float]:
        """A staged Level-2 wake: as measured, else its wake without the reload plus the checkpoint at the
        page cache's measured rate; None while neither is known."""
        if name in self.staged_wake:
            return self.staged_wake[name]
        rate, gb, rest = self.reload_s_per_gb.get(True), self.weights.get(name), self.level1_prior.get(name)
        return None if rate is None or not gb or rest is None else rest + gb * rate

    def sleep_s(self, name: str) -> float:
        return self.sleep.get(name, 1.0)


class Demand:
    def __init__(self, tau_s: float) -> None:  # swap.demand_tau_s
        self.tau_s = tau_s
        self._weight: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def arrived(self, name: str, now: float) -> None:
        self._weight[name] = self._decayed(name, now) + 1.0
        self._at[name] = now

    def rate(self, name: str, now: float) -> float:
        """Requests per second, recent ones weighing most."""
        return self._decayed(name, now) / self.tau_s

    def last(self, name: str) -> float:
        return self._at.get(name, -math.inf)

    def _decayed(self, name: str, now: float) -> float:
        if name not in self._weight:
            return 0.0
        return self._weight[name] * math.exp(-(now - self._at[name]) / self.tau_s)


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else ALPHA * new + (1 - ALPHA) * old
