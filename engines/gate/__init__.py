"""Judging an engine: the canary, the verdict against its cold-boot baseline, logprob drift, the gate step
of a boot or a wake, and one engine's record of all of it (`GateRecord`)."""

from engines.gate.canary import FROM_ANSWER, FROM_COUNTERS, Canary, Counters, answer_spec_counts, mean_acceptance_length, read_counters
from engines.gate.record import GateRecord
from engines.gate.verdict import Verdict

__all__ = ["FROM_ANSWER", "FROM_COUNTERS", "Canary", "Counters", "GateRecord", "Verdict", "answer_spec_counts",
           "mean_acceptance_length", "read_counters"]
