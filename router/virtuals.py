"""The roster's virtual models made live: each virtual name with its member engines, and which
member serves a request for it now, from what the scheduler knows: who is awake, how loaded, and
how long a wake of each of the others would take.

A member that is awake costs nothing to use; a parked one costs its wake (`Scheduler.predicted_wait`,
the `wake_estimate_s` of /v1/models, which counts the park that makes its room). So `awake` and
`balance` wake a member only when that is the shorter wait, and `first` is the operator's own order.

A key whose scope names a virtual model as it is (`models: [chat]`) reaches all its members through
it, whatever the key's globs say of the members' own names: "any good 8B chat model" is what the key
was given, not the 8Bs themselves. A glob that merely matches a virtual name (`chat-*` over
`chat-any`) gives no member it does not match itself: the operator wrote it for models, and a
virtual model added later must not open a model the key was kept from. Such a key picks among the
members its globs match; with none, the virtual name is unknown to it (`hotswap check` warns of
both: `config.virtual.scope_warnings`).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from config.virtual import VirtualModel
from engines.engine import Engine, State
from router.keys import EVERYTHING, Grant
from router.scheduling import Scheduler, never_fits

# vLLM 0.32's --max-num-seqs for `vllm serve` on an H100/H200-class GPU when the args do not set it
# (vllm/engine/arg_utils.py:2933-2941; 256 on GPUs under 70 GB, 1024 on B200-class ones).
VLLM_DEFAULT_MAX_NUM_SEQS = 1024


class Virtuals:
    def __init__(self, virtual_models: list[VirtualModel], by_name: Mapping[str, Engine]):
        # Members by their model's name (a roster may list one by an alias): the engine is what counts.
        self.table = {v.name: (v, [by_name[m] for m in v.models]) for v in virtual_models}

    def __contains__(self, name: object) -> bool:
        return name in self.table

    def names(self, grant: Grant) -> list[str]:
        """The virtual names `grant` may use: those through which it reaches a member."""
        return [name for name in self.table if self.reachable(grant, name)]

    def reachable(self, grant: Grant, name: str) -> list[Engine]:
        """The members `grant` reaches through virtual name `name`, in roster order (none: not its name)."""
        if name not in self.table or not grant.may_use([name]):
            return []
        members = self.table[name][1]
        return members if grant.names_exactly(name) else [e for e in members if grant.may_use(e.spec.names)]

    def members(self, name: str, grant: Grant = EVERYTHING) -> list[Engine]:
        """Its members `grant` reaches, in roster order, without those a reload is taking away."""
        return [e for e in self.reachable(grant, name) if not e.retiring]

    def pick(self, name: str, scheduler: Scheduler, grant: Grant = EVERYTHING) -> Optional[Engine]:
        """The member a request by `grant` for `name` goes to now; None when it reaches none."""
        reachable = self.reachable(grant, name)
        if not reachable:
            return None
        return pick(self.table[name][0], [e for e in reachable if not e.retiring] or reachable, scheduler)

    def reaches(self, grant: Grant, name: str, engine: Engine) -> bool:
        """Whether `grant`, asking by virtual name `name`, may use member `engine` (a Responses follow-up)."""
        return any(e is engine for e in self.reachable(grant, name))


def pick(virtual: VirtualModel, members: Sequence[Engine], scheduler: Scheduler) -> Engine:
    """The member to send a request for `virtual` to now (`members`: in roster order, none retiring)."""
    awake = [e for e in members if e.state is State.AWAKE and e.name not in scheduler.busy]
    if virtual.pick == "first":
        return awake[0] if awake else members[0]
    least_loaded = min(awake, key=lambda e: e.in_flight, default=None)  # min keeps the first of equals: roster order
    parked = [e for e in members if e not in awake]
    queued_s = queue_wait_s(least_loaded) if least_loaded is not None and parked and virtual.pick == "balance" else 0.0
    if least_loaded is not None and not queued_s:
        return least_loaded  # the common case: no parked member's wake to predict
    soonest = _soonest(scheduler, parked)
    if least_loaded is None:
        return soonest[0] if soonest else members[0]  # none can be placed: the first says why in its 503
    return soonest[0] if soonest and queued_s > soonest[1] else least_loaded


def _soonest(scheduler: Scheduler, parked: Sequence[Engine]) -> Optional[tuple[Engine, float]]:
    """The parked member with the shortest predicted wait, and that wait, of those that can be placed and
    have not failed (a failed one is retried when asked for by its own name, or when no other member can serve)."""
    now = scheduler.clock()
    waits = [(e, scheduler.predicted_wait(e, now)) for e in parked
             if never_fits(scheduler.engines, e) is None and e.state is not State.FAILED]
    return min(waits, key=lambda pair: pair[1], default=None)


def max_num_seqs(engine: Engine) -> int:
    text = engine.spec.flag("--max-num-seqs")
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else VLLM_DEFAULT_MAX_NUM_SEQS


def queue_wait_s(engine: Engine) -> float:
    """How long a request sent to `engine` now would wait in vLLM's own queue: the requests past its
    `--max-num-seqs` ahead of it, served `max_num_seqs` at a time at the engine's measured time in flight
    (0 while none has finished, as nothing says yet that it is slow)."""
    slots = max_num_seqs(engine)
    ahead = engine.in_flight + 1 - slots
    mean_s = engine.leases.mean_held_s
    if ahead <= 0 or mean_s is None:
        return 0.0
    return ahead / slots * mean_s
