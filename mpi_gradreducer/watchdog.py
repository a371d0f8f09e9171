"""A watchdog that ends the job when a collective does not finish in time."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["Watchdog"]


class Watchdog:
    """Aborts the job when a watched operation outlasts ``timeout`` seconds.

    The owner calls :meth:`arm` before a collective and :meth:`disarm` after;
    both are attribute writes, cheap enough for every bucket. A daemon thread,
    started on the first :meth:`arm`, looks at the deadline a few times per
    timeout. When it has passed, the thread prints a diagnostic to stderr and
    calls ``abort`` (``comm.Abort``), which ends every rank of the job.

    Args:
        timeout: seconds an armed operation may take.
        abort: ends the job; called from the watchdog thread.
        rank: the rank named in the diagnostic.
    """

    def __init__(self, timeout: float, abort: Callable[[], None], rank: int) -> None:
        self.timeout = float(timeout)
        self._abort = abort
        self._rank = rank
        self._since: Optional[float] = None
        self._what: Callable[[], str] = str
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def arm(self, what: Callable[[], str]) -> None:
        """Start timing an operation.

        Args:
            what: returns a description of the operation (called only when
                the watchdog fires).
        """
        self._what = what
        self._since = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mpi_gradreducer-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        """Stop timing: the operation finished."""
        self._since = None

    def close(self) -> None:
        """Stop the watchdog thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        poll = min(1.0, max(self.timeout / 8, 0.01))
        while not self._stop.wait(poll):
            since = self._since
            if since is None:
                continue
            waited = time.monotonic() - since
            if waited > self.timeout and self._since is since:
                sys.stderr.write(
                    f"mpi_gradreducer: rank {self._rank}: {self._what()} has not completed after "
                    f"{waited:.1f} s (timeout={self.timeout:g} s); another rank has probably stalled, "
                    "died or skipped a call. Aborting the job.\n"
                )
                sys.stderr.flush()
                try:
                    self._abort()
                finally:
                    os._exit(1)
