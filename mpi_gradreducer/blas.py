"""BLAS threads for the products the reducer computes: no more than this rank's share of its host's cores.

numpy's BLAS starts as many threads as the process may use cores. With
several ranks on a host each rank's threads compete for the same cores, and
spinning BLAS threads then cost far more than they give: PowerSGD's products
for ResNet-50 took about 3.9 s a call at 4 ranks on 2 cores, and 0.23 s with
one thread a rank. :class:`BlasThreads` lowers the thread count of every BLAS
library loaded in the process (through ``threadpoolctl``) to the cores this
process may run on divided by the ranks on its host, for the span of a
``with`` block, and puts it back after. It never raises a count: a user's
``OPENBLAS_NUM_THREADS=1`` stays 1. The count is process-wide, so products
that other threads of the process run in that span are limited alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from threadpoolctl import ThreadpoolController

__all__ = ["BlasThreads", "share_of_cores"]


def share_of_cores(ranks_on_host: int) -> int:
    """The cores this process may run on, divided by ``ranks_on_host`` (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks_on_host))


class BlasThreads:
    """Limits the BLAS libraries of the process to ``threads`` within ``with self.limited():``.

    Args:
        threads: the most threads a BLAS call may use (see ``share_of_cores``).

    Attributes:
        threads: that limit.
    """

    def __init__(self, threads: int) -> None:
        self.threads = int(threads)
        self._blas = ThreadpoolController().select(user_api="blas")

    @contextlib.contextmanager
    def limited(self) -> Iterator[None]:
        """Within the block every loaded BLAS runs at most ``threads`` threads (its own count if lower)."""
        libs = [lib for lib in self._blas.info() if lib["num_threads"] > self.threads]
        if not libs:
            yield
            return
        with self._blas.limit(limits={lib["prefix"]: self.threads for lib in libs}):
            yield
