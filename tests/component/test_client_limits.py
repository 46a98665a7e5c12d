"""What a client may make the router read, and for how long: bodies bounded by listen.max_body_mb
whatever they are made of, heads and bodies bounded in time (listen.client_header_timeout_s,
listen.client_body_timeout_s), through a real router process over raw sockets (no client
library would send these)."""

from __future__ import annotations

import asyncio
import http.client
import json
import io
import math
import select
import socket
import struct
import time
import wave

import pytest

from tests.support import RouterProcess, roster_dict, sim_model

pytestmark = pytest.mark.timeout(60)

MB = 1024 * 1024
TIMEOUT_S = 1  # both client timeouts: short, so a test sees them pass in seconds


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    listen = {"max_body_mb": 1, "client_header_timeout_s": TIMEOUT_S, "client_body_timeout_s": TIMEOUT_S}
    r = RouterProcess(roster_dict(sim_model("chat", default=True), listen=listen), tmp_path_factory.mktemp("limits"))
    asyncio.run(r.wait_ready())
    yield r
    assert r.stop() == 0, r.log()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def read_answer(sock: socket.socket) -> tuple[bytes, dict]:
    """The status line and JSON body of one answer with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the router closed without an answer (got {data[:200]!r})"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head.split(b"\r\n")[0], json.loads(body[:length])


def test_a_form_of_empty_parts_with_long_names_is_cut_at_max_body_mb_not_read_whole(router):
    """Part data is not all a form is made of: 4000 parts with 7.9 kB names and no data are 32 MB
    of boundaries and part headers. The router answers 413 once the body passes 1 MB, while the
    client still has most of it to send, and holds no more than about the limit meanwhile."""
    name = b"n" * 7900
    part = b"--b0\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n\r\n" % name
    parts = 4000
    before = rss_bytes(router.proc.pid)
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: multipart/form-data; boundary=b0\r\nTransfer-Encoding: chunked\r\n\r\n")
        sent = 0
        try:
            while sent < parts and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                sent += 1
            if sent == parts:
                sock.sendall(b"8\r\n--b0--\r\n\r\n0\r\n\r\n")  # the closing boundary, the last chunk
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router may close once it has answered
        status, answer = read_answer(sock)
    assert status.startswith(b"HTTP/1.1 413"), (status, answer)
    assert answer["error"]["code"] == "body_too_large" and "max_body_mb" in answer["error"]["message"], answer
    assert sent < parts / 2, f"the router answered only after {sent} of {parts} parts ({sent * len(part) / MB:.1f} MB)"
    grown = rss_bytes(router.proc.pid) - before
    assert grown < parts * len(part) / 4, f"the router's RSS grew by {grown / MB:.1f} MB for a 1 MB limit"


def test_a_chunked_json_body_over_the_limit_gets_413_in_openais_shape(router):
    """No Content-Length to refuse up front: the limit is found while reading."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b'{"prompt": "' + b"x" * 65536
        try:
            for _ in range(32):  # 2 MB that would never end
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, answer = read_answer(sock)
    assert status.startswith(b"HTTP/1.1 413") and answer["error"]["code"] == "body_too_large", (status, answer)
    assert set(answer["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, anthropic", [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_a_body_nested_too_deeply_gets_400_invalid_json_in_the_routes_shape(router, path, anthropic):
    """400 KB of '[' is within max_body_mb, but json's parser recurses once per level: past Python's stack
    it is still the client's malformed JSON, never the router's 500."""
    body = b"[" * 400_000
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (path.encode(), len(body)) + body)
        status, answer = read_answer(sock)
    assert status.startswith(b"HTTP/1.1 400"), (status, answer)
    if anthropic:
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    else:
        assert answer["error"]["code"] == "invalid_json" and set(answer["error"]) == {"message", "type", "param", "code"}
    assert "nested too deeply" in answer["error"]["message"], answer
    assert "RecursionError" not in router.log()


def test_no_depth_of_nesting_is_a_500_even_where_the_router_rewrites_the_body(router):
    """A body without `model` is rewritten for the default model, and json's encoder recurses from a frame or
    two deeper than its parser did: at some depth a body that parsed cannot be encoded again. Every depth
    around Python's stack limit is answered by the engine or with the client's 400, never a 500."""
    answered: dict[int, list[int]] = {}
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
    try:
        for depth in range(800, 1_100):
            body = b'{"prompt": "hi", "max_tokens": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            answered.setdefault(answer.status, []).append(depth)
    finally:
        conn.close()
    assert set(answered) == {200, 400}, {status: depths[:5] for status, depths in answered.items()}
    assert max(answered[200]) < min(answered[400]), "shallower bodies are served, deeper ones refused"


def until_closed(sock: socket.socket, within: float) -> bytes:
    """Everything the router sends until it closes the connection; fails if it is still open after `within` s."""
    sock.settimeout(within)
    data = b""
    deadline = time.monotonic() + within
    try:
        while chunk := sock.recv(65536):
            data += chunk
            sock.settimeout(max(0.01, deadline - time.monotonic()))
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"the connection is still open after {within} s (got {data[:200]!r})") from None
    return data


def test_a_client_that_never_finishes_its_head_is_disconnected_after_the_header_timeout(router):
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        assert until_closed(sock, within=5 * TIMEOUT_S) == b""  # no head, no request to answer


def test_a_client_that_stops_halfway_through_its_body_gets_a_408_and_is_disconnected(router):
    body = json.dumps({"model": "chat", "prompt": "hello", "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body[: len(body) // 2]))
        answer = until_closed(sock, within=5 * TIMEOUT_S)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"connection: close" in head.lower(), head
    error = json.loads(payload)["error"]
    assert error["code"] == "client_body_timeout" and "listen.client_body_timeout_s" in error["message"], error


def wav(seconds: float = 0.2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(i / 5))) for i in range(int(16000 * seconds))))
    return out.getvalue()


def test_a_slow_client_whose_bytes_keep_coming_is_never_cut(router):
    """The body timeout bounds the pause between two arrivals, not the whole body (as nginx's): a
    form whose part headers trickle in 10 bytes at a time, each header line taking longer than the
    timeout to arrive, is answered."""
    form = (b"--b0\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nchat\r\n"
            b"--b0\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
            + wav() + b"\r\n--b0--\r\n")
    headers = form.index(b"\r\n\r\n", form.index(b"a.wav")) + 4
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b0\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(form))
        for i in range(0, headers, 10):
            sock.sendall(form[i:min(i + 10, headers)])
            time.sleep(TIMEOUT_S / 4)  # the client's pace (5 s in all), not a wait for the router
        sock.sendall(form[headers:])
        answer = until_closed(sock, within=30)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    assert json.loads(payload)["text"]
