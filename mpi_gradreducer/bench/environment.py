"""Where a benchmark ran: :func:`mpi_gradreducer.info.collect`'s facts, plus what a results file needs.

The versions, the MPI library and the ranks' placement come from
:mod:`mpi_gradreducer.info`; this adds the moment, the command line, the
relevant environment variables, the load and the reducer's constants.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import sys
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from .. import info, reducer as reducer_module
from .._core import backend, transport

__all__ = ["PREFIXES", "constants", "environment", "huge_pages", "loadavg"]

#: Environment variables recorded in a results file: those that start with one of these.
PREFIXES = ("MPIR_CVAR_", "MPICH_", "OMPI_MCA_", "I_MPI_", "UCX_", "FI_", "MPI_GRADREDUCER_", "OMP_NUM_THREADS",
            "OPENBLAS_NUM_THREADS")


def constants() -> dict[str, int]:
    """The reducer's size constants at the time of the run."""
    return {"DEFAULT_BUCKET_BYTES": reducer_module.DEFAULT_BUCKET_BYTES,
            "DIRECT_BYTES": reducer_module.DIRECT_BYTES,
            "CHUNK_BYTES": transport.CHUNK_BYTES,
            "GATHER_MEMBERS": transport.GATHER_MEMBERS,
            "HUGE_FROM": backend.HUGE_FROM}


def loadavg() -> list[float] | None:
    """The load average (1, 5, 15 minutes), where the system has one."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def huge_pages() -> str | None:
    """The system's transparent huge page mode (``always``, ``madvise`` or ``never``), where it tells."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(comm: MPI.Intracomm, module: str, argv: Sequence[str],
                prefixes: Sequence[str] = ()) -> dict[str, Any]:
    """Facts about the run, for its results file (collective over ``comm``).

    Args:
        comm: the ranks of the run.
        module: what ``python -m`` ran, e.g. ``"mpi_gradreducer.bench"``.
        argv: the benchmark's arguments.
        prefixes: more environment-variable prefixes to record (beyond :data:`PREFIXES`).

    Returns:
        :func:`mpi_gradreducer.info.collect`'s facts (without ``rank``), with
        ``mpi_library_version``, ``torch``, ``hostname``, ``cpu_count``,
        ``platform``, ``transparent_huge_pages``, ``loadavg_at_start``, ``date``, ``command_line``,
        ``argv``, ``environment_variables`` and ``constants``.
    """
    facts = info.collect(comm)
    facts.pop("rank", None)
    wanted = tuple(PREFIXES) + tuple(prefixes)
    facts.update({
        "mpi_library_version": facts["mpi_library"],
        "torch": _version("torch"),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "transparent_huge_pages": huge_pages(),
        "loadavg_at_start": loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": " ".join([os.path.basename(sys.executable), "-m", module, *argv]),
        "argv": list(argv),
        "environment_variables": {k: v for k, v in os.environ.items() if k.startswith(wanted)},
        "constants": constants(),
    })
    return facts
