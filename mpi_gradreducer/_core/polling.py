"""How the communication thread waits for its collectives without taking the training thread's core.

A blocking MPI call polls the network at full speed until its data has come.
On the communication thread (``progress="thread"``) that polling competes with
backward for the rank's cores. At 2 hosts x 1 rank over 1 Gbit/s links (one
core a rank), a 4 MiB bucket that takes 35 ms alone took 120-133 ms while
backward ran, and the torch ``DistributedOptimizer``'s step with the thread
took 0.92 of its step with the reduction after backward. :class:`Polling`
waits instead by testing the nonblocking request, napping
:data:`NAP_SECONDS` between tests while the training thread computes (the
same bucket: about 58 ms during backward; the step: 0.76-0.77), and in MPI's
own wait once the training thread waits for the reduction (a loop of tests
without naps starved the other ranks where they share cores: ResNet-50 at 4
hosts x 1 rank on 2 cores took 1.97 times the limit instead of 1.0).

Only data movement waits so (the summers' ``Alltoall`` and ``Allgather``):
the bytes are those of the blocking calls, so the sums are the same bits.
"""

from __future__ import annotations

import threading
import time

from mpi4py import MPI

__all__ = ["NAP_SECONDS", "Polling"]

#: The nap between tests of a request while the training thread computes. The torch step above, with the
#: thread, over the step with the reduction after backward: 0.78-0.81 with 0.1 ms naps, 0.77-0.79 with
#: 0.25 ms, 0.85 with 0.5 ms; with 1 ms the transfers stall (each handshake of a message waits for a test).
#: (Measured before the training thread's wait used MPI's own; with it, 0.76-0.77 at 0.25 ms.)
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
