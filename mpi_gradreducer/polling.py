"""How the communication thread waits for its collectives without taking the training thread's core.

A blocking MPI call polls the network at full speed until its data has come.
On the communication thread (``progress="thread"``) that polling competes with
backward for the rank's cores. At 2 hosts x 1 rank over 1 Gbit/s links (one
core a rank), a 4 MiB bucket that takes 35 ms alone took 120-133 ms while
backward ran, and the torch ``DistributedOptimizer``'s step with the thread
took 0.92 of its step with the reduction after backward. :class:`Polling`
waits instead by testing the nonblocking request, napping
:data:`NAP_SECONDS` between tests while the training thread computes (the
same bucket: about 58 ms during backward; the step: 0.77-0.79), and not
napping once the training thread waits for the reduction.

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
        """Say whether the training thread computes (naps between tests) or waits for the reduction (none)."""
        if busy:
            self._computing.set()
        else:
            self._computing.clear()

    def wait(self, request: MPI.Request) -> None:
        """Return when ``request`` has completed."""
        while not request.Test():
            if self._computing.is_set():
                time.sleep(self.nap)
