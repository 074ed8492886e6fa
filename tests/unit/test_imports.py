"""Import smoke test: the generic top-level names must be Tandem's own; the
scheduler, the KV cache and the router stay free of torch; the packages
import one way only (service -> connectors -> engine -> kernels), with no
import cycle anywhere (read from the source's ASTs)."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_packages_come_from_this_repository():
    import connectors
    import engine
    import kernels
    import service

    for module in (engine, service, connectors, kernels):
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().is_relative_to(ROOT), module.__file__


def _assert_imports_none_of(modules: str, roots: tuple[str, ...]) -> None:
    """Importing `modules` (comma-separated) in a fresh interpreter loads
    no module under any of `roots`."""
    code = (
        f"import sys; import {modules};"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {roots!r}];"
        "print(bad[:5]); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scheduler_and_kv_cache_do_not_import_torch():
    _assert_imports_none_of("engine.sched.scheduler, engine.kv_cache", ("torch", "numpy", "vllm"))


def test_the_router_imports_neither_torch_nor_transformers():
    """It holds no model. With them a router took 3.8 s to listen and
    266 MB; without, 0.37 s and 45 MB (benchmarks/startup_bench.py)."""
    _assert_imports_none_of(
        "service.cli, service.router, service.pods, service.tls", ("torch", "transformers")
    )


def test_no_module_imports_vllm_or_sglang():
    offenders = []
    for path in ROOT.glob("**/*.py"):
        if ".venv" in path.parts or path.parent.name == "baselines":
            continue
        for line in path.read_text().splitlines():
            words = line.strip().split()
            if (
                len(words) >= 2
                and words[0] in ("import", "from")
                and (words[1].split(".")[0] in ("vllm", "sglang"))
            ):
                offenders.append(f"{path}: {line.strip()}")
    assert offenders == []


# ---- one dependency direction, no cycles -----------------------------------
#
# The source packages, bottom layer first: each may import only the ones
# before it (service -> connectors -> engine -> kernels). Tests and
# benchmarks sit above all of them and are not checked.
LAYERS = ("kernels", "engine", "connectors", "service")


@dataclass(frozen=True)
class _Import:
    source: str  # the importing module, e.g. "engine.core"
    target: str  # the module imported, e.g. "engine.sched.scheduler"
    where: str  # "engine/core.py:29"
    type_checking: bool  # under ``if TYPE_CHECKING:``


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(module: str) -> bool:
    return (ROOT.joinpath(*module.split(".")) / "__init__.py").is_file()


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return _is_package(module) or path.with_suffix(".py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(path: Path) -> list[_Import]:
    """Every import statement of ``path`` naming a module of ``LAYERS``,
    wherever it stands (module level, in a function, in a try)."""
    source = _module_of(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found: list[_Import] = []

    def add(target: str, node: ast.stmt, type_checking: bool) -> None:
        if target.split(".")[0] in LAYERS:
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found.append(_Import(source, target, where, type_checking))

    def visit(node: ast.AST, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, True)
                for stmt in child.orelse:
                    visit_one(stmt, type_checking)
            else:
                visit_one(child, type_checking)

    def visit_one(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, type_checking)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # ``from engine.kv_cache import manager`` imports a module;
                # ``from engine.request import Request`` a name of one.
                submodule = f"{base}.{alias.name}"
                add(submodule if _exists(submodule) else base, node, type_checking)
        visit(node, type_checking)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _all_imports() -> list[_Import]:
    return [
        found
        for top in LAYERS
        for path in sorted((ROOT / top).rglob("*.py"))
        for found in _imports_of(path)
    ]


def test_each_layer_imports_only_the_layers_below_it():
    """``engine`` imports neither ``connectors`` nor ``service`` (it finds a
    connector by name: engine.kv_transfer.registry), ``connectors`` never
    ``service``, ``kernels`` none of the others. Imports under
    ``if TYPE_CHECKING:`` count here too: a layer that names an upper
    layer's types in its annotations depends on it all the same."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    offenders = sorted(
        {
            f"{found.where}: {found.source} imports {found.target}"
            for found in _all_imports()
            if rank[found.target.split(".")[0]] > rank[found.source.split(".")[0]]
        }
    )
    assert offenders == [], "\n".join(offenders)


def test_kv_cache_is_self_contained():
    """The paged block pool, hashing and KVCacheManager are the engine's
    bottom: at run time they import nothing else of the engine, so every
    other part may use them (types they share live in engine.kv_cache)."""
    offenders = sorted(
        {
            f"{found.where}: {found.source} imports {found.target}"
            for found in _all_imports()
            if found.source.startswith("engine.kv_cache")
            and not found.type_checking
            and not found.target.startswith("engine.kv_cache")
        }
    )
    assert offenders == [], "\n".join(offenders)


def _node_at(package: str, module: str) -> str | None:
    """The node of ``package``'s level that holds ``module``, if any."""
    # A package's own code is its __init__, a sibling of its modules.
    dotted = f"{module}.__init__" if _is_package(module) else module
    prefix = f"{package}." if package else ""
    if not dotted.startswith(prefix):
        return None
    head = dotted[len(prefix) :].split(".")[0]
    return prefix + head


def _find_cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of the graph (its nodes in order, the first repeated at
    the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _packages() -> list[str]:
    found = [""]
    for top in LAYERS:
        found += sorted(_module_of(p) for p in (ROOT / top).rglob("__init__.py"))
    return found


def test_no_import_cycles():
    """No cycle between packages, nor between the modules of one package.

    The graph is checked level by level. At the top the nodes are the four
    packages; inside a package they are its own modules (``engine.core``,
    ``engine.request``, ...) and its subpackages, each subpackage one node
    for everything under it (``engine.sched``, ``engine.kv_cache``, ...).
    ``a -> b`` when a module under ``a`` imports one under ``b``. So
    ``engine.sched`` may use ``engine.request`` while ``engine.core`` uses
    ``engine.sched`` (the engine's entry points sit above its parts, its
    shared types below them), but no part may lead back to itself: a
    cycle of modules shows up as a cycle at the level of the package that
    holds them all.

    Counted: every import statement that runs, at module level or inside a
    function (a function-level import still ties the two modules together,
    it only defers the cost). Not counted: imports under
    ``if TYPE_CHECKING:``, which never run, so annotations may name a type
    from above; ``importlib.import_module`` on a string (how the
    connector registry finds the implementations, and how ``engine``'s
    ``__init__`` exports lazily); and the implicit import of a parent
    package's ``__init__``.
    """
    imports = [found for found in _all_imports() if not found.type_checking]
    cycles = []
    for package in _packages():
        edges: dict[str, dict[str, str]] = {}
        for found in imports:
            source = _node_at(package, found.source)
            target = _node_at(package, found.target)
            if source and target and source != target:
                edges.setdefault(source, {}).setdefault(target, found.where)
        # Each cycle found is reported, then cut at its first edge, so
        # every separate cycle of this level is named.
        while cycle := _find_cycle(edges):
            steps = [f"  {a} -> {b}  ({edges[a][b]})" for a, b in itertools.pairwise(cycle)]
            cycles.append(f"in {package or 'the top level'}:\n" + "\n".join(steps))
            del edges[cycle[0]][cycle[1]]
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)
