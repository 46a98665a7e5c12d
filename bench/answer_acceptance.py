"""What reading an answer's own acceptance costs the proxy (issue 23, item 4).

    .venv/bin/python bench/answer_acceptance.py

For a speculative engine the proxy hands every successful buffered answer (and a stream's last
pieces) to `engines.gate.canary.answer_spec_counts`: a substring search, then a parse of the
`metrics.speculative_decoding` object alone. This times it on a short and a long completion,
with and without the metrics, in this process (best of 5 × 20 000 calls). A benchmark, not a test.
"""

from __future__ import annotations

import json
import timeit

from engines.gate import answer_spec_counts

SPEC = {"mean_acceptance_length": 2.5, "draft_acceptance_rate": 0.5, "acceptance_histogram": [1, 0, 2, 1],
        "num_spec_steps": 4, "num_accepted_draft_tokens": 6, "num_draft_tokens": 12, "num_spec_tokens": 3}


def main() -> None:
    print("| completion tokens | body bytes | metrics | µs per answer |\n| --- | --- | --- | --- |")
    for tokens in (16, 1024):
        answer = {"id": "cmpl-x", "choices": [{"text": "tok " * tokens}], "usage": {"completion_tokens": tokens}}
        for with_metrics in (True, False):
            body = json.dumps({**answer, "metrics": {"speculative_decoding": SPEC}} if with_metrics else answer).encode()
            seconds = min(timeit.repeat(lambda: answer_spec_counts(body), number=20000, repeat=5)) / 20000
            print(f"| {tokens} | {len(body)} | {'yes' if with_metrics else 'no'} | {seconds * 1e6:.2f} |")


if __name__ == "__main__":
    main()
