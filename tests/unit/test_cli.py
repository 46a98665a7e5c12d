"""The `hotswap` command line as an operator uses it: in pipes, and `check`'s warnings."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from config import EXAMPLES

REPO = Path(__file__).resolve().parents[2]
HOTSWAP = [sys.executable, "-m", "router.cli"]


@pytest.fixture
def fake_router():
    """A stand-in for a running router's /admin/status, for `hotswap status`."""

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"ready": True, "groups": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("command", ["schema", "check", "status"])
def test_a_reader_gone_before_the_output_ends_it_quietly_with_141(command, fake_router):
    args = {"schema": ["schema"], "check": ["check", "--config", str(EXAMPLES / "demo.yaml")],
            "status": ["status", "--url", fake_router]}[command]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write meets a broken pipe
    try:
        run = subprocess.run([*HOTSWAP, *args], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (141, "")


def test_check_piped_into_head_prints_the_first_line_and_no_traceback(tmp_path: Path):
    # Far more output than a pipe holds, so head -1 is gone while check still writes.
    roster = tmp_path / "big.yaml"
    roster.write_text(f"models:\n  - name: a\n    model: /m/a\n    gate: {{prompt: '{'word ' * 100_000}'}}\n")
    run = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -1', "bash", *HOTSWAP, "check", "--config", str(roster)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.stdout == f"source: {roster}\n"
    assert run.stderr == ""
    assert run.returncode == 141


def test_the_output_is_whole_when_nobody_leaves():
    run = subprocess.run([*HOTSWAP, "schema"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and json.loads(run.stdout)["title"] == "RosterFile"
