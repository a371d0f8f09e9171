"""BLAS threads for the products the reducer computes: no more than this rank's share of its host's cores.

numpy's BLAS starts as many threads as the process may use cores. With
several ranks on a host each rank's threads compete for the same cores, and
spinning BLAS threads then cost far more than they give: PowerSGD's products
for ResNet-50 took about 3.9 s a call at 4 ranks on 2 cores, and 0.23 s with
one thread a rank. :class:`BlasThreads` lowers the thread count of every BLAS
library loaded in the process (through ``threadpoolctl``) to this rank's
share of the cores (:func:`share_of_cores`) for the span of a ``with`` block,
and puts it back after. It never raises a count: a user's
``OPENBLAS_NUM_THREADS=1`` stays 1. A library that cannot tell or set its
count is left as it is. For numpy's OpenBLAS (pthreads) the count is
process-wide; some other builds (MKL, OpenMP builds of OpenBLAS) set it for
the calling thread, which is the one that computes the products.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["BlasThreads", "share_of_cores"]


def share_of_cores(ranks_on_host: int) -> int:
    """This rank's share of its host's cores (at least 1).

    Where the rank may run on every core of the machine, the cores divided by
    ``ranks_on_host``; where it is bound to some (a launcher's binding), those.
    """
    try:
        mine = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        mine = os.cpu_count() or 1
    if mine < (os.cpu_count() or mine):
        return max(1, mine)
    return max(1, mine // max(1, ranks_on_host))


class BlasThreads:
    """Limits the BLAS libraries of the process to ``threads`` within ``with self.limited():``.

    Args:
        threads: the most threads a BLAS call may use (see ``share_of_cores``).

    Attributes:
        threads: that limit.
    """

    def __init__(self, threads: int) -> None:
        from threadpoolctl import ThreadpoolController  # a dependency; imported where it is used

        self.threads = int(threads)
        try:
            self._libs: list[Any] = list(ThreadpoolController().select(user_api="blas").lib_controllers)
        except Exception:  # noqa: BLE001 - a library it cannot inspect: no limit rather than a failed reducer
            self._libs = []

    @contextlib.contextmanager
    def limited(self) -> Iterator[None]:
        """Within the block every loaded BLAS runs at most ``threads`` threads (its own count if lower)."""
        lowered = []
        try:
            for lib in self._libs:
                count = _count(lib)
                if count is not None and count > self.threads and _set(lib, self.threads):
                    lowered.append((lib, count))
            yield
        finally:
            for lib, count in reversed(lowered):
                _set(lib, count)


def _count(lib: Any) -> int | None:
    """``lib``'s thread count, or None where it cannot tell."""
    try:
        count = lib.get_num_threads()
    except Exception:  # noqa: BLE001
        return None
    return count if isinstance(count, int) else None


def _set(lib: Any, count: int) -> bool:
    """Set ``lib``'s thread count; False where it cannot be."""
    try:
        lib.set_num_threads(count)
    except Exception:  # noqa: BLE001
        return False
    return True
