"""The simulator's answers have vLLM's shapes: every route the router forwards (issue 13),
stream events included, validated against vLLM's own protocol classes in the vLLM venv,
and for the JSON answers key for key against what vLLM serializes.

No engine runs here, only vLLM's pydantic models, so the check takes seconds; it is in this
tier because it needs the vLLM venv.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import wave
from pathlib import Path

import aiohttp
import pytest

from tests.component.conftest import launch_sim_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
CHECKER = Path(__file__).resolve().parent / "vllm_shapes.py"
TEXT_EVENTS = {"response.output_text.delta": "openai.types.responses:ResponseTextDeltaEvent",
               "response.output_text.done": "openai.types.responses:ResponseTextDoneEvent"}
MSGS = [{"role": "user", "content": "hello there"}]


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\1\0" * 8000)
    return out.getvalue()


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


async def _collect(url: str) -> list[dict]:
    cases: list[dict] = []

    def case(name: str, cls: str, answer, exact: bool = True, **dump) -> None:
        cases.append({"name": name, "cls": cls, "answer": answer, "exact": exact, "dump": dump})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def post(path: str, body: dict):
            async with s.post(url + path, json=body) as r:
                return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

        async def get(path: str):
            async with s.get(url + path) as r:
                return r.status, await r.json()

        _, models = await get("/v1/models")
        case("models", "serve.engine.protocol:ModelList", models)
        _, resp = await post("/v1/responses", {"model": "sim-model", "input": "hi", "max_output_tokens": 4})
        case("responses", "openai.responses.protocol:ResponsesResponse", resp)
        _, got = await get(f"/v1/responses/{resp['id']}")
        case("responses retrieve", "openai.responses.protocol:ResponsesResponse", got)
        _, bg = await post("/v1/responses", {"model": "sim-model", "input": "hi", "max_output_tokens": 2000, "background": True})
        case("responses background", "openai.responses.protocol:ResponsesResponse", bg)
        _, cancelled = await post(f"/v1/responses/{bg['id']}/cancel", {})
        case("responses cancel", "openai.responses.protocol:ResponsesResponse", cancelled)
        _, stream = await post("/v1/responses", {"model": "sim-model", "input": "hi", "max_output_tokens": 3, "stream": True})
        for i, event in enumerate(_events(stream)):
            # vLLM's union lacks the text events: it emits openai's own classes for those
            cls = TEXT_EVENTS.get(event["type"], "openai.responses.protocol:StreamingResponsesResponse")
            case(f"responses event {i} {event['type']}", cls, event)
        status, missing = await get("/v1/responses/resp_nope")
        assert status == 404
        case("responses 404", "serve.engine.protocol:ErrorResponse", missing)

        _, msg = await post("/v1/messages", {"model": "sim-model", "max_tokens": 4, "messages": MSGS})
        case("messages", "anthropic.protocol:AnthropicMessagesResponse", msg, exclude_none=True)
        _, stream = await post("/v1/messages", {"model": "sim-model", "max_tokens": 3, "messages": MSGS, "stream": True})
        for i, event in enumerate(_events(stream)):
            # vLLM serializes these with exclude_unset: validate them, keys differ by design
            case(f"messages event {i} {event['type']}", "anthropic.protocol:AnthropicStreamEvent", event, exact=False)
        _, count = await post("/v1/messages/count_tokens", {"model": "sim-model", "messages": MSGS})
        case("count_tokens", "anthropic.protocol:AnthropicCountTokensResponse", count, exclude_none=True)
        status, err = await post("/v1/messages", {"model": "nope", "max_tokens": 4, "messages": MSGS})
        assert status == 404
        case("messages 404", "anthropic.protocol:AnthropicErrorResponse", err)

        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            _, answer = await post(path, {"query": "a", "documents": ["b", "c"]})
            case(path, "pooling.scoring.protocol:RerankResponse", answer)
        for path in ("/score", "/v1/score"):
            _, answer = await post(path, {"queries": "a", "documents": ["b", "c"]})
            case(path, "pooling.scoring.protocol:ScoreResponse", answer)
        _, answer = await post("/pooling", {"input": "a"})
        case("pooling", "pooling.pooling.protocol:PoolingResponse", answer)
        _, answer = await post("/classify", {"input": ["a", "b"]})
        case("classify", "pooling.classify.protocol:ClassificationResponse", answer)
        _, answer = await post("/v2/embed", {"texts": ["a"], "embedding_types": ["float"]})
        case("v2 embed", "pooling.embed.protocol:CohereEmbedResponse", answer)
        _, answer = await post("/tokenize", {"prompt": "hello"})
        case("tokenize", "serve.tokenize.protocol:TokenizeResponse", answer)
        _, answer = await post("/detokenize", {"tokens": [107, 104]})
        case("detokenize", "serve.tokenize.protocol:DetokenizeResponse", answer)

        for kind, module in (("transcriptions", "transcription"), ("translations", "translation")):
            name = module.capitalize()
            for stream in (False, True):
                form = aiohttp.FormData()
                form.add_field("file", _wav(), filename="a.wav", content_type="audio/wav")
                form.add_field("model", "sim-model")
                form.add_field("stream", "true" if stream else "false")
                async with s.post(url + f"/v1/audio/{kind}", data=form) as r:
                    text = await r.text()
                if stream:
                    for i, event in enumerate(_events(text)):  # serialized with exclude_unset, like Anthropic's events
                        case(f"{kind} event {i}", f"speech_to_text.{module}.protocol:{name}StreamResponse", event, exact=False)
                else:
                    case(kind, f"speech_to_text.{module}.protocol:{name}Response", json.loads(text))
    return cases


def test_every_simulated_route_has_vllms_shape(vllm_venv, tmp_path):
    # 10 tokens/s: the background response runs >= 6.4 s (no EOS before 64 words), so its cancel finds it running
    # on a loaded machine too (at 100,000/s it had ended first, and the cancel was a 400, as vLLM's would be).
    sim = launch_sim_engine(tmp_path, "--sim-token-rate", "10", env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    try:
        cases = asyncio.run(_collect(sim.url))
    finally:
        sim.stop()
    (tmp_path / "cases.json").write_text(json.dumps(cases))  # to rerun the checker by hand
    done = subprocess.run([str(vllm_venv / "bin" / "python"), str(CHECKER)], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=240)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), done.stderr[-3000:]
    bad = [r for r in results if not r["ok"]]
    assert not bad, "\n".join(json.dumps(r)[:700] for r in bad)
    assert len(cases) > 40  # the streams were really read


async def _spec_cases(url: str) -> list[dict]:
    """Answers of a speculative sim with --per-request-spec-decode-metrics: the whole answer validates
    as vLLM's, and its `metrics.speculative_decoding` has exactly vLLM's keys."""
    cases: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for path, cls in (("/v1/completions", "openai.completion.protocol:Completion"),
                          ("/v1/chat/completions", "openai.chat_completion.protocol:ChatCompletion")):
            body = {"model": "sim-model", "max_tokens": 16, "ignore_eos": True}
            body.update({"messages": MSGS} if "chat" in path else {"prompt": "hello"})
            async with s.post(url + path, json=body) as r:
                answer = await r.json()
            async with s.post(url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                last = _events(await r.text())[-1]
            for name, one, kind in ((path, answer, "Response"), (f"{path} stream usage event", last, "StreamResponse")):
                cases.append({"name": name, "cls": cls + kind, "answer": one, "exact": False, "dump": {}})
                cases.append({"name": f"{name} metrics", "cls": "generate.base.protocol:SpeculativeDecodingMetrics",
                              "answer": one["metrics"]["speculative_decoding"], "exact": True, "dump": {"exclude_none": True}})
    return cases


def test_the_simulators_per_request_acceptance_has_vllms_shape(vllm_venv, tmp_path):
    sim = launch_sim_engine(tmp_path, "--speculative-config", '{"num_speculative_tokens": 3}',
                            "--per-request-spec-decode-metrics", "summary")
    try:
        cases = asyncio.run(_spec_cases(sim.url))
    finally:
        sim.stop()
    done = subprocess.run([str(vllm_venv / "bin" / "python"), str(CHECKER)], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=240)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases) == 8, done.stderr[-3000:]
    bad = [r for r in results if not r["ok"]]
    assert not bad, "\n".join(json.dumps(r)[:700] for r in bad)
