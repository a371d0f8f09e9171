"""End the whole job when an exception escapes on one rank, while a reducer exists.

Without this, a rank whose script raises prints its traceback and waits in
``MPI_Finalize``, while the other ranks wait for it in the reducer's next
collective until the watchdog's timeout (30 minutes by default). mpi4py's
runner (``python -m mpi4py script.py``) avoids that for the whole script;
this hook does the same for the life of the reducers, however the script was
started.

:data:`UNCAUGHT` is the only instance: each watchdog over more than one rank
acquires it at construction and releases it at close. The first acquire
installs the hook as ``sys.excepthook``, chained to the hook it replaces; the
last release puts that one back. The reference count and the replaced hook
are the only module state, and they exist only to restore that hook.

The hook is not installed in an interactive session (an exception at the
prompt must not end the job), nor when ``MPI_GRADREDUCER_ABORT_ON_EXCEPTION``
is ``0``. Exceptions in other threads are left alone: they do not end the
process, so no rank is left waiting for an exited one (and if that rank then
stalls, the watchdog's stall warning names it).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType

from mpi4py import MPI

from .abort import abort_job
from .options import ABORT_ON_EXCEPTION_ENV

__all__ = ["UncaughtAbort", "UNCAUGHT"]

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class UncaughtAbort:
    """A reference-counted ``sys.excepthook`` that prints the traceback, then aborts the job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._previous: _Hook | None = None

    @property
    def installed(self) -> bool:
        """Whether the hook is in force (some reducer holds it)."""
        return self._count > 0

    def acquire(self) -> bool:
        """Take a reference, installing the hook on the first.

        Returns:
            Whether a reference was taken (False in an interactive
            session); call :meth:`release` once for each True.
        """
        if hasattr(sys, "ps1") or sys.flags.interactive:
            return False
        with self._lock:
            if self._count == 0:
                self._previous = sys.excepthook
                sys.excepthook = self
            self._count += 1
        return True

    def release(self) -> None:
        """Drop a reference; the last one restores the hook that was replaced.

        When someone else has replaced ``sys.excepthook`` since, theirs is
        left in place (if it chains to this hook, this hook only chains on).
        """
        with self._lock:
            if self._count == 0:
                return
            self._count -= 1
            if self._count == 0:
                if sys.excepthook is self:
                    sys.excepthook = self._previous if self._previous is not None else sys.__excepthook__
                # self._previous is kept: a hook installed over this one may still chain to it.

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous = self._previous if self._previous is not None else sys.__excepthook__
        try:
            previous(exc_type, exc, tb)
        finally:
            if self._count > 0:
                captured = getattr(sys.stderr, "getvalue", None)
                if sys.stderr is not sys.__stderr__ and callable(captured):
                    # A hook chained over this one captures stderr while it calls this one (torch.distributed's
                    # prefixes each line with the rank): write the traceback out before the process ends.
                    try:
                        os.write(2, str(captured()).encode())
                    except Exception:
                        pass
                try:
                    sys.stderr.flush()
                except Exception:
                    pass
                os.write(2, (
                    f"mpi_gradreducer: rank {MPI.COMM_WORLD.Get_rank()}: uncaught {exc_type.__name__}; "
                    "aborting the job so that the other ranks do not wait for this one "
                    f"({ABORT_ON_EXCEPTION_ENV}=0 turns this off).\n"
                ).encode())
                abort_job(1)


#: The hook shared by every reducer of the process.
UNCAUGHT = UncaughtAbort()
