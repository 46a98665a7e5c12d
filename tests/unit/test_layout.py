"""The layout is part of the design (docs/contributors.md, "The map"): these tests read the code's own
imports with `ast` and hold it to the rules, so the layout stays as it is drawn.

Every import counts: at the top, inside a function, and under `if TYPE_CHECKING:` alike. Each rule is a
function over imports, and each is also shown to fail on an import planted for it (the last section).
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = ("router", "engines", "config")
WINGS = ("proxy", "scheduling", "admin", "cli", "fleet", "trial")
# wing -> the wings it must not import
FORBIDDEN = {
    "proxy": {"admin", "cli"},
    "scheduling": {"proxy", "admin", "cli"},
    "admin": {"cli"},
    "fleet": {"proxy", "admin", "cli"},
}
MAX_WING_MODULES = 12
MAX_TOP_MODULES = 10  # router/*.py: what every wing shares, and what wires them
ENGINE_WINGS = ("gate", "memory", "vllm", "vllm_worker", "process", "sim", "waking")
# engines/ itself keeps one engine's lifecycle: the state machine, its states, leases, progress and watch
ENGINE_TOP = ("engine", "states", "leases", "progress", "watch")
MAX_ENGINE_TOP_MODULES = 8  # engines/*.py, __init__.py included: a module more goes into a wing
MAX_ENGINE_LINES = 400  # engines/engine.py: the states and their transitions; what runs between them lives in wings
# What vLLM's worker process has besides the standard library (the extension runs there).
WORKER_MAY_IMPORT = {"torch", "vllm"}
# What the simulator may know of engines/ outside sim/: what a real vLLM also knows (the files it loads).
SIM_MAY_IMPORT = {"engines.memory.weights"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module (or package) imported
    names: tuple[str, ...]  # `from target import names`; () for `import target`
    where: str  # file:line, for the message


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(*tops: str) -> dict[str, Path]:
    return {module_name(p): p for top in tops for p in sorted((ROOT / top).rglob("*.py"))}


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    return parse_imports(name, path.read_text(), str(path.relative_to(ROOT)), is_package(path), known)


def parse_imports(name: str, text: str, filename: str, package_init: bool, known: dict[str, Path],
                  ours_only: bool = True) -> list[Import]:
    """Every import in `text`, resolved to absolute module names; only of router, engines and config
    unless `ours_only` is False."""
    package = name if package_init else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(text, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, (), where) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            submodules = [a.name for a in node.names if f"{base}.{a.name}" in known]
            others = tuple(a.name for a in node.names if f"{base}.{a.name}" not in known)
            out += [Import(name, f"{base}.{sub}", (), where) for sub in submodules]
            if others or not submodules:
                out.append(Import(name, base, others, where))
    return [i for i in out if not ours_only or i.target.split(".")[0] in PACKAGES]


def edges(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules importing it runs: the target, and each package above the target
    that is not also above the importer (that one is already running)."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        mine = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} | ({name} if is_package(path) else set())
        for imp in imports_of(name, path, known):
            parts = imp.target.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in known and target != name and (target == imp.target or target not in mine):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "router" and len(parts) > 1 and parts[1] in WINGS else None


def engine_wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "engines" and len(parts) > 1 and parts[1] in ENGINE_WINGS else None


KNOWN = sources(*PACKAGES)
ALL_IMPORTS = [imp for name, path in KNOWN.items() for imp in imports_of(name, path, KNOWN)]


def test_there_is_no_import_cycle_anywhere_in_router_engines_or_config():
    found = cycles(edges(KNOWN))
    assert not found, "import cycles (hand the lower module what it needs instead of importing up):\n" + "\n".join(
        " <-> ".join(c) for c in found)


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_a_wing_imports_none_of_the_wings_above_it(wing):
    bad = [f"{i.where}: {i.source} imports {i.target}" for i in ALL_IMPORTS
           if wing_of(i.source) == wing and wing_of(i.target) in FORBIDDEN[wing]]
    assert not bad, f"router.{wing} must not import router.{', router.'.join(sorted(FORBIDDEN[wing]))}:\n" + "\n".join(bad)


def test_the_top_of_the_router_imports_only_scheduling_and_only_app_and_daemon_wire_the_other_wings():
    wiring = {"router.app", "router.daemon"}
    bad = [f"{i.where}: {i.source} imports {i.target}" for i in ALL_IMPORTS
           if i.source.startswith("router") and wing_of(i.source) is None and i.source != "router"
           and wing_of(i.target) not in (None, "scheduling") and not (i.source in wiring and wing_of(i.target) in ("proxy", "admin", "fleet"))]
    assert not bad, "router/*.py shares what the wings use; only app.py and daemon.py wire proxy, admin and fleet in:\n" + "\n".join(bad)


def test_engines_and_config_import_nothing_of_the_router_and_config_nothing_of_engines():
    bad = [f"{i.where}: {i.source} imports {i.target}" for i in ALL_IMPORTS
           if (i.source.split(".")[0] in ("engines", "config") and i.target.split(".")[0] == "router")
           or (i.source.split(".")[0] == "config" and i.target.split(".")[0] == "engines")]
    assert not bad, "router -> engines -> config, one way:\n" + "\n".join(bad)


def test_router_holds_its_wings_and_a_small_top():
    router = ROOT / "router"
    packages = sorted(p.name for p in router.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(WINGS), f"router/'s packages are its wings {sorted(WINGS)}; found {packages}"
    top = sorted(p.name for p in router.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"router/ keeps at most {MAX_TOP_MODULES} modules; has {len(top)}: {top}"
    for wing in WINGS:
        modules = sorted(p.name for p in (router / wing).glob("*.py"))
        assert len(modules) <= MAX_WING_MODULES, f"router/{wing} has {len(modules)} modules (at most {MAX_WING_MODULES}): {modules}"
        assert not [p for p in (router / wing).iterdir() if p.is_dir() and p.name != "__pycache__"], f"router/{wing} has sub-packages"


def exported(wing: str, top: str = "router") -> set[str]:
    tree = ast.parse((ROOT / top / wing / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def outside_imports_of_wings(imports: list[Import]) -> list[str]:
    """Imports from outside a wing that reach past what the wing's __init__ exports."""
    bad = []
    for i in imports:
        wing = wing_of(i.target)
        if wing is None or wing_of(i.source) == wing or wing == "cli":
            continue
        if i.target != f"router.{wing}":
            bad.append(f"{i.where}: {i.target} is inside router.{wing}; import what router.{wing} exports")
        elif missing := set(i.names) - exported(wing):
            bad.append(f"{i.where}: router.{wing} does not export {', '.join(sorted(missing))}")
    return bad


