"""Judging an engine: the canary, the verdict against its cold-boot baseline, logprob drift, the gate step."""
