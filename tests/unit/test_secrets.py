"""Secrets in an engine's command line and environment never show: not in `hotswap check`'s
printout, not in the engine's log file (config.secrets, used by both)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from config import load_roster
from config.secrets import mask_argv
from engines.process.engine_process import EngineProcess

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"ENGINE_KEY": "sk-engine-2f9c41", "HF_SECRET": "hf_a8b7c6d5e4", "S3_URL": "s3://bucket/creds-77aa",
           "MODELS": "/secret-mount-91"}
ROSTER = """
    models:
      - name: a
        model: ${MODELS}/a
        speculative: {model: "${MODELS}/a-draft", num_speculative_tokens: 2}
        launcher: [python, -c, "import time; time.sleep(30)"]
        args: [--api-key, "${ENGINE_KEY}", "--hf-token=hf_literal_in_file", --load-format, runai_streamer,
               "--model-loader-extra-config={\\"url\\": \\"${S3_URL}\\"}", --max-model-len, "4096"]
        env: {VLLM_API_KEY: "${ENGINE_KEY}", HF_HOME: /cache, SOME_URL: "${S3_URL}", OMP_NUM_THREADS: "${THREADS:-4}"}
      - name: b
        command: [python, -c, "pass", --port, "{port}", --api-key=literal-b-key, "${HF_SECRET}"]
      - name: c
        url: "http://ops:literal-url-pw@10.0.0.5:8001/v1-proxy"
"""


def write_roster(tmp_path: Path) -> Path:
    path = tmp_path / "roster.yaml"
    path.write_text(textwrap.dedent(ROSTER))
    return path


def test_check_prints_no_engine_secret_from_args_command_or_env(tmp_path):
    run = subprocess.run([sys.executable, "-m", "router.cli", "check", "--config", str(write_roster(tmp_path))],
                         cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **SECRETS})
    assert run.returncode == 0, run.stderr
    for secret in (*SECRETS.values(), "hf_literal_in_file", "literal-b-key", "literal-url-pw"):
        assert secret not in run.stdout + run.stderr, secret
    a, b, c = yaml.safe_load(run.stdout)["models"]
    # what is no secret stays readable, a fallback written in the file included
    assert a["args"] == ["--api-key", "***", "--hf-token=***", "--load-format", "runai_streamer",
                         '--model-loader-extra-config={"url": "***"}', "--max-model-len", "4096"]
    assert a["env"] == {"VLLM_API_KEY": "***", "HF_HOME": "/cache", "SOME_URL": "***", "OMP_NUM_THREADS": "4"}
    assert a["model"] == "***/a"
    assert a["speculative"] == {"model": "***/a-draft", "num_speculative_tokens": 2}, "it is argv too (--speculative-config)"
    assert b["command"] == ["python", "-c", "pass", "--port", "{port}", "--api-key=***", "***"]
    assert c["url"] == "http://***@10.0.0.5:8001/v1-proxy", "a url's userinfo is a secret, however it was written"


def test_an_error_about_an_attached_engines_url_shows_it_without_its_password(tmp_path):
    roster = tmp_path / "roster.yaml"
    roster.write_text("models:\n  - name: c\n    url: http://ops:${PW}@10.0.0.5:8001\n    tls_ca_file: /etc/ssl/ca.pem\n")
    run = subprocess.run([sys.executable, "-m", "router.cli", "check", "--config", str(roster)],
                         cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PW": "pw-from-env-42"})
    assert run.returncode != 0 and "models[0].tls_ca_file: applies only to an engine attached by an https:// url" in run.stderr
    assert "url is http://***@10.0.0.5:8001" in run.stderr and "pw-from-env-42" not in run.stdout + run.stderr, run.stderr


async def test_the_engine_log_records_its_command_line_masked(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    spec = load_roster(write_roster(tmp_path)).models[0]
    process = EngineProcess(spec, 9, tmp_path, kill_grace_s=0.5)
    await process.start()
    try:
        header = process.log_path.read_text().splitlines()[0]
    finally:
        await process.stop()
    assert header.startswith("=== hotswap ") and "starting a: " in header
    assert "--api-key *** " in header and "--hf-token=***" in header and '{"url": "***"}' in header, header
    for secret in (*SECRETS.values(), "hf_literal_in_file"):
        assert secret not in header, secret
    assert SECRETS["ENGINE_KEY"] in process.argv  # the engine itself still gets its key


def test_masking_leaves_short_substituted_values_and_other_flags_alone():
    assert mask_argv(["--tensor-parallel-size", "2", "--host", "127.0.0.1"], {"2", "1"}) == [
        "--tensor-parallel-size", "2", "--host", "127.0.0.1"]
    assert mask_argv(["--api_key", "k", "--x", "k"]) == ["--api_key", "***", "--x", "k"]  # vLLM's other spelling
    assert mask_argv(["--api-key"]) == ["--api-key"]  # a flag without its value: nothing to hide


async def test_any_password_an_engine_url_can_carry_becomes_its_basic_auth_and_a_user_it_cannot_is_refused():
    import base64

    import aiohttp

    from config import RosterError, parse_roster
    from engines.vllm import attached_client

    spec = parse_roster("models: [{name: a, url: 'http://ops:p%E2%82%AC@127.0.0.1:1'}]\n", "r.yaml", {}).models[0]
    async with aiohttp.ClientSession() as session:  # a non-latin-1 password: the client used to raise here, at start
        sent = base64.b64encode("ops:p€".encode()).decode()
        assert attached_client(spec, session).headers == {"Authorization": f"Basic {sent}"}
    with pytest.raises(RosterError) as refused:  # Basic auth cannot carry a ':' in the user name: said at check time
        parse_roster("models: [{name: a, url: 'http://o%3Ap:hunter2@127.0.0.1:1'}]\n", "r.yaml", {})
    [issue] = [str(i) for i in refused.value.issues]
    assert "models[0].url" in issue and "may not contain ':'" in issue and "hunter2" not in issue, issue


def test_a_dry_run_tells_the_sizes_it_read_without_the_paths_the_roster_took_from_env(tmp_path):
    from router.scheduling.sizing import simulated_roster  # router → engines → config: this test reaches the top
    checkpoint = tmp_path / "secret-mount-91" / "a"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 1000)
    path = tmp_path / "roster.yaml"
    path.write_text("models:\n  - name: a\n    model: ${MODELS}/a\n")
    _, notes = simulated_roster(load_roster(path, environ={"MODELS": str(checkpoint.parent)}))
    said = "\n".join(notes)
    assert "a: weights" in said and "***/a" in said and str(checkpoint.parent) not in said, said
