"""The wire format of a resumed answer (router.proxy.resume, router.proxy.continuation): what a stream
records of what its client got, the ids the router asked for kept from the client, and the splice
that writes a continuation's events into the client's stream as the rest of one answer."""

from __future__ import annotations

import json

import pytest

from router.proxy.continuation import Splice, continuation, plan, stops
from router.proxy.resume import COMPACT_BYTES, NotResumable, Paused, Transcript, asking_ids, resumable, strip_prompt_ids


def event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(content=None, ids=None, role=None, finish=None, prompt_ids=None, cid="chatcmpl-1", created=100) -> dict:
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": "a", "choices": [choice]}
    if prompt_ids is not None:
        chunk["prompt_token_ids"] = prompt_ids
    return chunk


def events_of(pieces: list[bytes]) -> list:
    out = []
    for piece in pieces:
        for block in piece.split(b"\n\n"):
            if block.startswith(b"data: "):
                data = block[6:]
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def text_of(events: list) -> str:
    return "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                   for e in events if isinstance(e, dict) for c in e.get("choices", []))


def test_the_prompts_ids_asked_for_by_the_router_never_reach_a_client_that_did_not_ask():
    first = event(chat_chunk("", ids=[], role="assistant", prompt_ids=[5, 6, 7]))
    later = event(chat_chunk(" the", ids=[11]))
    assert [json.loads(p[6:]) for p in strip_prompt_ids([first, later])] == [chat_chunk("", ids=[], role="assistant"),
                                                                             chat_chunk(" the", ids=[11])]
    null = event(chat_chunk(" x")).replace(b'"finish_reason":null', b'"finish_reason":null,"prompt_token_ids":null')
    assert b"prompt_token_ids" not in strip_prompt_ids([null])[0]


def test_a_field_cut_across_two_chunks_is_left_whole_rather_than_broken():
    piece = event(chat_chunk("", role="assistant", prompt_ids=[11, 12]))
    head, tail = piece[:piece.index(b"12")], piece[piece.index(b"12"):]
    assert strip_prompt_ids([head, tail]) == [head, tail]


def test_a_body_asks_for_ids_without_being_encoded_again_and_a_clients_own_choice_wins():
    assert json.loads(asking_ids(b'{"model":"a","stream":true}')) == {"return_token_ids": True, "model": "a", "stream": True}
    assert json.loads(asking_ids(b'{"return_token_ids":false}')) == {"return_token_ids": False}
    assert json.loads(asking_ids(b" {}")) == {"return_token_ids": True}


def test_a_transcript_keeps_text_and_ids_and_parses_only_past_its_budget():
    transcript = Transcript(chat=True)
    transcript.extend([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1, 2, 3]))])
    transcript.extend([event(chat_chunk(" the", ids=[40])), event(chat_chunk(" cat", ids=[41]))])
    assert transcript.first is None and transcript.pieces, "nothing parsed below the budget"
    assert transcript.so_far() == " the cat"
    assert list(transcript.prompt_ids) == [1, 2, 3] and list(transcript.ids) == [40, 41]
    assert transcript.first == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 100, "model": "a"}
    long = Transcript(chat=False)
    piece = event({"id": "c", "choices": [{"index": 0, "text": "x" * 1000, "token_ids": [1], "prompt_token_ids": [9]}]})
    long.extend([piece] * (COMPACT_BYTES // len(piece) + 2))
    assert long.size < len(piece) * 2, "compacted into text and ids"


@pytest.mark.parametrize("chunks, reason", [
    ([chat_chunk("", role="assistant", prompt_ids=[1]), {"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{}]}}]}], "tools"),
    ([chat_chunk("", role="assistant", prompt_ids=[1]), {"error": {"message": "boom"}}], "engine_error"),
    ([chat_chunk(" hi", role="assistant")], "no_token_ids"),
])
def test_what_a_continuation_cannot_follow_is_named(chunks, reason):
    transcript = Transcript(chat=True)
    transcript.extend([event(c) for c in chunks])
    with pytest.raises(NotResumable) as exc:
        transcript.so_far()
    assert exc.value.reason == reason


def test_an_event_that_is_not_json_is_named_and_its_neighbours_are_still_read():
    transcript = Transcript(chat=True)
    transcript.extend([b"data: {not json\n\n", event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1])),
                       event(chat_chunk(" the", ids=[40]))])
    with pytest.raises(NotResumable) as exc:
        transcript.so_far()
    assert exc.value.reason == "malformed"
    assert list(transcript.ids) == [40] and transcript.role_sent


def test_ordinary_events_are_read_by_pattern_and_agree_with_a_parse():
    """Past the first event, those that carry only text and ids are not parsed; escapes, quotes and
    lookalike keys in the text must not fool the patterns."""
    tricky = ['"text":"no', ' \\ back', 'slash\\"', ' "content":"x"', ' é\u00e9', ' [DONE]', '']
    for chat in (True, False):
        chunk = (lambda t, i, **kw: chat_chunk(t, ids=i, **kw)) if chat else (
            lambda t, i, **kw: {"id": "c", "created": 1, "model": "a", "choices": [{"index": 0, "text": t, "token_ids": i,
                                                                                    "finish_reason": None}]})
        first = chat_chunk("", ids=[], role="assistant", prompt_ids=[1]) if chat else {
            "id": "c", "created": 1, "model": "a", "choices": [{"index": 0, "text": "", "prompt_token_ids": [1], "token_ids": []}]}
        events = [event(first)] + [event(chunk(t, [i])) for i, t in enumerate(tricky * 40, start=10)]
        transcript = Transcript(chat=chat)
        transcript.extend(events)
        assert transcript.so_far() == "".join(tricky * 40)
        assert list(transcript.ids) == list(range(10, 10 + len(tricky) * 40)) and not transcript.done


def test_ids_that_came_alone_without_text_are_kept_for_the_seam_to_tell_special_tokens_from_partial_characters():
    transcript = Transcript(chat=True)
    transcript.extend([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1])), event(chat_chunk(" a", ids=[40])),
                       event(chat_chunk("", ids=[2])), event(chat_chunk(" b", ids=[41])), event(chat_chunk("", ids=[42, 43]))])
    assert transcript.so_far() == " a b" and list(transcript.ids) == [40, 2, 41, 42, 43]
    assert transcript.silent == {2}
    long = Transcript(chat=True)  # past the budget too, where ordinary events are read by pattern
    long.extend([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1]))] +
                [event(chat_chunk(" a", ids=[40])), event(chat_chunk("", ids=[2]))] * 200)
    assert long.so_far() == " a" * 200 and long.silent == {2}


