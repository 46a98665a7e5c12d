"""The promotion gate's verdict.

The canary and the acceptance arithmetic arrive with the gate issue; until then every
wake is promoted with a 'skipped' verdict, through the same call site.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class Verdict:
    passed: bool
    result: str  # "passed" | "refused" | "allowed" | "skipped"
    reason: str
    baseline_mal: Optional[float] = None
    observed_mal: Optional[float] = None
    output_match: Optional[bool] = None
    seconds: float = 0.0
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def skipped(reason: str) -> Verdict:
    return Verdict(passed=True, result="skipped", reason=reason)