def outside_imports_of_engine_wings(imports: list[Import]) -> list[str]:
    """From the router (or bench/): an engines wing only through what its __init__ exports; the worker
    extension and the simulator never (one runs inside vLLM, the other is a program of its own)."""
    bad = []
    for i in imports:
        wing = engine_wing_of(i.target)
        if wing is None:
            continue
        if wing in ("vllm_worker", "sim"):
            bad.append(f"{i.where}: {i.target}: engines.{wing} is not for the router (it runs in another process)")
        elif i.target != f"engines.{wing}":
            bad.append(f"{i.where}: {i.target} is inside engines.{wing}; import what engines.{wing} exports")
        elif missing := set(i.names) - exported(wing, "engines"):
            bad.append(f"{i.where}: engines.{wing} does not export {', '.join(sorted(missing))}")
    return bad


def test_the_rest_of_the_router_uses_only_the_names_a_wing_exports():
    imports = [i for i in ALL_IMPORTS if i.source.startswith("router")]
    bad = outside_imports_of_wings(imports) + outside_imports_of_engine_wings(imports)
    assert not bad, "\n".join(bad)


def test_the_benchmarks_use_only_the_names_the_wings_export():
    bench = sources("bench")
    imports = [imp for name, path in bench.items() for imp in imports_of(name, path, KNOWN)]
    bad = outside_imports_of_wings(imports) + outside_imports_of_engine_wings(imports)
    assert not bad, "\n".join(bad)


