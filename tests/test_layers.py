"""The package's layers, as the README's design section states them: nothing in ``_core`` imports the
modules above it, and importing the package (or any of its private modules) imports no torch."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "mpi_gradreducer" / "_core"
#: What ``_core`` may import from the package: itself only.
ABOVE = ("mpi_gradreducer.reducer", "mpi_gradreducer.torch", "mpi_gradreducer.horovod", "mpi_gradreducer.elastic",
         "mpi_gradreducer.bench", "mpi_gradreducer.launch", "mpi_gradreducer.info", "mpi_gradreducer.jobs")


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports (relative imports resolved against the package), lazy ones included."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found += [module] + [f"{module}.{a.name}" for a in node.names]
    return found


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_imports_nothing_above_it(path: Path):
    above = [m for m in _imports(path) if m.startswith(ABOVE)]
    assert not above, f"{path.name} imports {above}: _core must not import the modules built on it"


def test_importing_the_package_imports_no_torch():
    core = sorted(f"mpi_gradreducer._core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__")
    code = ("import sys\nimport mpi_gradreducer, mpi_gradreducer.elastic, mpi_gradreducer.launch\n"
            + "".join(f"import {m}\n" for m in core)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"torch was imported: {done.stdout.strip()[:300]}"


PACKAGE = ROOT / "mpi_gradreducer"
#: The floors: each subpackage is one, and the modules at the package's top (the reducer, info, launch) are one.
FLOORS = sorted({p.relative_to(PACKAGE).parts[0] if p.parent != PACKAGE else "" for p in PACKAGE.rglob("*.py")})


def _floor(module: str) -> str:
    """The floor of a module of the package (``mpi_gradreducer.elastic.world`` -> ``elastic``; top level -> "")."""
    parts = module.split(".")[1:]
    return parts[0] if parts and (PACKAGE / parts[0]).is_dir() else ""


def _modules() -> list[tuple[str, Path]]:
    return sorted((".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), p)
                  for p in PACKAGE.rglob("*.py"))


@functools.cache
def _private_names(floor: str) -> frozenset[str]:
    """Every underscore name a floor defines: functions, classes, its objects' attributes, module globals."""
    names: set[str] = set()
    for module, path in _modules():
        if _floor(module) != floor:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)  # its own objects' attributes (an assignment to another's is a reach-in)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # __slots__ entries, setattr names
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


#: Underscore attributes of other libraries' objects that the package uses: they are no floor's private parts.
FOREIGN = {
    "_replace": "namedtuple and dataclass copies",
    "_version": "a torch tensor's version counter (DistributedOptimizer notices gradients written late)",
}


#: Underscore attributes that a module reads off an object of its own floor whose name another floor also defines
#: (the rule cannot tell the objects apart): each one checked by hand.
SAME_FLOOR = {
    ("mpi_gradreducer.horovod.engine", "_complete"): "the engine completes its own Handle",
    ("mpi_gradreducer.torch.distributed.registry", "_spawner"): "the backend's own default process group",
    ("mpi_gradreducer.torch.distributed.work", "_finish"): "the backend's thread finishes its own MPIWork",
    ("mpi_gradreducer.torch.functions", "_params"): "the torch floor's own DistributedOptimizer",
}


def _reach_ins(module: str, path: Path, private: dict[str, frozenset[str]]) -> list[str]:
    """What ``module`` uses of another floor's private parts: underscore modules or names it imports, and
    underscore attributes that other floors define, read off anything but ``self``/``cls`` (a name its own floor
    defines too is no excuse: only :data:`SAME_FLOOR` lists such reads, each checked)."""
    floor = _floor(module)
    others = set().union(*(names for f, names in private.items() if f != floor)) - set(FOREIGN)
    found = []
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for imported in _imports(path):
        if not imported.startswith("mpi_gradreducer.") or _floor(imported) == floor:
            continue
        parts = imported.split(".")[1:]
        inner = parts[1:] if parts[0] == "_core" else parts  # _core is the floor every floor stands on
        if any(p.startswith("_") and not p.startswith("__") for p in inner):
            found.append(f"imports {imported}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in others and (module, node.attr) not in SAME_FLOOR:
            owner = node.value
            if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in modules):
                continue  # its own object, or another library's module (os._exit)
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"line {node.lineno}: .{node.attr} (another floor's private attribute)")
    return found


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_floors_use_only_each_others_public_surface(module: str, path: Path):
    private = {f: _private_names(f) for f in FLOORS}
    found = _reach_ins(module, path, private)
    assert not found, f"{module} reaches into another floor's private parts: {found}"