def test_a_cut_inside_an_event_cannot_be_resumed():
    transcript = Transcript(chat=False)
    transcript.extend([b'data: {"id":"c","choices":[{"text":" a"'])
    with pytest.raises(NotResumable, match="middle of an event"):
        transcript.so_far()


@pytest.mark.parametrize("body, reason", [
    ({"messages": [], "n": 2}, "n"),
    ({"messages": [], "use_beam_search": True}, "n"),
    ({"messages": [], "response_format": {"type": "json_object"}}, "structured_output"),
    ({"messages": [], "frequency_penalty": 0.5}, "penalties"),
    ({"messages": [], "response_format": {"type": "text"}, "tools": [{}]}, None),
    ({"messages": [], "repetition_penalty": 1.2}, None),  # counted over the prompt and the answer: the same set
    ({"messages": [], "bad_words": ["a b"]}, "bad_words"),
    ({"messages": [], "truncate_prompt_tokens": 100}, "truncation"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "media"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, None),
])
def test_which_requests_can_be_resumed_exactly(body, reason):
    assert resumable("chat", body, anthropic=False) == reason
    assert resumable("responses", {}, anthropic=False) == "shape" and resumable("chat", {}, anthropic=True) == "shape"
    assert resumable("completions", {"prompt": ["a", "b"]}, anthropic=False) == "n"
    assert resumable("completions", {"prompt": [1, 2, 3]}, anthropic=False) is None


def test_a_continuation_starts_from_the_ids_with_its_limits_less_what_was_sent():
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "min_tokens": 10,
            "stream": True, "prompt_logprobs": 1}
    chat = continuation("chat", body, [1, 2, 3, 40, 41], 2)
    assert chat["kv_transfer_params"] == {"prompt_token_ids": [1, 2, 3, 40, 41]} and chat["max_tokens"] == 48
    assert chat["min_tokens"] == 8 and "prompt_logprobs" not in chat and chat["return_token_ids"] is True
    assert chat["stream_options"] == {"include_usage": True} and chat["messages"] == body["messages"]
    done = continuation("completions", {"prompt": "hi", "max_tokens": 5, "echo": True}, [1, 2, 40], 1)
    assert done["prompt"] == [1, 2, 40] and done["max_tokens"] == 4 and done["echo"] is False


def seamed(transcript_text: str, pending="", drop="", stop=(), include_usage=True, include_stop=False) -> tuple[Transcript, Splice]:
    transcript = Transcript(chat=True)
    transcript.extend([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1, 2])),
                       event(chat_chunk(transcript_text, ids=[40, 41]))])
    transcript.so_far()
    return transcript, Splice(transcript, 2, 2, include_usage, pending, drop, tuple(stop), include_stop,
                              before=transcript_text if include_stop else "")


def test_a_client_gets_the_ids_past_the_seam_once():
    transcript = Transcript(chat=True)
    transcript.extend([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1, 2])),
                       event(chat_chunk(" the", ids=[40])), event(chat_chunk(" cat", ids=[41, 42]))])
    transcript.so_far()
    transcript.restart_at(1)  # the seam stepped back to a whole character: the client has 41 and 42 already
    splice = Splice(transcript, 1, 2, False, "", " cat", (), False, before="", beyond=2)
    sent = events_of(splice([event(chat_chunk(" c", ids=[41])), event(chat_chunk("at sat", ids=[42, 43]))]))
    assert text_of(sent) == " sat" and [i for e in sent for c in e["choices"] for i in c.get("token_ids") or []] == [43]
    assert list(transcript.ids) == [40, 41, 42, 43]


