"""An answer's numbers (router.proxy.forward.read_numbers): read once from its end, in the relay path, and handed
to both the acceptance watch and the activity log; never its text."""

from __future__ import annotations

import json
from types import SimpleNamespace

from config.schema import Activity, Gate
from engines.gate import GateRecord, canary
from router.admin.activity import ActivityLog
from router.proxy import forward

BODY = json.dumps({"choices": [{"text": 'a "usage": {"prompt_tokens": 999} trap'}],
                   "usage": {"prompt_tokens": 7, "completion_tokens": 16, "total_tokens": 23},
                   "metrics": {"speculative_decoding": {"num_spec_steps": 10, "num_accepted_draft_tokens": 8}}}).encode()


def test_the_numbers_come_from_the_answers_usage_and_its_own_acceptance_never_its_text():
    numbers = forward.read_numbers(BODY)
    assert (numbers.prompt_tokens, numbers.completion_tokens, numbers.spec, numbers.mean_acceptance_length) == (7, 16, (10, 8), 1.8)
    stream_tail = (b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}\n\n'
                   b"data: [DONE]\n\n")
    assert forward.read_numbers(stream_tail) == (3, 5, None) and forward.read_numbers(stream_tail).mean_acceptance_length is None
    anthropic = b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":4,"output_tokens":2}}\n\n'
    assert forward.read_numbers(anthropic) == (4, 2, None)
    assert forward.read_numbers(b'data: {"usage":{"prompt_to') == (None, None, None)  # a tail cut inside the event
    assert forward.read_numbers(None) == forward.read_numbers(b"") == (None, None, None)


def test_one_answer_is_parsed_once_for_the_acceptance_watch_and_the_activity_log(monkeypatch):
    parses = []
    real = canary.spec_counts
    monkeypatch.setattr(canary, "spec_counts", lambda numbers: parses.append(numbers) or real(numbers))
    gate = GateRecord(Gate())
    engine = SimpleNamespace(has_draft=True, gate=gate)
    request: dict = {}

    forward._answered(request, engine, BODY)  # the relay path, as the engine's answer ends
    numbers = request[forward.ANSWER_NUMBERS]
    log = ActivityLog(Activity(ring=10))
    log.request_done(key_name="team", model="b", engine="b", peer=None, endpoint="completions", status=200, found_awake=True, swap_id=None,
                     queue_wait_s=0.0, ttfb_s=None, duration_s=0.1, prompt_tokens=numbers.prompt_tokens,
                     completion_tokens=numbers.completion_tokens, mean_acceptance_length=numbers.mean_acceptance_length)

    assert len(parses) == 1, "the answer's metrics object is parsed once"
    assert (gate.midlife._answer_steps, gate.midlife._answer_accepted) == (10, 8), "the watch's window got the answer's own counts"
    [record] = log.query()
    assert (record.prompt_tokens, record.completion_tokens, record.mean_acceptance_length) == (7, 16, 1.8)
    assert "trap" not in json.dumps(record.as_dict())
