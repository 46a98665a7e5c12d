"""`hotswap serve --simulate`: the operator's own roster, every engine run by the simulator.

A transformation of the roster, not a second format: names, aliases, groups, devices, shares
(`--gpu-memory-utilization`), sleep levels, draft restore, gates, pins, `swap`, `queue`, `host` and
`gpus` stay as written, so placement, swaps, holds and the gate are decided as `serve` would decide
them on the GPU. What it leaves alone of the real deployment: the activity file and the fleet (peers,
the agent port) are off. Only how each engine is started changes: the simulator's launcher (engines/sim,
the one the demo roster runs) in place of `vllm serve`, a `command:` or a `url:`. The model path is
kept, so the router sizes the checkpoint as it always does (`weights_gb`, else the files); the
sizes are handed in (`sizes`) because reading them is the engines' business, not the roster's.
"""

from __future__ import annotations

from typing import Mapping, Optional

from config.argv import GPU_SHARE_FLAG, LOAD_FORMAT_FLAG
from config.schema import ModelSpec, Roster

# "python" is the router's own interpreter (engines.process), whatever PATH says.
SIM_LAUNCHER = ["python", "-m", "engines.sim", "serve"]
SIM_ACCEPTANCE = 2.6  # engines/sim's default --sim-acceptance (a healthy draft's mean acceptance length)

# The flags a `command:` engine's argv carries that the router reads (its share, its load format, ...),
# carried over to the simulated engine that stands in for it; the rest of that argv is not vLLM's `serve`.
_READ_FLAGS = (GPU_SHARE_FLAG, "--max-num-seqs", "--scheduling-policy", LOAD_FORMAT_FLAG, "--api-key")

# Said once at start: what a dry run shows as on the GPU, and what it cannot.
NOT_MODELLED = (
    "simulated: every engine runs as the simulator (engines/sim). As on the GPU: placement by shares, devices, "
    "groups and gpus, sleep levels under host.ram_budget_gb, swaps, holds (swap.min_active_s, max_hold_s), queues "
    "and the gate. Not modelled: durations (boots, wakes and decoding take the simulator's time, not your GPU's, "
    "disk's or model's), real GPU memory (fits are the router's arithmetic), the answers' text, and vLLM flags the "
    "simulator does not know (ignored)")


def simulate(roster: Roster, sizes: Mapping[str, tuple[Optional[float], str]]) -> tuple[Roster, list[str]]:
    """The roster as `--simulate` runs it, and what was assumed (one line each, to log).

    `sizes`: each model's checkpoint size in GB and where it comes from, or None and why it is
    unknown (engines.memory.weights_gb)."""
    notes = []
    models = []
    for spec in roster.models:
        stand_in, note = _simulated(spec)
        models.append(stand_in)
        if note:
            notes.append(note)
        size, why = sizes.get(spec.name, (None, "not read"))
        if size is None:  # (the router's sizing says why when it reads them again)
            notes.append(f"{spec.name}: weight size unknown: assumed as serve would assume it: it sleeps at level 2, "
                         "never 1 (set weights_gb to see level 1)")
        else:
            notes.append(f"{spec.name}: weights {size:.2f} GB ({why})")
    if roster.gpus is None:
        notes.append("gpus: not in the roster: sizes come from this machine's GPUs (NVML), else placement counts "
                     "shares only; write gpus: [{index: 0, memory_gb: 80}] for the GPU you will rent")
    if roster.host.ram_budget_gb is None:
        notes.append("host.ram_budget_gb: not set: half of this machine's RAM, not the GPU host's; set it to see "
                     "the levels there")
    update: dict[str, object] = {"models": models}
    # What a dry run must not touch of the real deployment: its activity file, its fleet.
    if roster.activity.path is not None:
        update["activity"] = roster.activity.model_copy(update={"path": None})
        notes.append(f"activity.path ({roster.activity.path}): not written; this run's records are kept in memory only")
    if roster.node.peers or roster.node.agent_port:
        update["node"] = roster.node.model_copy(update={"peers": [], "agent_port": None})
        notes.append("node.peers and node.agent_port: off; a request for a model not in this roster is not passed on, "
                     "and no load balancer is told this node exists")
    return roster.model_copy(update=update), notes


def _simulated(spec: ModelSpec) -> tuple[ModelSpec, Optional[str]]:
    # `port` is dropped (picked free): a real engine of this roster may be running on it.
    common = {"launcher": list(SIM_LAUNCHER), "port": None}
    tokens = (spec.speculative or {}).get("num_speculative_tokens")
    # The simulator refuses an acceptance beyond 1 + num_speculative_tokens: with one or two drafted tokens
    # its default (2.6) would fail the boot, so such a draft accepts most of what it drafts.
    knobs = ["--sim-acceptance", f"{1 + 0.8 * tokens:g}"] if isinstance(tokens, int) and 1 + tokens < SIM_ACCEPTANCE else []
    if spec.command is not None:
        args = [part for flag in _READ_FLAGS if (value := spec.flag(flag)) is not None for part in (flag, value)]
        stand_in = spec.model_copy(update={**common, "command": None, "model": spec.name, "args": [*args, *knobs]})
        return stand_in, (f"{spec.name}: its command is not run; a simulated engine stands in, with the flags the "
                          f"router reads from it ({' '.join(args) or 'none'})")
    if spec.url is not None:
        stand_in = spec.model_copy(update={**common, "url": None, "tls_ca_file": None, "model": spec.name,
                                           "args": [*spec.args, *knobs]})
        return stand_in, (f"{spec.name}: attached by url ({spec.shown_url}) on the GPU; here the router starts a "
                          "simulated engine for it")
    return spec.model_copy(update={**common, "args": [*spec.args, *knobs]}), None
