"""The Responses id -> engine table: bounded, expiring, and the id found in a stream's first bytes."""

from __future__ import annotations

import json

from router.proxy.responses import Pin, ResponseIds, StreamSniffer, id_in_answer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_oldest_ids_are_forgotten_beyond_the_bound():
    ids = ResponseIds(max_ids=3, ttl_s=100)
    for i in range(5):
        ids.remember(f"resp_{i}", f"e{i}")
    assert len(ids) == 3
    assert [ids.engine_of(f"resp_{i}") for i in range(5)] == [None, None, "e2", "e3", "e4"]


def test_a_pin_keeps_the_name_the_response_was_created_under():
    ids = ResponseIds(max_ids=10, ttl_s=60)
    ids.remember("resp_a", "chat", "terse")  # created through the LoRA adapter `terse` of engine `chat`
    ids.remember("resp_b", "chat")
    assert ids.pin("resp_a") == Pin("chat", "terse") and ids.pin("resp_b") == Pin("chat", "chat")
    assert ids.engine_of("resp_a") == "chat" and ids.pin("resp_unknown") is None


def test_an_id_expires_after_its_ttl():
    clock = Clock()
    ids = ResponseIds(max_ids=10, ttl_s=60, clock=clock)
    ids.remember("resp_a", "chat")
    clock.now = 59
    assert ids.engine_of("resp_a") == "chat"
    clock.now = 61
    assert ids.engine_of("resp_a") is None and len(ids) == 0


def test_the_id_is_the_first_in_the_stream_even_when_split_across_chunks():
    found: list[str] = []
    sniffer = StreamSniffer(found.append)
    event = b'event: response.created\ndata: ' + json.dumps(
        {"response": {"id": "resp_42", "output": [{"id": "msg_1"}]}, "type": "response.created"}).encode()
    for i in range(0, len(event), 7):
        sniffer.feed(event[i:i + 7])
        if sniffer.done:
            break
    assert found == ["resp_42"] and sniffer.done


def test_the_sniffer_gives_up_after_its_limit_without_an_id():
    found: list[str] = []
    sniffer = StreamSniffer(found.append)
    while not sniffer.done:
        sniffer.feed(b"x" * 10_000)
    assert found == [] and sniffer.buffer == b""


def test_a_non_stream_answer_yields_its_id_or_none():
    assert id_in_answer(b'{"id": "resp_1", "object": "response"}') == "resp_1"
    assert id_in_answer(b"not json") is None
    assert id_in_answer(b'["resp_1"]') is None
