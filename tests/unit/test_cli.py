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
import yaml

from config import EXAMPLES

REPO = Path(__file__).resolve().parents[2]
HOTSWAP = [sys.executable, "-m", "router.cli"]


@pytest.fixture
def fake_router():
    """A stand-in for a running router's /admin/status, for `hotswap status`."""

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"ready": True, "booted": True, "engines": [], "last_swap": None, "swaps": [],
                               "placement": {"devices": [], "host": {"ram_budget_gb": 8, "level1_gb": 0}}}).encode()
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
    run = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -1', "bash", *HOTSWAP, "check", "--config",
                          str(roster)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.stdout == f"source: {roster}\n"
    assert run.stderr == ""
    assert run.returncode == 141


def test_the_output_is_whole_when_nobody_leaves():
    run = subprocess.run([*HOTSWAP, "schema"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and json.loads(run.stdout)["title"] == "RosterFile"


# -- check: valid, but will it run here? ---------------------------------------------------

def test_check_warns_about_engine_programs_not_on_path_and_still_exits_0(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "my-engine").write_text("#!/bin/sh\n")
    (bin_dir / "my-engine").chmod(0o755)
    roster = tmp_path / "roster.yaml"
    roster.write_text(
        "models:\n"
        "  - name: a\n"                                                 # 2
        "    model: /m/a\n"                                             # default launcher: vllm
        "  - name: b\n"                                                 # 4
        "    model: /m/b\n"
        "    launcher: [no-such-engine, serve]\n"                       # 6
        "  - name: c\n"
        "    command: [/nonexistent/engine, --port, '{port}']\n"        # 8
        "  - name: d\n"
        "    command: [my-engine, --port, '{port}']\n"                  # on PATH
        "  - name: e\n"
        "    model: /m/e\n"
        "    launcher: [python, -m, engines.sim, serve]\n"              # the router's own python
        "  - name: f\n"
        "    url: http://127.0.0.1:9000\n"                              # not started by the router
        "defaults: {weights_gb: 1}\n"                                   # sized: no warning of that here
    )
    run = subprocess.run([*HOTSWAP, "check", "--config", str(roster)], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PATH": str(bin_dir)})
    assert run.returncode == 0
    assert run.stderr.splitlines() == [
        f"{roster}:2:5: models[0].launcher: 'vllm' is not on PATH (install vLLM in this environment, or set launcher to its full path)",
        f"{roster}:6:16: models[1].launcher: 'no-such-engine' is not on PATH (install it in this environment, or set launcher to its full path)",
        f"{roster}:8:15: models[2].command: '/nonexistent/engine' is not an executable file",
        f"{roster}: 3 warnings; the roster is valid",
    ]
    assert "\n# GPU 0 " in run.stdout and yaml.safe_load(run.stdout)["models"][0]["name"] == "a", "the roster, then its placement"


def test_a_launcher_from_defaults_is_reported_once_where_it_is_written(tmp_path: Path):
    roster = tmp_path / "roster.yaml"
    roster.write_text("defaults:\n  launcher: [no-such-vllm, serve]\n  weights_gb: 1\nmodels:\n  - {name: a, model: /m/a}\n  - {name: b, model: /m/b}\n")
    run = subprocess.run([*HOTSWAP, "check", "--config", str(roster)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert run.stderr.splitlines() == [
        f"{roster}:2:14: defaults.launcher: 'no-such-vllm' is not on PATH (install it in this environment, or set launcher to its full path)",
        f"{roster}: 1 warning; the roster is valid",
    ]


def test_check_warns_of_a_glob_that_matches_a_virtual_model_but_not_all_its_members(tmp_path: Path):
    roster = tmp_path / "roster.yaml"
    roster.write_text(
        "auth:\n"
        "  keys:\n"
        "    - {key: '${APP_KEY}', name: app, models: [embed, 'chat-*']}\n"      # 3: a glob over chat models
        "    - {key: '${WHOLE_KEY}', name: whole, models: [chat-any]}\n"          # the virtual model, written as it is
        "defaults: {launcher: [python, -m, engines.sim, serve], weights_gb: 1}\n"
        "models:\n"
        "  - {name: chat-a, model: /m/a}\n"
        "  - {name: chat-b, model: /m/b, aliases: [b]}\n"
        "  - {name: private, model: /m/p}\n"
        "virtual_models:\n"
        "  - {name: chat-any, models: [private, chat-a]}\n"
        "  - {name: chat-hidden, models: [private]}\n"
        "  - {name: chat-pair, models: [chat-a, b]}\n"                          # b is chat-b: within the glob
    )
    run = subprocess.run([*HOTSWAP, "check", "--config", str(roster)], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "APP_KEY": "app-secret", "WHOLE_KEY": "whole-secret"})
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        f"{roster}:3:54: auth.keys[0].models[1]: 'chat-*' matches virtual model 'chat-any' but not its member(s) private: "
        "through it this key reaches only chat-a; to give the key the whole virtual model, add 'chat-any' to its models",
        f"{roster}:3:54: auth.keys[0].models[1]: 'chat-*' matches virtual model 'chat-hidden' but not its member(s) private: "
        "this key cannot use 'chat-hidden' at all (404); to give the key the whole virtual model, add 'chat-hidden' to its "
        "models",
        f"{roster}: 2 warnings; the roster is valid",
    ]


def test_check_of_the_demo_roster_warns_about_nothing():
    run = subprocess.run([*HOTSWAP, "check", "--config", str(EXAMPLES / "demo.yaml")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (0, "")


@pytest.fixture
def not_a_router():
    """A URL that answers 200 with whatever `answers` holds: a web page, or another service's JSON."""
    answers: dict[str, tuple[str, bytes]] = {}

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            kind, body = answers["now"]
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("command", ["status", "activity"])
@pytest.mark.parametrize("kind, body, found", [
    ("text/html; charset=utf-8", b"<html><body>Welcome to nginx!</body></html>", "not a hotswap router: text/html"),
    ("application/json", b'{"status": "ok", "version": "1.2"}', "not a hotswap router: JSON without"),
    ("application/json", b"[1, 2, 3]", "not a hotswap router: a JSON list, not an object"),
    ("application/json", b"{not json", "not a hotswap router: its application/json is not JSON"),
])
def test_a_url_that_answers_200_but_not_as_a_router_is_named_as_such_with_exit_1(command, kind, body, found, not_a_router):
    url, answers = not_a_router
    answers["now"] = (kind, body)
    run = subprocess.run([*HOTSWAP, command, "--url", url], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run
    assert run.stderr.startswith(f"hotswap {command}: {url}/admin/{command}: {found}"), run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""


@pytest.mark.parametrize("command, body", [
    ("status", {"ready": True, "booted": True, "placement": "none", "engines": 3, "last_swap": None}),
    ("activity", {"enabled": True, "records": [{"at": "yesterday"}]}),
])
def test_an_answer_with_the_right_keys_and_the_wrong_contents_is_an_error_not_a_traceback(command, body, not_a_router):
    url, answers = not_a_router
    answers["now"] = ("application/json", json.dumps(body).encode())
    run = subprocess.run([*HOTSWAP, command, "--url", url], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run
    assert run.stderr.startswith(f"hotswap {command}: {url}/admin/{command}: not a hotswap router's"), run.stderr


def test_status_tells_a_staged_level2_sleeper_the_page_cache_it_fills_and_what_was_woken_ahead():
    """An operator reading `hotswap status` at 3 a.m. sees which parked checkpoint is already in the
    page cache (its wake reads RAM), how much of host.page_cache_budget_gb staging holds, and which
    engines the router woke before anyone asked, with the outcome."""
    from router.cli import status

    def engine(name, state, level, staging, woken_ahead=None):
        return {"name": name, "state": state, "action": None, "pin": False, "for_s": 3.0, "sleep_level": level,
                "devices": [0], "gpu_share": 0.4, "wake_estimate_s": 1.0, "in_flight": 0, "queued": 0,
                "baseline_mal": None, "observed_mal": None, "restarts": 0, "last_verdict": None, "failure": None,
                "staging": staging, "woken_ahead": woken_ahead}

    off = {"enabled": True, "staged": False, "running": False}
    page = status.render({
        "ready": True, "booted": True, "last_swap": None, "swaps": [],
        "placement": {"devices": [], "host": {"ram_budget_gb": 64, "level1_gb": 12, "page_cache_budget_gb": 96.0,
                                              "staged_gb": 54.0},
                      "wake_ahead": [{"engine": "phi", "from_level": 1, "ago_s": 42.4, "chance": 0.8, "outcome": "used"},
                                     {"engine": "qwen", "from_level": 2, "ago_s": 90.0, "chance": 0.3, "outcome": "unused"}]},
        "engines": [engine("gemma", "sleeping", 2, {**off, "staged": True}), engine("qwen", "sleeping", 2, {**off, "running": True}),
                    engine("mixtral", "sleeping", 2, off), engine("small", "sleeping", 0, off),
                    engine("phi", "awake", None, off, {"engine": "phi", "outcome": "pending"})]})
    rows = {line.split()[0]: line for line in page.splitlines() if line.startswith("  ") and line.split()[0] in
            ("gemma", "qwen", "mixtral", "small", "phi")}
    assert "page cache staged ahead: 54.00 of 96.00 GB (host.page_cache_budget_gb)" in page
    assert "2 (staged)" in rows["gemma"] and "2 (staging)" in rows["qwen"]
    assert "2 (" not in rows["mixtral"] and "0 (KV)" in rows["small"]
    assert "awake (woken ahead)" in rows["phi"]
    assert "woken ahead: phi from level 1 42s ago: used, qwen from level 2 90s ago: unused" in page


def test_status_and_activity_say_the_unit_of_every_number_and_one_word_for_sleeping():
    from router.cli import activity, status

    page = status.render({"ready": True, "booted": True, "engines": [], "last_swap": None, "swaps": [],
                          "placement": {"devices": [{"index": 0, "memory_gb": 80, "planned": 0.9, "residual": 0.0125,
                                                     "free": 0.0875, "engines": {"a": "sleeping 0.0125", "b": "awake 0.9"}}],
                                        "host": {"ram_budget_gb": 8, "level1_gb": 0}}})
    lines = page.splitlines()
    assert lines[1] == "GPU 0 (80 GB), shares of it: awake 0.90, residual 0.01, free 0.09  (a sleeping 0.0125, b awake 0.9)"
    assert "DRIFT last/limit" in lines[3] and "max" not in lines[3]  # the drift's limit, gate.max_logprob_drift
    assert activity.header().split()[7:13] == ["WAIT", "s", "TTFB", "s", "TOTAL", "s"]


def test_activity_marks_a_stream_that_was_paused_and_resumed_or_cut_though_its_status_reads_200():
    from router.cli import activity

    base = {"at": 0.0, "key_name": None, "model": "a", "engine": "a", "peer": None, "endpoint": "chat", "status": 200,
            "found_awake": True, "swap_id": None, "queue_wait_s": 0.0, "ttfb_s": 0.05, "duration_s": 4.0, "prompt_tokens": 3,
            "completion_tokens": 40, "mean_acceptance_length": None, "class": "interactive"}
    mark = {name: activity.cells({**base, **extra})[-1] for name, extra in {
        "plain": {"resumed": None, "paused_s": None, "cut": None},
        "older router": {},  # its records have no such keys
        "resumed": {"resumed": "drain_deadline,preempted", "paused_s": 3.1234, "cut": None},
        "cut": {"resumed": None, "paused_s": None, "cut": "tools"},
        "both": {"resumed": "restart", "paused_s": 0.42, "cut": "wait"},
    }.items()}
    assert mark == {"plain": "-", "older router": "-", "resumed": "resumed ×2 (drain_deadline, preempted) paused 3.1 s",
                    "cut": "cut: tools", "both": "resumed ×1 (restart) paused 0.4 s; cut: wait"}
    assert activity.header().split()[-1] == "RESUMED/CUT" and len(activity.COLUMNS) == len(activity.WIDTHS)
