"""Bad input through raw HTTP: the router never answers 500 itself, never crashes, leaks no state or secrets."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support import RouterProcess, roster_dict, sim_model

CLIENT_KEY = "sk-fuzz-client-7d1f"
ADMIN_KEY = "sk-fuzz-admin-93ab"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    roster = roster_dict(sim_model("a", default=True), sim_model("b", spec=True, aliases=["bee"]),
                         auth={"api_keys": ["${FUZZ_CLIENT}"], "admin_key": "${FUZZ_ADMIN}"}, listen={"max_body_mb": 1})
    r = RouterProcess(roster, tmp_path_factory.mktemp("fuzz"), env={"FUZZ_CLIENT": CLIENT_KEY, "FUZZ_ADMIN": ADMIN_KEY},
                      admin_key=ADMIN_KEY)
    asyncio.run(r.wait_ready())
    yield r
    assert r.stop() == 0, r.log()


def send(router: RouterProcess, method: str, target: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for k, v in {"Host": "x", "Content-Length": str(len(body)), **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def assert_openai_error_or_success(status: int, payload: bytes, *, upstream_ok: bool = True) -> None:
    assert status != 500, payload[:300]
    if status >= 400:
        error = json.loads(payload)["error"]
        assert set(error) >= {"message", "type", "code"} and error["message"], error


def assert_anthropic_error_or_success(status: int, payload: bytes) -> None:
    assert status != 500, payload[:300]
    if status >= 400:
        answer = json.loads(payload)
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"} and answer["error"]["message"], answer


JSON_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank", "/rerank", "/v2/rerank",
               "/score", "/v1/score", "/v2/embed", "/pooling", "/classify", "/tokenize", "/detokenize"]
ANTHROPIC_ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
AUDIO_ROUTES = ["/v1/audio/transcriptions", "/v1/audio/translations"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=15,
)
model_values = st.one_of(st.sampled_from(["a", "b", "bee", "A", " a", "a\x00", "", "../a", "a" * 5000]),
                         st.text(max_size=40), st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))


@SETTINGS
@given(body=st.binary(max_size=2000), content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]),
       path=st.sampled_from(JSON_ROUTES + AUDIO_ROUTES + ANTHROPIC_ROUTES))
def test_arbitrary_bytes_get_an_error_in_the_routes_shape_never_a_500(router, body, content_type, path):
    status, payload = send(router, "POST", path, body, {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": content_type})
    (assert_anthropic_error_or_success if path in ANTHROPIC_ROUTES else assert_openai_error_or_success)(status, payload)


@SETTINGS
@given(parts=st.lists(st.tuples(st.sampled_from(["model", "file", "stream", "language", "", "x" * 80]),
                                st.one_of(st.binary(max_size=300), st.sampled_from([b"a", b"b", b"bee", b"nope", b"true", b""]))),
                      max_size=5),
       boundary=st.sampled_from(["b0undary", "x", "--", "a" * 70]), path=st.sampled_from(AUDIO_ROUTES), truncate=st.integers(0, 40))
def test_any_multipart_form_gets_an_openai_error_or_an_answer(router, parts, boundary, path, truncate):
    body = b"".join(b"--%s\r\nContent-Disposition: form-data; name=\"%s\"%s\r\n\r\n%s\r\n" % (
        boundary.encode(), name.encode(), b'; filename="a.wav"' if name == "file" else b"", value) for name, value in parts)
    body += b"--%s--\r\n" % boundary.encode()
    body = body[: len(body) - truncate]
    status, payload = send(router, "POST", path, body, {"Authorization": f"Bearer {CLIENT_KEY}",
                                                        "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert_openai_error_or_success(status, payload)


@SETTINGS
@given(model=model_values, extra=st.dictionaries(st.sampled_from(["prompt", "max_tokens", "stream", "messages", "n", "temperature", "input", "stream_options"]), json_values, max_size=4))
def test_any_json_request_is_routed_or_refused_cleanly(router, model, extra):
    body = json.dumps({"model": model, **extra}).encode()
    status, payload = send(router, "POST", "/v1/completions", body, {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"})
    assert_openai_error_or_success(status, payload)
    if model is None:  # no model: the roster's default (`a`), which may refuse the rest of the body itself
        assert status != 404
    elif not isinstance(model, str) or not model:
        assert status == 400
    elif model not in ("a", "b", "bee"):
        assert status == 404 and json.loads(payload)["error"]["code"] == "model_not_found"


@SETTINGS
@given(document=json_values)
def test_any_json_document_gets_an_openai_error_or_an_answer(router, document):
    status, payload = send(router, "POST", "/v1/chat/completions", json.dumps(document).encode(),
                           {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"})
    assert_openai_error_or_success(status, payload)


@SETTINGS
@given(key=st.one_of(st.text(max_size=60), st.just(CLIENT_KEY + "x"), st.just(CLIENT_KEY[:-1]), st.just(ADMIN_KEY)),
       scheme=st.sampled_from(["Bearer ", "bearer ", "Basic ", "", "Token "]))
def test_only_the_client_key_opens_the_api(router, key, scheme):
    header = (scheme + key).encode("latin-1", "replace").decode("latin-1").replace("\r", "").replace("\n", "")
    status, payload = send(router, "POST", "/v1/completions", json.dumps({"model": "a", "prompt": "x", "max_tokens": 1}).encode(),
                           {"Authorization": header, "Content-Type": "application/json"})
    opened = scheme.lower() == "bearer " and key.strip() == CLIENT_KEY
    assert (status == 200) == opened, (status, header, payload[:200])


@SETTINGS
@given(target=st.one_of(
    st.sampled_from(["/sleep", "//sleep", "/v1/../sleep", "/v1/%2e%2e/sleep", "/%73leep", "/SLEEP", "/collective_rpc",
                     "/v1/../collective_rpc", "/wake_up?tags=weights", "/reset_prefix_cache", "/is_sleeping",
                     "/v1/chat/completions/../../sleep", "/v1//../sleep", "/./sleep", "/v1/completions/..%2f..%2fsleep",
                     "http://127.0.0.1/sleep", "http://localhost:1/collective_rpc", "/sim/faults", "/v1/sim/log",
                     "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/responses/../../sleep", "/v1/responses/x/../../../sleep",
                     "/v1/responses/%2e%2e%2f%2e%2e%2fsleep", "/v1/responses/..%2F..%2Fcollective_rpc/cancel",
                     "/v1/messages/../../collective_rpc", "/v1/audio/../../sleep", "/v2/../sleep", "/pause", "/resume",
                     "/start_profile", "/v1/models/../../sleep", "/v1/models/%2e%2e/%2e%2e/collective_rpc", "/rerank/../sleep",
                     "/tokenize/../wake_up", "/v1/chat/completions/render", "/inference/v1/generate", "/server_info"]),
    st.text(alphabet="/.%a-z2ef_?=&", max_size=30).map(lambda t: "/" + t)),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]), key=st.sampled_from([ADMIN_KEY, CLIENT_KEY]))
def test_no_spelling_reaches_an_engines_dev_endpoints(router, target, method, key):
    status, payload = send(router, method, target, b'{"method": "reload_weights", "lora_name": "x", "lora_path": "/x"}',
                           {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert status in (400, 401, 403, 404, 405) or target in ("/", "/health", "/ready", "/metrics") or target.startswith(
        ("/v1/models", "/admin/status", "/health", "/ready", "/metrics", "/ui")), (method, target, status, payload[:200])
    # what the dev endpoints answer (a JSON key, an rpc's results, vLLM's LoRA text), never an echo of the path
    assert b'"is_sleeping":' not in payload and b'"results":' not in payload and b"Success: LoRA" not in payload
    assert status != 500


def test_after_the_fuzzing_the_router_is_healthy_and_holds_nothing(router):
    # (runs after the property tests in this module: pytest keeps file order)
    assert send(router, "GET", "/health")[0] == 200
    status = asyncio.run(router.status())
    for engine in status["engines"]:
        assert engine["in_flight"] == 0 and engine["queued"] == 0, engine
        assert engine["state"] in ("awake", "sleeping"), engine


def test_no_key_and_no_prompt_text_reaches_the_logs_or_the_metrics(router):
    prompt = "PROMPT-CANARY-5e1c the quick zebra"
    status, _ = send(router, "POST", "/v1/chat/completions",
                     json.dumps({"model": "bee", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}).encode(),
                     {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"})
    assert status == 200
    send(router, "POST", "/v1/completions", json.dumps({"model": prompt, "prompt": "x"}).encode(),
         {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"})  # a 404 that names the model
    send(router, "POST", "/v1/completions", b"{}", {"Authorization": "Bearer " + CLIENT_KEY + "-wrong"})
    metrics = send(router, "GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})[1].decode()
    log = router.log()
    for secret in (CLIENT_KEY, ADMIN_KEY, "PROMPT-CANARY-5e1c"):
        assert secret not in log, f"{secret} in the router log"
        assert secret not in metrics, f"{secret} in /metrics"
    assert "_unknown" in metrics  # the unknown model became one bounded label value, not the client's text
