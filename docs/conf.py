"""Sphinx configuration of the mpi_gradreducer site (``bash scripts/docs.sh`` builds it)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

sys.path.insert(0, os.path.abspath(".."))

import mpi_gradreducer  # noqa: E402

project = "mpi_gradreducer"
author = "the mpi_gradreducer authors"
copyright = "2026, the mpi_gradreducer authors"
release = mpi_gradreducer.__version__  # the one version, from the package
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
html_theme = "furo"
html_title = f"mpi_gradreducer {release}"
html_static_path = ["_static"]
# literal blocks (``::``) are shown as plain text unless they say otherwise
highlight_language = "none"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# No network while building: cross-references to other projects' names are
# written as plain literals, and names that only type hints mention are listed here.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|cupy|torch|MPI|mpi4py|ml_dtypes)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Sequence|Mapping|Hashable|NDArray|ArrayLike|Self)"),
    (r"py:.*", r"(collections\.abc|typing|types|weakref|threading|contextlib|datetime)\..*"),
    (r"py:class", r"_Default"),  # the reducer's "not given: the field of options applies"
    # internal types that public signatures mention: users never build them
    (r"py:class", r"(mpi_gradreducer\.)?(shard\.)?Sharder|(mpi_gradreducer\.)?(planning\.)?ParamSpec|Summers?"),
    (r"py:class", r"(mpi_gradreducer\.)?(transport\.)?OrderedSum"),
    (r"py:class", r"(mpi_gradreducer\.)?(compression\.)?(SliceSum|Compression)"),
]

# The public names that the API reference must document: a name missing from
# api.rst is a warning, and the build (run with -W) fails.
PUBLIC_MODULES = ["mpi_gradreducer", "mpi_gradreducer.torch"]


def _public_names() -> list[str]:
    names = []
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        names += [f"{modname}.{n}" for n in module.__all__ if not n.startswith("__")]
    return names


def _check_api_reference(app: Any, env: Any) -> None:
    from sphinx.util import logging

    documented = set(env.get_domain("py").objects)
    missing = [n for n in _public_names() if n not in documented]
    for name in missing:
        logging.getLogger(__name__).warning(
            "public name %s (in __all__) is missing from the API reference (docs/api.rst)", name)


def setup(app: Any) -> None:
    app.connect("env-check-consistency", _check_api_reference)
