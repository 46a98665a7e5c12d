"""Every vLLM route the router forwards (issue 13), through the real router process, driven by
the real `openai` and `anthropic` SDKs, against simulated engines; answers compared with the
engine's own direct answers.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import struct
import wave

import aiohttp
import anthropic
import openai
import pytest

from tests.support import RouterProcess, client, direct, eventually, http, roster_dict, sim_model

pytestmark = pytest.mark.timeout(60)

KEY = "sk-endpoints-client-4b2e"
ADMIN = "sk-endpoints-admin-77c1"
TERSE_KEY = "sk-endpoints-terse-only-9d03"  # scoped to the LoRA adapter `terse` alone
STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def roster(**sections) -> dict:
    return roster_dict(
        # A context long enough for a background response still running when a test cancels it on a loaded machine.
        sim_model("chat", default=True, group="g", env=STORE, args=("--enable-lora", "--lora-modules", "terse=/adapters/terse",
                                                                    "--max-model-len", "32768")),
        sim_model("other", group="g", env=STORE),
        auth={"api_keys": ["${EP_CLIENT}"], "admin_key": "${EP_ADMIN}",
              "keys": [{"key": "${EP_TERSE}", "name": "terse-only", "models": ["terse"]}]},
        listen={"max_body_mb": 1}, **sections)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    r = RouterProcess(roster(), tmp_path_factory.mktemp("endpoints"), env={"EP_CLIENT": KEY, "EP_ADMIN": ADMIN, "EP_TERSE": TERSE_KEY},
                      admin_key=ADMIN)
    asyncio.run(r.wait_ready())
    yield r
    assert r.stop() == 0, r.log()


def wav(seconds: float = 0.5, freq: float = 440.0) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        n = int(16000 * seconds)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * i / 16000))) for i in range(n)))
    return out.getvalue()


def anthropic_client(router: RouterProcess, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=router.url, api_key=key, max_retries=0, timeout=30)


async def post(router: RouterProcess, path: str, body, key: str = KEY, base: str | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post((base or router.url) + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.json(content_type=None)


async def engine_url(router: RouterProcess, name: str) -> str:
    return f"http://127.0.0.1:{(await router.engine(name))['port']}"


def without_ids(answer):
    """An answer with the fields that differ per call (ids, timestamps) blanked."""
    if isinstance(answer, dict):
        return {k: ("*" if k in ("id", "created", "created_at", "item_id") else without_ids(v)) for k, v in answer.items()}
    if isinstance(answer, list):
        return [without_ids(v) for v in answer]
    return answer


# -- Responses -----------------------------------------------------------------------------------

async def test_responses_create_and_retrieve_through_the_sdk(router):
    c = client(router, KEY)
    created = await c.responses.create(model="chat", input="tell me about presses", max_output_tokens=8, temperature=0)
    assert created.object == "response" and created.status == "incomplete" and created.output_text
    fetched = await c.responses.retrieve(created.id)
    assert (fetched.id, fetched.output_text) == (created.id, created.output_text)
    same = await (await direct(router, "chat")).responses.create(model="chat", input="tell me about presses", max_output_tokens=8, temperature=0)
    assert same.output_text == created.output_text
    with pytest.raises(openai.NotFoundError, match="resp_unknown"):
        await c.responses.retrieve("resp_unknown")


async def test_a_streamed_response_is_pinned_too_and_its_events_pass_through(router):
    c = client(router, KEY)
    events = [e async for e in await c.responses.create(model="chat", input="stream it", max_output_tokens=6, temperature=0, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert kinds.count("response.output_text.delta") == 6
    final = events[-1].response
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (await c.responses.retrieve(final.id)).output_text == final.output_text


async def test_retrieve_and_cancel_go_to_the_creating_engine_and_wake_it(router):
    c = client(router, KEY)
    created = await c.responses.create(model="other", input="remember me", max_output_tokens=4, temperature=0)
    await ask_chat(c)  # the group holds one awake engine: `other` is parked now
    assert (await router.engine("other"))["state"] == "sleeping"
    fetched = await c.responses.retrieve(created.id)
    assert fetched.output_text == created.output_text
    assert (await router.engine("other"))["state"] == "awake"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        await c.responses.cancel(created.id)  # the engine's own answer, from the engine that has it


async def test_a_background_response_can_be_cancelled_through_the_router(router):
    c = client(router, KEY)
    # Its EOS ignored (vLLM's ResponsesRequest.ignore_eos), it runs 15 s at the sim's 2,000 tokens/s: the cancel finds it
    # running on a loaded machine (an answer that ends at its EOS, ~160 tokens, is over in 80 ms).
    created = await c.responses.create(model="chat", input="slow", max_output_tokens=30000, temperature=0, background=True,
                                       extra_body={"ignore_eos": True})
    assert created.status in ("queued", "in_progress")
    cancelled = await c.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert (await c.responses.retrieve(created.id)).status == "cancelled"


async def test_a_follow_up_without_model_continues_on_the_engine_of_its_previous_response(router):
    c = client(router, KEY)
    first = await c.responses.create(model="other", input="one", max_output_tokens=4, temperature=0)
    status, body = await post(router, "/v1/responses", {"input": "two", "previous_response_id": first.id, "max_output_tokens": 4})
    assert status == 200 and body["model"] == "other" and body["previous_response_id"] == first.id, body


async def test_a_key_scoped_to_an_adapter_retrieves_cancels_and_continues_its_own_responses_only(router):
    c = client(router, TERSE_KEY)
    created = await c.responses.create(model="terse", input="tell me about presses", max_output_tokens=8, temperature=0)
    assert (await c.responses.retrieve(created.id)).output_text == created.output_text
    background = await c.responses.create(model="terse", input="slow", background=True, temperature=0, max_output_tokens=30000,
                                          extra_body={"ignore_eos": True})  # still running when cancelled (see above)
    assert (await c.responses.cancel(background.id)).status == "cancelled"
    # a follow-up naming no model continues under the adapter, not the base model the key may not use
    status, body = await post(router, "/v1/responses", {"input": "and then?", "previous_response_id": created.id,
                                                        "max_output_tokens": 4}, key=TERSE_KEY)
    assert status == 200 and body["model"] == "terse" and body["previous_response_id"] == created.id, body
    # the base model's responses stay out of its reach, as if they did not exist
    base = await client(router, KEY).responses.create(model="chat", input="not yours", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError, match="not found"):
        await c.responses.retrieve(base.id)
    status, body = await post(router, "/v1/responses", {"input": "x", "previous_response_id": base.id}, key=TERSE_KEY)
    assert status == 400 and body["error"]["code"] == "missing_model", body  # no default model the key may use


async def ask_chat(c: openai.AsyncOpenAI) -> str:
    answer = await c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content


# -- Anthropic Messages ------------------------------------------------------------------------------

async def test_anthropic_messages_stream_and_not_and_count_tokens(router):
    messages = [{"role": "user", "content": "Say something about presses."}]
    async with anthropic_client(router) as a:
        message = await a.messages.create(model="chat", max_tokens=8, messages=messages, extra_body={"temperature": 0})
        assert message.type == "message" and message.stop_reason == "max_tokens" and message.content[0].text
        async with a.messages.stream(model="chat", max_tokens=8, messages=messages, extra_body={"temperature": 0}) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == message.content[0].text and final.usage.output_tokens == 8
        counted = await a.messages.count_tokens(model="chat", messages=messages)
        assert counted.input_tokens == message.usage.input_tokens
    status, direct_answer = await post(router, "/v1/messages", {"model": "chat", "max_tokens": 8, "messages": messages, "temperature": 0},
                                       base=await engine_url(router, "chat"))
    assert status == 200 and direct_answer["content"][0]["text"] == message.content[0].text


async def test_anthropic_errors_have_anthropics_shape_and_sdk_classes(router):
    async with anthropic_client(router, key="wrong") as a:
        with pytest.raises(anthropic.AuthenticationError, match="x-api-key"):
            await a.messages.create(model="chat", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    async with anthropic_client(router) as a:
        with pytest.raises(anthropic.NotFoundError, match="The model 'nope' does not exist"):
            await a.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.NotFoundError):
            await a.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])
    for body, headers, status, kind in [
        (b"{not json", {"Content-Type": "application/json"}, 400, "invalid_request_error"),
        (b'{"model": "chat"}', {"Content-Type": "text/plain"}, 400, "invalid_request_error"),
        (b"{}", {"Content-Type": "application/json", "x-api-key": "wrong"}, 401, "authentication_error"),
    ]:
        got, _, answer = await http(router, "POST", "/v1/messages", data=body, headers={"x-api-key": KEY, **headers})
        assert got == status and answer == {"type": "error", "error": {"type": kind, "message": answer["error"]["message"]}}, answer
    # a wrong Bearer on an OpenAI route keeps OpenAI's shape: x-api-key only counts on /v1/messages*
    got, _, answer = await http(router, "POST", "/v1/completions", json={"model": "chat", "prompt": "x"}, headers={"x-api-key": KEY})
    assert got == 401 and answer["error"]["code"] == "invalid_api_key"


# -- audio -----------------------------------------------------------------------------------

# The SDK marks its translations call deprecated; vLLM still serves /v1/audio/translations, so the router passes it on.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
async def test_audio_transcription_and_translation_through_the_sdk(router):
    c = client(router, KEY)
    audio = wav()
    text = (await c.audio.transcriptions.create(model="chat", file=("hello.wav", audio, "audio/wav"))).text
    same = (await (await direct(router, "chat")).audio.transcriptions.create(model="chat", file=("hello.wav", audio, "audio/wav"))).text
    assert text and text == same
    other_audio = (await c.audio.transcriptions.create(model="chat", file=("x.wav", wav(freq=880), "audio/wav"))).text
    assert other_audio != text  # the engine got the bytes we sent, not some other upload
    assert (await c.audio.translations.create(model="chat", file=("hello.wav", audio, "audio/wav"))).text


async def test_multipart_model_in_any_position_default_and_stream(router):
    audio = wav(0.2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def send(fields: list[tuple[str, object]]) -> tuple[int, str, str]:
            form = aiohttp.FormData()
            for name, value in fields:
                if name == "file":
                    form.add_field("file", value, filename="a.wav", content_type="audio/wav")
                else:
                    form.add_field(name, value)
            async with s.post(router.url + "/v1/audio/transcriptions", data=form, headers={"Authorization": f"Bearer {KEY}"}) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.text()

        first = await send([("model", "chat"), ("file", audio)])
        last = await send([("file", audio), ("language", "en"), ("model", "chat")])
        default = await send([("file", audio)])
        assert first[0] == last[0] == default[0] == 200
        assert json.loads(first[2])["text"] == json.loads(last[2])["text"] == json.loads(default[2])["text"]
        status, ctype, body = await send([("file", audio), ("model", "chat"), ("stream", "true")])
        assert status == 200 and ctype.startswith("text/event-stream") and body.rstrip().endswith("data: [DONE]"), body[-200:]
        status, _, body = await send([("file", audio), ("model", "nope")])
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


# -- pooling, scoring, tokenizer ---------------------------------------------------------------

POOLING = [
    ("/v1/rerank", {"query": "press", "documents": ["a printing press", "a cat"]}),
    ("/rerank", {"query": "press", "documents": ["a printing press", "a cat"], "top_n": 1}),
    ("/v2/rerank", {"query": "press", "documents": ["a printing press", "a cat"]}),
    ("/score", {"queries": "press", "documents": ["a printing press", "a cat"]}),
    ("/v1/score", {"text_1": "press", "text_2": "a printing press"}),
    ("/v2/embed", {"texts": ["press"], "embedding_types": ["float"]}),
    ("/pooling", {"input": "press"}),
    ("/classify", {"input": ["press", "cat"]}),
    ("/tokenize", {"prompt": "hello presses"}),
    ("/detokenize", {"tokens": [107, 104, 111]}),
]


@pytest.mark.parametrize("path,body", POOLING, ids=[p for p, _ in POOLING])
async def test_pooling_and_tokenizer_routes_answer_like_the_engine(router, path, body):
    for model in ({"model": "chat"}, {}):  # named, and the default model
        status, through = await post(router, path, {**body, **model})
        assert status == 200, through
        status, straight = await post(router, path, {**body, "model": "chat"}, base=await engine_url(router, "chat"))
        assert status == 200 and without_ids(through) == without_ids(straight)


async def test_embeddings_through_the_sdk(router):
    c = client(router, KEY)
    answer = await c.embeddings.create(model="chat", input=["a", "b"])
    assert len(answer.data) == 2 and len(answer.data[0].embedding) == 16


# -- models, default model -------------------------------------------------------------------------

async def test_models_list_adapters_with_parent_and_get_one(router):
    c = client(router, KEY)
    listed = {m.id: m for m in (await c.models.list()).data}
    assert set(listed) == {"chat", "other", "terse"}
    assert listed["terse"].parent == "chat" and listed["chat"].parent is None
    assert listed["terse"].root == "/adapters/terse"  # the adapter's card, as the engine reported it
    assert (await c.models.retrieve("terse")).parent == "chat"
    with pytest.raises(openai.NotFoundError):
        await c.models.retrieve("nope")


async def test_an_adapter_name_routes_to_its_engine_and_answers_differently(router):
    c = client(router, KEY)
    base = await c.completions.create(model="chat", prompt="hello", max_tokens=6, temperature=0)
    adapted = await c.completions.create(model="terse", prompt="hello", max_tokens=6, temperature=0)
    assert adapted.model == "terse" and adapted.choices[0].text != base.choices[0].text
    straight = await (await direct(router, "chat")).completions.create(model="terse", prompt="hello", max_tokens=6, temperature=0)
    assert straight.choices[0].text == adapted.choices[0].text


async def test_without_a_default_model_a_request_without_model_gets_a_400_listing_the_names(start_router):
    r = await start_router(roster_dict(sim_model("a"), sim_model("b", aliases=["bee"])))
    status, _, body = await http(r, "POST", "/v1/completions", json={"prompt": "x"})
    assert status == 400 and body["error"]["code"] == "missing_model"
    assert "Name one of: a, b, bee" in body["error"]["message"]
    status, _, body = await http(r, "POST", "/tokenize", json={"prompt": "x"})
    assert status == 400 and "Name one of" in body["error"]["message"]
    form = aiohttp.FormData()
    form.add_field("file", wav(0.1), filename="a.wav", content_type="audio/wav")
    status, _, body = await http(r, "POST", "/v1/audio/transcriptions", data=form)
    assert status == 400 and body["error"]["code"] == "missing_model" and "Name one of: a, b, bee" in body["error"]["message"]


async def test_requests_are_counted_per_route_family(router):
    await post(router, "/tokenize", {"prompt": "x"})

    async def counted() -> bool:
        async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics", headers=router.admin_headers) as r:
            text = await r.text()
        return 'endpoint="tokenize",model="chat",status="200"' in text

    await eventually(counted, 5, what="a tokenize request counted")


def test_an_oversized_upload_is_refused_at_the_limit_without_reading_the_rest(router):
    """The body never ends (chunked, no last chunk): only a router that stops reading at
    listen.max_body_mb (1 MB here) can answer at all; one that buffered the form would hang."""
    import socket

    head = (b"--b0\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nchat\r\n"
            b"--b0\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n")
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: multipart/form-data; boundary=b0\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(b"%x\r\n%s\r\n" % (len(head), head))
        chunk = b"\0" * 65536
        try:
            for _ in range(18):  # 1.1 MB of audio, then the stream just stops (no terminating chunk)
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router may close as soon as it has answered
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"max_body_mb" in answer


async def test_an_upload_with_a_content_length_over_the_limit_gets_413_and_the_router_is_unharmed(router):
    c = client(router, KEY)
    with pytest.raises(openai.APIStatusError) as raised:
        await c.audio.transcriptions.create(model="chat", file=("big.wav", b"\0" * (1024 * 1024 + 10), "audio/wav"))
    assert raised.value.status_code == 413 and "max_body_mb" in raised.value.message
    assert (await c.audio.transcriptions.create(model="chat", file=("a.wav", wav(0.1), "audio/wav"))).text
