"""Issue 13's routes through the real router in front of a real `vllm serve` on CPU: Responses
(stream and not, retrieve), Anthropic Messages, /tokenize, and a tiny LoRA adapter built
offline, each answer equal to the engine's own direct answer, before and after a Level-2
sleep and wake (whose gate also runs the adapter's canary: gate.lora_canary).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest
import yaml

from tests.integration.harness import BOOT_TIMEOUT_S, http, poll
from tests.integration.live_router import LiveRouter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "config" / "examples" / "vllm-cpu.yaml"
NAME, ADAPTER = "tiny-ep", "tiny-lora"
PROMPT = "The router wakes the model and"
MESSAGES = [{"role": "user", "content": "the cat sees the ball"}]


@pytest.fixture(scope="module")
def adapter(vllm_venv: Path, tiny_models: Path) -> Path:
    """tests/integration/tiny_lora.py's adapter for the tiny target, cached by content hash."""
    script = HERE / "tiny_lora.py"
    key = hashlib.sha256(script.read_bytes() + str(tiny_models).encode()).hexdigest()[:16]
    out = Path(os.environ.get("HOTSWAP_TINY_MODELS_CACHE") or Path.home() / ".cache" / "hotswap" / "tiny-models") / f"lora-{key}"
    if not (out / "adapter_model.safetensors").exists():
        done = subprocess.run([str(vllm_venv / "bin" / "python"), str(script), str(tiny_models / "target"), str(out)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def roster(adapter: Path) -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(min_active_s=0, max_hold_s=5, drain_timeout_s=30, boot_timeout_s=BOOT_TIMEOUT_S,
                        timeouts={"sleep": 30, "stage": 60, "wake_weights": 30, "reload_draft": 60, "reload_weights": 60,
                                  "wake_kv_cache": 30, "reset_prefix_cache": 30, "gate": 60})
    data["models"] = [{
        "name": NAME, "model": "${HOTSWAP_TINY_MODELS}/target", "default": True, "sleep_level": 2,
        "args": ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", "8", "--max-loras", "1"],
        "env": {"VLLM_ENABLE_RESPONSES_API_STORE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
        "gate": {"max_tokens": 16, "lora_canary": ADAPTER},
    }]
    return data


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    live = LiveRouter(roster(adapter), tmp_path_factory.mktemp("router"))
    try:
        live.wait_booted(timeout=2 * BOOT_TIMEOUT_S)
        yield live
    finally:
        live.stop()


def answers(base: str) -> dict[str, Any]:
    """The same requests to `base` (the router, or the engine itself): what each answered."""
    def post(path: str, body: dict) -> Any:
        status, answer = http("POST", base + path, body, timeout=120)
        assert status == 200, (path, status, answer)
        return answer

    out: dict[str, Any] = {}
    r = post("/v1/responses", {"model": NAME, "input": PROMPT, "max_output_tokens": 12, "temperature": 0})
    out["responses"] = r["output"][0]["content"][0]["text"]
    out["response_id"] = r["id"]
    m = post("/v1/messages", {"model": NAME, "max_tokens": 12, "messages": MESSAGES, "temperature": 0})
    out["messages"] = m["content"][0]["text"]
    out["tokenize"] = post("/tokenize", {"model": NAME, "prompt": PROMPT})["tokens"]
    for model in (NAME, ADAPTER):
        c = post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        out[model] = c["choices"][0]["text"]
    return out


def test_routes_and_adapter_answer_like_the_engine_before_and_after_a_level2_wake(router: LiveRouter):
    through = answers(router.url)
    direct = answers(router.engine_url(NAME))
    for key in ("responses", "messages", "tokenize", NAME, ADAPTER):
        assert through[key] == direct[key], (key, through[key], direct[key])
    assert through[ADAPTER] != through[NAME]  # the adapter really changes the output
    # the router pinned the response to its engine: retrieve goes there
    status, fetched = http("GET", f"{router.url}/v1/responses/{through['response_id']}")
    assert status == 200 and fetched["output"][0]["content"][0]["text"] == through["responses"], fetched
    # the adapter is listed with its parent
    status, models = http("GET", router.url + "/v1/models")
    cards = {m["id"]: m for m in models["data"]}
    assert cards[ADAPTER]["parent"] == NAME and cards[ADAPTER]["state"] == "awake"

    status, body = http("POST", f"{router.url}/admin/sleep?model={NAME}", timeout=120)
    assert status == 200 and router.engine(NAME)["state"] == "sleeping", body
    after = answers(router.url)  # the first request wakes it (Level 2, gate with the adapter's canary)
    for key in ("responses", "messages", "tokenize", NAME, ADAPTER):
        assert after[key] == through[key], (key, after[key], through[key])
    verdict = router.engine(NAME)["last_verdict"]
    assert verdict["result"] == "passed", verdict


def test_the_anthropic_sdk_streams_through_the_router(router: LiveRouter):
    with anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=120) as a:
        whole = a.messages.create(model=NAME, max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0})
        with a.messages.stream(model=NAME, max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0}) as stream:
            streamed = "".join(stream.text_stream)
        assert streamed == whole.content[0].text
        with pytest.raises(anthropic.NotFoundError):
            a.messages.create(model="nope", max_tokens=8, messages=MESSAGES)
    events = list(router.client().responses.create(model=NAME, input=PROMPT, max_output_tokens=6, temperature=0, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text
    poll(lambda: http("GET", f"{router.url}/v1/responses/{events[-1].response.id}")[0] == 200, 10, "streamed response retrievable")


def test_runtime_adapter_loading_is_an_admin_action_on_real_vllm(router: LiveRouter, adapter: Path):
    status, body = http("POST", router.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter)})
    assert status == 404, body  # never forwarded from a client
    status, body = http("POST", f"{router.url}/admin/lora/load?model={NAME}", {"lora_name": "again", "lora_path": str(adapter)},
                        timeout=120)
    assert status == 200 and body["adapters"] == sorted([ADAPTER, "again"]), body
    same = router.client().completions.create(model="again", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    first = router.client().completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert same == first  # the same weights under a second name
    status, body = http("POST", f"{router.url}/admin/lora/unload?model={NAME}", {"lora_name": "again"}, timeout=120)
    assert status == 200 and body["adapters"] == [ADAPTER], body
    status, body = http("POST", router.url + "/v1/completions", {"model": "again", "prompt": PROMPT, "max_tokens": 4})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
