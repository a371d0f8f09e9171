"""One screen about the environment: versions, the MPI library, GPUs and where the ranks run.

Run it as ``python -m mpi_gradreducer.info``, or under ``mpiexec -n 4`` to see
the hosts and ranks per node of a launch. Only rank 0 prints; ``--json``
prints the same facts as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import mpi4py
import numpy as np
from mpi4py import MPI

from . import __version__
from ._core import faults, options
from ._core.topology import Topology
from .launch import Launcher

__all__ = ["collect", "format_report", "main"]


def collect(comm: MPI.Intracomm | None = None) -> dict[str, Any]:
    """Facts about this process, its MPI library and the job (collective over ``comm``).

    Library versions, MPI details and cupy are this rank's view; ``hosts`` and
    ``ranks_per_node`` describe the whole communicator and are the same on
    every rank.

    Args:
        comm: the ranks to describe; default ``MPI.COMM_WORLD``.

    Returns:
        A dict of plain values (JSON-serialisable). Keys: ``mpi_gradreducer``,
        ``python``, ``numpy``, ``mpi4py``, ``mpi_library``, ``mpi_vendor``,
        ``mpi_standard``, ``thread_level``, ``cuda_aware``, ``cuda_aware_source``,
        ``ulfm`` (the library has ULFM fault tolerance), ``ulfm_enabled`` (this
        job was started with it: True, False, or None without ULFM),
        ``launcher`` (the ``mpiexec`` a user of this Python would run, as
        :class:`~mpi_gradreducer.launch.Launcher` names it, or why there is
        none), ``launcher_matches`` (whether that ``mpiexec`` is of this
        library: under another MPI's, ranks start alone; None without one),
        ``cupy``, ``cupy_devices``, ``rank``, ``ranks``, ``hosts`` (host name to
        its ranks, in rank order), ``nodes`` and ``ranks_per_node`` (one count
        per host: ranks that share memory and a processor name). ``launcher``
        and ``launcher_matches`` are rank 0's.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    try:
        cuda_aware, cuda_source = options.cuda_aware_default()
    except ValueError as exc:  # a malformed override: say so instead of failing
        cuda_aware, cuda_source = None, str(exc)
    cupy_version, cupy_devices = _cupy()
    vendor, vendor_version = MPI.get_vendor()
    info: dict[str, Any] = {
        "mpi_gradreducer": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
        "mpi_vendor": f"{vendor} {'.'.join(str(v) for v in vendor_version)}",
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": _thread_level_name(MPI.Query_thread()),
        **_ulfm(vendor),
        "cuda_aware": cuda_aware,
        "cuda_aware_source": cuda_source,
        "cupy": cupy_version,
        "cupy_devices": cupy_devices,
        "rank": comm.Get_rank(),
        "ranks": comm.Get_size(),
    }
    info.update(comm.bcast(_launcher(vendor) if comm.Get_rank() == 0 else None, root=0))
    info.update(_placement(comm))
    return info


def format_report(info: dict[str, Any]) -> str:
    """The facts from :func:`collect` as an aligned, human-readable screen."""
    aware = {True: "yes", False: "no", None: "unknown"}[info["cuda_aware"]]
    if info["cupy"] is None:
        cupy = "not installed"
    elif isinstance(info["cupy_devices"], int):
        cupy = f"{info['cupy']}, {info['cupy_devices']} CUDA device(s) seen by rank 0"
    else:
        cupy = f"{info['cupy']}, no CUDA device usable ({info['cupy_devices']})"
    hosts = ", ".join(f"{host} ({_ranges(ranks)})" for host, ranks in info["hosts"].items())
    per_node = info["ranks_per_node"]
    per_node_text = str(per_node[0]) if len(set(per_node)) == 1 else " + ".join(map(str, per_node))
    rows = [
        ("mpi_gradreducer", info["mpi_gradreducer"]),
        ("Python", info["python"]),
        ("numpy", info["numpy"]),
        ("mpi4py", info["mpi4py"]),
        ("MPI library", info["mpi_library"]),
        ("MPI vendor", info["mpi_vendor"]),
        ("MPI standard", info["mpi_standard"]),
        ("thread level", f"{info['thread_level']} (provided)"),
        ("ULFM", _ulfm_text(info)),
        ("launcher", info["launcher"] + {True: "", None: "",
                                         False: " (NOT this MPI library's: its ranks would start alone)"}[
                                             info["launcher_matches"]]),
        ("CUDA-aware MPI", f"{aware} (from {info['cuda_aware_source']})"),
        ("cupy", cupy),
        ("ranks", str(info["ranks"])),
        ("hosts", f"{len(info['hosts'])}: {hosts}"),
        ("nodes", f"{info['nodes']} (shared-memory domains)"),
        ("ranks per node", per_node_text),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Print the report on rank 0 of ``MPI.COMM_WORLD`` (collective).

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
        out: where rank 0 writes (default: standard output).

    Returns:
        The exit status, 0.
    """
    parser = argparse.ArgumentParser(prog="python -m mpi_gradreducer.info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)
    info = collect(MPI.COMM_WORLD)
    if info["rank"] == 0:
        stream = sys.stdout if out is None else out
        text = json.dumps(info, indent=2) if args.json else format_report(info)
        stream.write(text + "\n")
        stream.flush()
    return 0


def _ulfm(vendor: str) -> dict[str, Any]:
    """Whether the library has ULFM (mpi4py then knows ``MPI_ERR_PROC_FAILED``), and whether this job enabled it."""
    built_in = MPI.ERR_PROC_FAILED != MPI.ERR_UNKNOWN
    enabled = None
    if built_in:
        enabled = vendor == "Open MPI" and faults.ft_requested()
    return {"ulfm": built_in, "ulfm_enabled": enabled}


def _ulfm_text(info: dict[str, Any]) -> str:
    if not info["ulfm"]:
        return "no (a lost rank ends the job)"
    if info["ulfm_enabled"]:
        return "yes, enabled in this job"
    return "built in, not enabled in this job (start it with mpiexec --with-ft ulfm)"


def _launcher(vendor: str) -> dict[str, Any]:
    """The mpiexec beside this Python (else on PATH), and whether it is of the library ``vendor`` names."""
    try:
        found = Launcher.find()
    except RuntimeError as exc:
        return {"launcher": f"none usable: {exc}", "launcher_matches": None}
    return {"launcher": str(found), "launcher_matches": found.vendor == vendor}


def _thread_level_name(level: int) -> str:
    names = {
        MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
        MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
        MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
        MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
    }
    return names.get(level, f"unknown ({level})")


def _cupy() -> tuple[str | None, Any]:
    """(cupy's version or None if it does not import, device count or why there is none)."""
    try:
        import cupy
    except Exception:  # not installed, or a broken install: either way, no cupy
        return None, None
    try:
        return cupy.__version__, int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device
        return cupy.__version__, f"{type(exc).__name__}: {exc}".strip()[:200]


def _placement(comm: MPI.Intracomm) -> dict[str, Any]:
    """Host names and shared-memory nodes of all ranks, gathered buffer-based."""
    topology = Topology.of(comm)
    hosts: dict[str, list[int]] = {}
    for r, name in enumerate(topology.names):
        hosts.setdefault(name, []).append(r)
    return {
        "hosts": hosts,
        "nodes": topology.hosts,
        "ranks_per_node": [len(topology.ranks_on(h)) for h in range(topology.hosts)],
    }


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"ranks 0-2, 5"``."""
    parts = []
    start = prev = ranks[0]
    for r in list(ranks[1:]) + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
