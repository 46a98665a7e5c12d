"""The worker extension in the engine's own Python: the folder the router puts first on a launched
engine's PYTHONPATH, and what the router says when vLLM still cannot import the extension.

vLLM usually lives in an environment of its own (a venv, a conda env, the vLLM image), where hotswap
is not installed; yet `--worker-extension-cls engines.vllm_worker.HotswapWorkerExtension` makes vLLM's
worker import `engines.vllm_worker` (vllm/v1/worker/worker_base.py:297 in vLLM 0.32). So the router
copies that package, and nothing else of hotswap, into a folder of its own once per process
(`directory()`), read-only, and removes it when it exits. The folder holds `engines/vllm_worker/*.py`
and no `engines/__init__.py`: `engines` there is a namespace portion, which yields to any regular
package of that name on the engine's path. So it shadows nothing (not another `engines` in vLLM's
environment, nor hotswap's own where it is installed, as in the vLLM image), and `config`, `router`,
`tests` and the rest of `engines` are never on vLLM's path. The worker extension imports only the
standard library, torch and vllm (tests/unit/test_layout.py holds it to that), so the copy is whole.

The folder is a copy, not a link: the engine runs the code of the router that started it, even when
the checkout or the installed package changes while the router runs.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

WORKER_EXTENSION = "engines.vllm_worker.HotswapWorkerExtension"
EXTENSION_PACKAGE = WORKER_EXTENSION.rpartition(".")[0]

_built: Optional[Path] = None


def build(root: Path) -> Path:
    """Copy the worker extension's package, read-only, into `root` (an empty folder); returns `root`."""
    spec = importlib.util.find_spec(EXTENSION_PACKAGE)  # finds it without running it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{EXTENSION_PACKAGE} is not installed beside the router")
    source = Path(list(spec.submodule_search_locations)[0])
    target = root.joinpath(*EXTENSION_PACKAGE.split("."))
    for path in sorted(source.rglob("*.py")):
        copy = target / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        copy.chmod(0o444)
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        folder.chmod(0o555)
    root.chmod(0o555)  # an engine run by another user (a launcher that switches user) reads it too
    return root


def directory() -> Path:
    """This router's folder holding the worker extension alone: built at its first use, removed at exit."""
    global _built
    if _built is None or not _built.is_dir():
        _built = build(Path(tempfile.mkdtemp(prefix="hotswap-worker-")))
        atexit.register(remove, _built)
    return _built


def remove(root: Path) -> None:
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        try:
            folder.chmod(0o755)  # a read-only folder's entries cannot be deleted
        except OSError:
            pass
    shutil.rmtree(root, ignore_errors=True)


def pythonpath(existing: Optional[str]) -> str:
    """An engine's PYTHONPATH: the extension's folder first, then what the roster's `env` or the
    router's environment set."""
    return os.pathsep.join([str(directory()), *([existing] if existing else [])])


def gets_path(argv: list[str], command: bool) -> bool:
    """Whether a managed engine's environment gets the folder: every engine the router launches
    (`vllm serve`, any `launcher`), except a `command:` (its environment is the operator's) and one
    that runs the router's own interpreter (`launcher: [python, ...]`, the simulator): that Python
    imports hotswap's packages already, and a namespace portion ahead of an editable install would
    hide them."""
    return not command and bool(argv) and argv[0] != sys.executable


# --- when vLLM's Python still cannot import it -----------------------------------------------------

# What vLLM 0.32 logs when the class cannot be imported: the worker's traceback ("WorkerProc failed to
# start.", v1/executor/multiproc_executor.py:953), through v1/worker/worker_base.py:297 and
# utils/import_utils.py:122 (importlib.import_module), ending in this line; the API server's own last
# lines only say "Engine core initialization failed. See root cause above." (v1/engine/utils.py:1431).
_MISSING = re.compile(r"(?:ModuleNotFoundError|ImportError): No module named '(engines(?:\.vllm_worker[\w.]*)?)'")
_VLLM_FRAME = re.compile(r'File "(/[^"]*?)/lib/(python3\.\d+)/(?:site|dist)-packages/vllm/')


def import_failure(output: str, program: str, given: bool) -> Optional[str]:
    """What to tell the operator when an engine's output shows vLLM failing to import the extension;
    `given`: the router put the folder on the engine's PYTHONPATH (`gets_path`)."""
    missing = _MISSING.search(output)
    if missing is None:
        return None
    frames = _VLLM_FRAME.findall(output[: missing.start()])
    python = f"{frames[-1][0]}/bin/{frames[-1][1]}" if frames else f"the Python that {program} runs"
    cause = ("a package named `engines` in that environment hides the router's" if missing[1] != "engines"
             else "nothing on that Python's path holds it")
    if given:
        fix = (f"The router puts a folder holding only the extension first on the engine's PYTHONPATH ({_built}); "
               "a launcher that sets PYTHONPATH must keep that entry (one that runs vLLM in a container must "
               "mount the folder and put it on the container's PYTHONPATH)")
    else:
        fix = ("The router adds nothing to a `command:` engine's PYTHONPATH: put a folder holding "
               "engines/vllm_worker/ on it yourself")
    return (f"vLLM could not import the worker extension {WORKER_EXTENSION} ({missing[0]}) in its Python, "
            f"{python}: {cause}. {fix}. See docs/operators.md, \"vLLM in its own environment\"")
