"""How the communication thread waits for its collectives without taking the training thread's core.

A blocking MPI call polls the network at full speed until its data has come;
on the communication thread (``progress="thread"``) that polling competes
with backward for the rank's cores. :class:`Polling` waits instead by testing
the nonblocking request, napping :data:`NAP_SECONDS` between tests while the
training thread computes, and in MPI's own wait once the training thread
waits for the reduction (tests without naps would starve the ranks that
share its cores). What this changed, measured: ``CHANGELOG.rst``, 0.6.0.

Only data movement waits so (the summers' ``Alltoall`` and ``Allgather``):
the bytes are those of the blocking calls, so the sums are the same bits.
"""

from __future__ import annotations

import threading
import time

from mpi4py import MPI

__all__ = ["NAP_SECONDS", "Polling"]

#: The nap between tests of a request while the training thread computes: long enough to leave backward its
#: core, short enough that no transfer stalls (each handshake of a message waits for a test). The measurement
#: that chose it: ``docs/performance.rst``, "The constants".
NAP_SECONDS = 0.25e-3


class Polling:
    """Completes the communication thread's requests: napping while the training thread computes.

    Args:
        nap: seconds between tests while the training thread computes.
    """

    def __init__(self, nap: float = NAP_SECONDS) -> None:
        self.nap = nap
        self._computing = threading.Event()

    def computing(self, busy: bool) -> None:
        """Say whether the training thread computes (tests with naps) or waits for the reduction (MPI's wait)."""
        if busy:
            self._computing.set()
        else:
            self._computing.clear()

    def wait(self, request: MPI.Request) -> None:
        """Return when ``request`` has completed (also when interrupted: its buffers are then free again)."""
        try:
            while not request.Test():
                if not self._computing.is_set():
                    break
                time.sleep(self.nap)
        except BaseException:
            request.Wait()  # MPI may still write the buffers, which the caller's scratch reuses
            raise
        request.Wait()  # the training thread waits: MPI's own wait (a spinning Test would starve other ranks)
