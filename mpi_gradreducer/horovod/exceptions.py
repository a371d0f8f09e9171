"""Horovod's exceptions (``horovod.common.exceptions``), and where MPI's failures become them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mpi4py import MPI

from .._core.faults import failure_of
from ..elastic import HostsUpdated

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "internal_errors", "internal_error_of"]


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name): ``hvd.elastic.run`` recovers from it.

    Raised on every rank of the operation when the ranks disagree on it (or
    its kind cannot run beside ``join()``), and when MPI reports a lost
    process or a revoked communicator (the MPI error is its ``__cause__``).
    A ``RuntimeError``, so that ``except RuntimeError`` catches it, as in
    Horovod.
    """


class HostsUpdatedInterrupt(HostsUpdated):
    """The ranks change (Horovod's name): new ranks are ready to join, or those of removed hosts leave; raised by
    ``state.commit()`` on every rank at once."""


def internal_error_of(exc: BaseException) -> HorovodInternalError | None:
    """The :class:`HorovodInternalError` that ``exc`` stands for (a lost process, a revoked communicator), or None."""
    failure = failure_of(exc)
    if failure is None:
        return None
    error = HorovodInternalError(f"a collective failed: {failure.Get_error_string()}")
    error.__cause__ = failure
    return error


@contextlib.contextmanager
def internal_errors() -> Iterator[None]:
    """Turn MPI's lost-process and revoked-communicator errors into :class:`HorovodInternalError`."""
    try:
        yield
    except MPI.Exception as exc:
        error = internal_error_of(exc)
        if error is None:
            raise
        raise error from exc
