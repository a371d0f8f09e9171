"""The package's modules import one another without a circle.

Read from the source with :mod:`ast`: every ``import`` counts, at module
level, inside functions (lazy imports) and under ``TYPE_CHECKING`` alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mpi_gradreducer

PACKAGE = Path(mpi_gradreducer.__file__).parent
NAME = "mpi_gradreducer"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from . import agreement` imports a module, `from .config import X` a name
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """Each module of the package, with the package's modules it imports."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each as the path of modules that closes it (depth-first search)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {NAME, f"{NAME}.reducer", f"{NAME}.bench", f"{NAME}.bench.host"} <= set(graph)
    # relative imports, `from . import x` and lazy imports inside functions are all seen
    core = f"{NAME}._core"
    assert f"{core}.abort" in graph[f"{core}.watchdog"] and f"{core}.abort" in graph[f"{core}.excepthook"]
    assert f"{NAME}._core.agreement" in graph[f"{NAME}._core.header"]
    assert f"{NAME}.reducer" in graph[f"{NAME}.bench.environment"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert circles(import_graph()) == []