def test_the_checker_counts_type_checking_imports_function_imports_and_package_inits():
    """The checker itself: an import only a type checker runs, one inside a function, and a
    relative one are all edges; a cycle closed through a package __init__ is a cycle."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.live import Router\n"
              "def late():\n    from router.proxy import Upstreams\n\nfrom .state import Decision\n")
    found = parse_imports("router.scheduling.example", source, "example.py", False, KNOWN)
    assert sorted((i.target, i.names) for i in found) == [
        ("router.live", ("Router",)), ("router.proxy", ("Upstreams",)), ("router.scheduling.state", ("Decision",))]
    assert outside_imports_of_wings(found) == [], "Upstreams is exported by router.proxy; state is the importer's own wing"
    reaching = parse_imports("router.admin.example", "from router.proxy.upstream import Pool\nfrom router.proxy import Nope\n",
                             "example.py", False, KNOWN)
    assert len(outside_imports_of_wings(reaching)) == 2
    graph = {"a": {"b"}, "b": {"a"}, "p": {"p.x"}, "p.x": {"q"}, "q": {"p"}, "z": set()}
    assert sorted(map(tuple, cycles(graph))) == [("a", "b"), ("p", "p.x", "q")]


# -- engines/: its wings ----------------------------------------------------------------------------

def worker_violations(imports: list[Import]) -> list[str]:
    """The worker extension runs inside vLLM's worker, whose path holds this checkout's engines/ and
    nothing else of ours: engines/vllm_worker/ (and engines/__init__, which Python runs first) import
    only the standard library, torch, vllm and vllm_worker itself."""
    bad = []
    for i in imports:
        if not (i.source == "engines" or engine_wing_of(i.source) == "vllm_worker"):
            continue
        top = i.target.split(".")[0]
        if top in sys.stdlib_module_names or top in WORKER_MAY_IMPORT or engine_wing_of(i.target) == "vllm_worker":
            continue
        bad.append(f"{i.where}: {i.source} imports {i.target}")
    return bad


def engine_wing_violations(imports: list[Import]) -> list[str]:
    """vllm/ speaks to vLLM and needs nothing else of engines/; memory/ and process/ are below the gate,
    the wake and the state machine; the gate judges and never runs a process; waking/ runs steps the
    Engine hands it (the Engine judges after, with the gate), so it never imports the gate, engine.py or
    watch.py; the simulator shares nothing of the router's idea of vLLM but the checkpoint files vLLM loads."""
    bad = []
    for i in imports:
        source, target = engine_wing_of(i.source), i.target
        if not i.source.startswith("engines.") or not target.startswith("engines"):
            continue
        wing = engine_wing_of(target)
        if source == "vllm" and wing != "vllm":
            bad.append(f"{i.where}: engines.vllm imports {target} (it imports nothing of engines/ outside vllm/)")
        elif source in ("memory", "process") and (wing in ("gate", "waking") or target == "engines.engine"):
            bad.append(f"{i.where}: engines.{source} imports {target} (memory/ and process/ import neither gate/, waking/ nor engine.py)")
        elif source == "waking" and (wing == "gate" or target in ("engines.engine", "engines.watch")):
            bad.append(f"{i.where}: engines.waking imports {target} (waking/ imports neither gate/ nor engine.py and watch.py: "
                       f"the Engine runs its steps and judges after)")
        elif source == "gate" and wing == "process":
            bad.append(f"{i.where}: engines.gate imports {target} (the gate imports no process/)")
        elif source == "sim" and wing != "sim" and target not in SIM_MAY_IMPORT:
            bad.append(f"{i.where}: engines.sim imports {target} (the simulator may know of engines/ only "
                       f"{', '.join(sorted(SIM_MAY_IMPORT))})")
    return bad


def all_imports(known: dict[str, Path]) -> list[Import]:
    return [imp for name, path in known.items()
            for imp in parse_imports(name, path.read_text(), str(path.relative_to(ROOT)), is_package(path), known, ours_only=False)]


def reaper_violations(imports: list[Import]) -> list[str]:
    """The reaper runs by its file (`python -P .../reaper.py`), beside every engine for its whole life:
    the standard library only, so it starts at once and holds nothing."""
    return [f"{i.where}: {i.source} imports {i.target}" for i in imports
            if i.source == "engines.process.reaper" and i.target.split(".")[0] not in sys.stdlib_module_names]


def test_the_reaper_imports_only_the_standard_library():
    bad = reaper_violations(all_imports({"engines.process.reaper": KNOWN["engines.process.reaper"]}))
    assert not bad, "\n".join(bad)


