"""``bucket_bytes="auto"``: time a few bucket caps on the first calls, keep the fastest."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["BucketTuner", "CANDIDATE_BUCKET_BYTES"]

#: Caps tried by ``bucket_bytes="auto"`` (those giving distinct plans).
CANDIDATE_BUCKET_BYTES = tuple(1 << p for p in range(19, 26))  # 512 KiB .. 32 MiB


class BucketTuner:
    """Times each candidate cap on ``rounds`` calls, interleaved, then picks one.

    Every rank sees the same sequence of candidates and makes the same number
    of calls, so :meth:`decide`, which takes the slowest rank's time for each
    candidate, is reached collectively and returns the same cap everywhere.

    Args:
        candidates: the caps to try, in the order they are tried.
        rounds: how many times each is timed (the best time counts).
    """

    def __init__(self, candidates: Sequence[int], rounds: int = 2) -> None:
        if not candidates:
            raise ValueError("candidates: expected at least one bucket cap")
        self.candidates = tuple(int(c) for c in candidates)
        self._rounds = rounds
        self._times = np.full((rounds, len(self.candidates)), np.inf)
        self._trial = 0

    @property
    def finished(self) -> bool:
        """True when every candidate has been timed ``rounds`` times."""
        return self._trial >= self._times.size

    def current(self) -> int:
        """The cap to use for the next call."""
        return self.candidates[self._trial % len(self.candidates)]

    def record(self, seconds: float) -> None:
        """The time of the call made with :meth:`current`."""
        r, c = divmod(self._trial, len(self.candidates))
        self._times[r, c] = seconds
        self._trial += 1

    def decide(self, comm: MPI.Comm) -> int:
        """The fastest cap, judged by the slowest rank (collective)."""
        best = self._times.min(axis=0)
        comm.Allreduce(MPI.IN_PLACE, best, op=MPI.MAX)
        return self.candidates[int(np.argmin(best))]
