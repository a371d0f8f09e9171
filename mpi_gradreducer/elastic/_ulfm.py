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

import time
from collections.abc import Iterable, Sequence

from mpi4py import MPI

__all__ = ["complete", "failed_meanwhile", "lost_ranks", "returning", "revoke", "shrink"]

#: Seconds :func:`failed_meanwhile` waits for the failure detector to report a process lost.
DETECTION_SECONDS = 5.0


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


def complete(requests: Sequence[MPI.Request], seconds: float, what: str, watched: Sequence[MPI.Comm] = ()) -> None:
    """Wait for nonblocking operations that a lost process may keep from completing, within ``seconds``.

    Every few milliseconds it tests ``requests``; when a communicator of
    ``watched`` knows of a failed process, it revokes them all, which ends
    the operations with ``MPI_ERR_REVOKED`` here and on every other process
    that waits on them (Open MPI 5.0.11 does not end some waits on a lost
    process by itself, among them those of processes of another job).

    Raises:
        MPI.Exception: an operation failed (a process lost, a communicator revoked).
        TimeoutError: they did not complete within ``seconds`` (``watched`` is revoked then); the
            message says ``what`` was waited for.
    """
    deadline = time.monotonic() + seconds
    while not all([r.Test() for r in requests]):  # each one, for its own error (Testall has MPI_ERR_IN_STATUS)
        if any(_knows_failed(c) for c in watched):
            revoke(watched)
        if time.monotonic() > deadline:
            revoke(watched)
            raise TimeoutError(f"{what} within {seconds:g} s")
        time.sleep(0.005)


def _knows_failed(comm: MPI.Comm) -> bool:
    """Whether this process knows of a failed process of ``comm`` (local; False where it cannot tell)."""
    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False
    try:
        return group.Get_size() > 0
    finally:
        group.Free()


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
        if _knows_failed(comm):
            return True
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