def test_the_worker_extension_imports_only_the_standard_library_torch_and_vllm():
    bad = worker_violations(all_imports({n: p for n, p in KNOWN.items() if n == "engines" or n.startswith("engines.vllm_worker")}))
    assert not bad, "the worker extension runs inside vLLM's worker, copied alone into its environment (engines/process/worker_path.py):\n" + "\n".join(bad)


def test_the_engines_wings_import_only_downwards():
    bad = engine_wing_violations(ALL_IMPORTS)
    assert not bad, "engines/'s wings (docs/contributors.md, \"engines/\"):\n" + "\n".join(bad)


def test_engines_holds_its_wings_and_the_lifecycle():
    engines = ROOT / "engines"
    packages = sorted(p.name for p in engines.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(ENGINE_WINGS), f"engines/'s packages are its wings {sorted(ENGINE_WINGS)}; found {packages}"
    top = sorted(p.stem for p in engines.glob("*.py") if p.name != "__init__.py")
    assert top == sorted(ENGINE_TOP), f"engines/*.py is one engine's lifecycle {sorted(ENGINE_TOP)}; found {top}: a new module goes into a wing"
    assert len(top) + 1 <= MAX_ENGINE_TOP_MODULES, f"engines/ keeps at most {MAX_ENGINE_TOP_MODULES} modules, __init__.py included"
    lines = len((engines / "engine.py").read_text().splitlines())
    assert lines <= MAX_ENGINE_LINES, (f"engines/engine.py has {lines} lines (at most {MAX_ENGINE_LINES}): it keeps the states and "
                                       f"their transitions; what runs between them is a wing's (engines.waking.climb)")
    assert not (engines / "__init__.py").read_text().strip(), "engines/__init__.py stays empty: vLLM's worker runs it"


def test_the_worker_extension_path_the_router_passes_is_the_one_every_roster_and_doc_names():
    from engines.process import WORKER_EXTENSION

    module, _, cls = WORKER_EXTENSION.rpartition(".")
    assert hasattr(importlib.import_module(module), cls), f"{WORKER_EXTENSION} does not resolve (vLLM would fail to start)"
    named = {}
    for path, text in tracked_texts():
        for m in re.finditer(r"--worker-extension-cls[\s=,\"']+([\w.]+)", text):
            if m[1].startswith("engines"):
                named.setdefault(m[1], f"{path}:{text.count(chr(10), 0, m.start()) + 1}")
    assert named and set(named) == {WORKER_EXTENSION}, f"every mention names {WORKER_EXTENSION}: {named}"


def tracked_texts() -> list[tuple[str, str]]:
    """Every tracked text that may name a module: docs, scripts, and Python's strings and comments
    (not its code: `engines.values()` there is a dict's). This file's planted names are left out."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for f in files:
        path = ROOT / f
        if f == "tests/unit/test_layout.py" or not path.is_file():
            continue
        if path.suffix == ".py":
            out.append((f, prose_of(path.read_text())))
        elif path.suffix in (".md", ".yaml", ".yml", ".sh", ".toml", ".lua") or path.name in ("Dockerfile", "cpu_launcher", "cpu_launcher_instrumented", "run"):
            out.append((f, path.read_text(errors="replace")))
    return out


def prose_of(source: str) -> str:
    """A Python file's strings and comments, each at its own line (code blanked), so line numbers hold."""
    lines = ["" for _ in source.splitlines()] + [""]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for n, text in enumerate(tok.string.split("\n")):
                lines[tok.start[0] - 1 + n] += " " + text
    return "\n".join(lines)


def stale_engine_paths(texts: list[tuple[str, str]], known: dict[str, Path]) -> list[str]:
    """Mentions of an engines module (`engines.gate.record`, `engines.gate.record.GateRecord`,
    `engines/gate/record.py`, `engines/gate/`) that name no module, attribute, file or folder."""
    bad = []
    for path, text in texts:
        for m in re.finditer(r"(?<![\w./-])engines((?:\.\w+)+)|(?<![\w./-])engines/([\w/.]*\w/?)", text):
            where = f"{path}:{text.count(chr(10), 0, m.start()) + 1}"
            if m[1]:
                parts = ("engines" + m[1]).split(".")
                at = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), 0)
                module, rest = ".".join(parts[:at]), parts[at:]
                if not at or (rest and rest[0] not in top_level_names(known[module])):
                    bad.append(f"{where}: {'.'.join(parts)}")
            elif not (ROOT / "engines" / m[2]).exists():
                bad.append(f"{where}: engines/{m[2]}")
    return bad


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_mention_of_an_engines_module_names_one_that_exists():
    """Docs, comments and docstrings say where things are; after a move they must say where they went."""
    bad = stale_engine_paths(tracked_texts(), KNOWN)
    assert not bad, "stale engines paths (the module moved: name where it is now):\n" + "\n".join(bad)


