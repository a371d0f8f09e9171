"""End the whole job from one rank: the one abort that the watchdog and the exception hook share.

:func:`abort_job` is called by :mod:`mpi_gradreducer._core.watchdog` when a
collective waits past its timeout, and by :mod:`mpi_gradreducer._core.excepthook`
when an exception escapes on one rank while a reducer lives. It imports
nothing from the package, so neither of them imports the other.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import NoReturn

from mpi4py import MPI

__all__ = ["ABORT_GRACE", "abort_job"]

#: Seconds between the last words of a rank that aborts the job and the abort.
ABORT_GRACE = 0.2


def abort_job(code: int = 1) -> NoReturn:
    """End every process of the job, without a crash report; never returns.

    Flushes ``sys.stdout`` and ``sys.stderr`` and waits :data:`ABORT_GRACE`
    seconds, so that the launcher has forwarded what was just written (a
    traceback was seen cut after two lines under load without it), then calls
    ``MPI_Abort`` on ``MPI.COMM_WORLD``, which asks the launcher to kill every rank. The MPI
    library ends the calling process with ``exit()``, which would run C++
    static destructors and ``atexit`` handlers (torch's, for instance) while
    other threads are still inside MPI or those libraries: a segmentation
    fault or heap corruption report in about half of the aborts. So before
    the call, ``_exit`` is registered with ``on_exit`` (glibc): registered
    last, it runs first and ends the process at once with the same status.

    Args:
        code: the exit status of the job.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the abort
            pass
    time.sleep(ABORT_GRACE)
    _exit_on_exit()
    try:
        MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def _exit_on_exit() -> None:
    """Make the process's ``exit()`` behave as ``_exit()`` (glibc's ``on_exit``; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None)
        on_exit, _exit = libc.on_exit, libc._exit
    except (OSError, AttributeError):
        return
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit(ctypes.cast(_exit, ctypes.c_void_p), None)
