"""Logprob drift: how far a canary's per-token logprobs moved from the cold-boot baseline's.

vLLM's open wake bugs can leave a target numerically wrong while its greedy tokens still
match: FP8 KV-cache scales reset to 1.0 on wake (vLLM #45617), discarded KV pages remapped
with undefined contents (#44972). Acceptance and the output check cannot see that; the
logprobs of the tokens it chose can. The drift is the mean, over the positions where both
canaries chose the same token (up to where they first diverge), of |logprob_after -
logprob_baseline|, in nats. A mean, not a maximum: on a GPU a healthy engine's numbers move
a little with the batch it runs in, and one outlier token should not cost a cold restart;
a wake bug moves them all (a scale) or many (a page of the cache). The largest is reported
with it. How the default threshold was measured: docs/gate.md.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence


class Drift(NamedTuple):
    mean: float
    largest: float
    at: int  # the position of the largest
    positions: int  # compared: the tokens before the first that differs
    identical: bool  # every token the same, and as many


def logprob_drift(texts_a: Sequence[str], logprobs_a: Sequence[float],
                  texts_b: Sequence[str], logprobs_b: Sequence[float]) -> Optional[Drift]:
    """The drift of b from a; None when their first tokens already differ (nothing to compare)."""
    positions = 0
    for ta, tb in zip(texts_a, texts_b):
        if ta != tb:
            break
        positions += 1
    if positions == 0:
        return None
    deltas = [abs(logprobs_b[i] - logprobs_a[i]) for i in range(positions)]
    at = max(range(positions), key=deltas.__getitem__)
    identical = positions == len(texts_a) == len(texts_b)
    return Drift(sum(deltas) / positions, deltas[at], at, positions, identical)


def describe(drift: Drift, limit: Optional[float] = None) -> str:
    """`0.41 > 0.05 over 64 tokens, tokens identical (largest 0.93 at token 17)` (without `limit`, no `> 0.05`)."""
    over = "tokens identical" if drift.identical else "up to where the tokens diverge"
    beyond = "" if limit is None else f" > {limit:g}"
    return f"{drift.mean:.2g}{beyond} over {drift.positions} tokens, {over} (largest {drift.largest:.2g} at token {drift.at})"