# -- each rule fails on an import planted for it -------------------------------------------------

def planted(name: str, source: str, package_init: bool = False, ours_only: bool = True) -> list[Import]:
    return parse_imports(name, source, f"{name.replace('.', '/')}.py", package_init, KNOWN, ours_only)


def test_each_engines_rule_fails_on_an_import_planted_for_it():
    assert worker_violations(planted("engines.vllm_worker.extension", "import aiohttp\n", ours_only=False))
    assert worker_violations(planted("engines.vllm_worker.extension", "from engines.vllm import VLLMClient\n", ours_only=False))
    assert worker_violations(planted("engines", "from config.schema import Gate\n", package_init=True, ours_only=False))
    assert not worker_violations(planted("engines.vllm_worker.extension", "import hashlib\nimport torch\n"
                                         "from vllm.config import set_current_vllm_config\nfrom .host_memory import HostMemoryMethods\n",
                                         ours_only=False))
    assert reaper_violations(planted("engines.process.reaper", "from config.schema import ModelSpec\n", ours_only=False))
    assert not reaper_violations(planted("engines.process.reaper", "import ctypes\nimport signal\n", ours_only=False))
    assert engine_wing_violations(planted("engines.vllm.client", "from engines.process import EngineProcess\n"))
    assert engine_wing_violations(planted("engines.memory.host", "from engines.gate import Verdict\n"))
    assert engine_wing_violations(planted("engines.process.engine_process", "from engines.engine import Engine\n"))
    assert engine_wing_violations(planted("engines.process.engine_process", "from engines.waking import Stager\n"))
    assert engine_wing_violations(planted("engines.waking.climb", "from engines.engine import Engine\n"))
    assert engine_wing_violations(planted("engines.waking.steps", "from engines.gate import Verdict\n"))
    assert not engine_wing_violations(planted("engines.waking.handshake", "from engines.process import EngineProcess\n"))
    assert worker_violations(planted("engines.vllm_worker.staging", "from engines.waking import Stager\n", ours_only=False))
    assert engine_wing_violations(planted("engines.gate.record", "from engines.process import EngineProcess\n"))
    assert engine_wing_violations(planted("engines.sim.state", "from engines.gate import Verdict\n"))
    assert not engine_wing_violations(planted("engines.sim.state", "from engines.memory.weights import folder_weights_gb\n"))
    assert outside_imports_of_engine_wings(planted("router.live", "from engines.gate.verdict import Verdict\n"))
    assert outside_imports_of_engine_wings(planted("router.live", "from engines.gate import judge\n"))
    assert outside_imports_of_engine_wings(planted("router.scheduling.costs", "from engines.waking.ladder import KV_PARKED\n"))
    assert not outside_imports_of_engine_wings(planted("router.scheduling.costs", "from engines.waking import KV_PARKED\n"))
    assert outside_imports_of_engine_wings(planted("router.live", "from engines.vllm_worker import HotswapWorkerExtension\n"))
    assert not outside_imports_of_engine_wings(planted("router.live", "from engines.gate import Verdict\nfrom engines.engine import Engine\n"))
    cycle = edges(KNOWN) | {"engines.gate.record": {"engines.engine"}}
    assert any("engines.engine" in c for c in cycles(cycle)), "the gate reaching back into engine.py closes a cycle"
    assert stale_engine_paths([("x.md", "see `engines.gate.record.GateRecord`, engines/gate/record.py and engines/gate/")], KNOWN) == []
    assert len(stale_engine_paths([("x.md", "engines.host_memory, engines.gate.nothing, engines/client.py")], KNOWN)) == 3