def test_the_continuation_reads_as_the_rest_of_the_clients_answer():
    transcript, splice = seamed(" the cat")
    out = splice([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1, 2, 40, 41], cid="other", created=7)),
                  event(chat_chunk(" sat", ids=[42], cid="other", created=7)),
                  event(chat_chunk(" down", ids=[43], finish="length", cid="other", created=7)),
                  event({"id": "other", "created": 7, "model": "a", "choices": [],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}),
                  b"data: [DONE]\n\n"])
    events = events_of(out)
    assert events[-1] == "[DONE]" and len(events) == 4, "the continuation's role delta is the client's second: dropped"
    assert {(e["id"], e["created"]) for e in events[:-1]} == {("chatcmpl-1", 100)}
    assert text_of(events) == " sat down" and not any("prompt_token_ids" in json.dumps(e) for e in events[:-1])
    assert [c["token_ids"] for e in events[:2] for c in e["choices"]] == [[42], [43]], "the answer's ids, as before the seam"
    assert events[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert list(transcript.ids) == [40, 41, 42, 43], "a second cut continues from here"


def test_held_back_text_goes_first_and_text_the_client_has_is_not_sent_twice():
    _, splice = seamed(" the ca", pending="t")
    assert text_of(events_of(splice([event(chat_chunk(" sat", ids=[42]))]))) == "t sat"
    _, splice = seamed(" the cat", drop="t")
    assert text_of(events_of(splice([event(chat_chunk("t sat", ids=[41, 42]))]))) == " sat"


async def test_a_second_pause_before_the_held_back_text_went_out_finds_it_pending_again():
    # The client has " the ca"; vLLM held back the "t" of id 42 (it might have begun a stop string).
    words = {40: " the", 41: " ca", 42: "t", 43: " sat"}

    async def decode(ids: list[int]) -> str:
        return "".join(words[i] for i in ids)

    transcript = Transcript(chat=True)
    transcript.extend([event(chat_chunk("", ids=[], role="assistant", prompt_ids=[1, 2])),
                       event(chat_chunk(" the ca", ids=[40, 41, 42]))])
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
    paused = Paused("restart", "an operator's restart", None, transcript)

    async def planned():
        return await plan(decode, "engine 'a'", "chat", body, paused, lambda b: json.dumps(b).encode())

    first = await planned()
    assert first.splice.pending == "t"
    again = await planned()  # the continuation failed before its first event: nothing of it went out
    assert again.splice.pending == "t" and json.loads(again.body)["kv_transfer_params"]["prompt_token_ids"] == [1, 2, 40, 41, 42]
    assert text_of(events_of(again.splice([event(chat_chunk(" sat", ids=[43]))]))) == "t sat"
    third = await planned()  # and a pause after it: the client has it all, nothing is pending
    assert third.splice.pending == "" and transcript.so_far() == " the cat sat"
    assert json.loads(third.body)["kv_transfer_params"]["prompt_token_ids"] == [1, 2, 40, 41, 42, 43]


def test_a_stop_string_that_begins_in_the_held_back_text_ends_the_answer_at_the_seam():
    # vLLM held back "EN" (it might begin "END"); the continuing engine's own check sees only "D ...".
    _, splice = seamed(" the story", pending="EN", stop=["END"])
    assert splice([event(chat_chunk("D", ids=[42]))]) == [], "held until a match can be told"
    events = events_of(splice([event(chat_chunk(" more", ids=[43]))]))
    assert text_of(events) == "" and events[0]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]" and splice.ended
    _, splice = seamed(" the story", pending="EN", stop=["END"])
    events = events_of(splice([event(chat_chunk("ough", ids=[42], finish="length"))]))
    assert text_of(events) == "ENough", "no match: the window goes out whole"


def test_with_the_stop_string_kept_in_the_output_a_match_may_begin_in_what_the_client_has():
    _, splice = seamed(" the story E", stop=["END"], include_stop=True)
    events = events_of(splice([event(chat_chunk("ND later", ids=[42]))]))
    assert text_of(events) == "ND" and events[0]["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_are_read_as_vllm_takes_them():
    assert stops({"stop": "x"}) == ("x",) and stops({"stop": ["a", "", 3]}) == ("a",) and stops({}) == ()


def test_a_continuation_tells_once_how_long_its_prompt_took_to_its_first_event():
    """The engine's prefill rate, measured where a resume recomputes (the price of a preemption)."""
    transcript, _ = seamed(" the cat")
    told: list[tuple[int, float]] = []
    splice = Splice(transcript, 2, 2, True, "", "", (), False, before="",
                    prefilled=lambda tokens, seconds: told.append((tokens, seconds)))
    splice([event(chat_chunk(" sat", ids=[42]))])
    splice([event(chat_chunk(" down", ids=[43]))])
    [(tokens, seconds)] = told
    assert tokens == 4 and seconds >= 0, "the prompt's 2 tokens and the 2 of the answer it continues"
