"""Waking an engine: the end of a boot (the handshake), the sleep ladder's rungs and the steps down each,
the staged wake's steps back up (its stage first at Level 2), and one engine's climb that runs them
between the Engine's transitions (engines/engine.py keeps the states and every transition)."""

from engines.waking.ladder import KV_PARKED, SleepPolicy, rungs
from engines.waking.stage import Stager
from engines.waking.steps import PHASES, Step, phases

__all__ = ["KV_PARKED", "PHASES", "SleepPolicy", "Stager", "Step", "phases", "rungs"]
