"""The package's layers, as the README's design section states them: nothing in ``_core`` imports the
modules above it, and importing the package (or any of its private modules) imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "mpi_gradreducer" / "_core"
#: What ``_core`` may import from the package: itself only.
ABOVE = ("mpi_gradreducer.reducer", "mpi_gradreducer.torch", "mpi_gradreducer.horovod", "mpi_gradreducer.elastic",
         "mpi_gradreducer.bench", "mpi_gradreducer.launch", "mpi_gradreducer.info")


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
