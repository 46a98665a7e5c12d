"""What a client may make the router read: bodies bounded by listen.max_body_mb whatever they are
made of, through a real router process over raw sockets (no client library would send these)."""

from __future__ import annotations

import asyncio
import json
import select
import socket

import pytest

from tests.support import RouterProcess, roster_dict, sim_model

pytestmark = pytest.mark.timeout(60)

MB = 1024 * 1024


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    r = RouterProcess(roster_dict(sim_model("chat", default=True), listen={"max_body_mb": 1}), tmp_path_factory.mktemp("limits"))
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
