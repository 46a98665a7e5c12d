"""The layout is part of the design (docs/contributors.md, "The map"): these tests read the code's own
imports with `ast` and hold it to the rules, so the layout stays as it is drawn.

Every import counts: at the top, inside a function, and under `if TYPE_CHECKING:` alike.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = ("router", "engines", "config")
WINGS = ("proxy", "scheduling", "admin", "cli", "fleet")
# wing -> the wings it must not import
FORBIDDEN = {
    "proxy": {"admin", "cli"},
    "scheduling": {"proxy", "admin", "cli"},
    "admin": {"cli"},
    "fleet": {"proxy", "admin", "cli"},
}
MAX_WING_MODULES = 12
MAX_TOP_MODULES = 10  # router/*.py: what every wing shares, and what wires them


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


def parse_imports(name: str, text: str, filename: str, package_init: bool, known: dict[str, Path]) -> list[Import]:
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
    return [i for i in out if i.target.split(".")[0] in PACKAGES]


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


def exported(wing: str) -> set[str]:
    tree = ast.parse((ROOT / "router" / wing / "__init__.py").read_text())
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


def test_the_rest_of_the_router_uses_only_the_names_a_wing_exports():
    bad = outside_imports_of_wings([i for i in ALL_IMPORTS if i.source.startswith("router")])
    assert not bad, "\n".join(bad)


def test_the_benchmarks_use_only_the_names_the_wings_export():
    bench = sources("bench")
    bad = outside_imports_of_wings([imp for name, path in bench.items() for imp in imports_of(name, path, KNOWN)])
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
