"""The call header: what every rank says about a call, and the one verdict every rank reads from it.

Each rank contributes a few small integers to every call: whether its input is
valid, whether it contributes data (a rank that has called ``join()`` does
not), whether it needs a closer look (it passed ``None`` for some gradient),
whether it passes the reducer's own bucket views for every gradient (only
then may consecutive buckets be reduced as one run, since that changes the
messages), whether it started the call with ``begin()`` and whether with
``reduce_scatter()`` (its messages differ from a plain call's), and three
8-bit digests of the call's structure (the call number and where its
``RowSparse`` entries are) with their squares. They are *summed* across
ranks together with the call's first message: the header occupies a few
leading elements of that message's buffer (:data:`SLOTS` real values), so a
healthy call pays no message of its own. From the sums every rank reads the
same :class:`Summary`:

- ``failed``: how many ranks have invalid input;
- ``contributors``: how many ranks contribute (the divisor of a mean);
- the digests agree on every contributing rank exactly when
  ``contributors * sum(d**2) == sum(d)**2`` for each digest (Cauchy-Schwarz).

Only when something is off (a failure, a disagreement, a ``None``, a joined
rank) do the ranks :func:`settle` the call with one more exchange, which
names the ranks and tells every rank the call's structure. No rank modifies a
caller's array before that. Where the first message cannot carry the header
(device or 16-bit buffers, or too many ranks for exact float32 sums), it
travels alone (:func:`exchange`). The verdict is returned to whoever sent the
header (:class:`~mpi_gradreducer._core.call.FirstMessage`): nothing here knows
the reducer.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from . import agreement

__all__ = ["SLOTS", "CallInfo", "Local", "Summary", "carries", "exchange", "lead", "real_view", "settle"]

#: Real values in a header: failed, contributing, attention, views, asynchronous, sharded, 3 digests, 3 squares.
SLOTS = 12
_DIGESTS = 3
#: Ranks beyond which float32 sums of the squared 8-bit digests are no longer exact.
_FLOAT32_RANKS = (1 << 24) // (255 * 255)

#: Per-parameter flags exchanged by :func:`settle`, after its fixed columns (call, contributing, asynchronous, sharded).
DENSE, ABSENT, SPARSE = 0, 1, 2
_FIXED = 4


class Local(NamedTuple):
    """This rank's part of a call's header (records of the header are tuples: cheap to make, immutable).

    Attributes:
        call: the call's number.
        error: this rank's validation error, or None.
        contributing: False on a rank that has joined.
        sparse: positions of RowSparse gradients.
        absent: positions of None gradients.
        views: every gradient is the reducer's own bucket view.
        asynchronous: the call was started by ``begin()``: the header went
            ahead of the data, and every bucket is sent in full.
        sharded: the call was started by ``reduce_scatter()``: the header
            went ahead of the data, and each bucket is reduce-scattered.
    """

    call: int
    error: Exception | None = None
    contributing: bool = True
    sparse: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()
    views: bool = False
    asynchronous: bool = False
    sharded: bool = False

    def values(self) -> list[int]:
        """The header's integers (a joined rank's digests are zero: it knows no structure)."""
        if self.contributing and self.error is None:
            d0, d1, d2 = _digests((self.call, int(self.asynchronous) + 2 * int(self.sharded), *self.sparse))
            return [0, 1, int(bool(self.absent)), int(self.views), int(self.asynchronous), int(self.sharded),
                    d0, d1, d2, d0 * d0, d1 * d1, d2 * d2]  # the digests, then their squares
        return [int(self.error is not None), int(self.contributing), int(bool(self.absent)), int(self.views),
                int(self.asynchronous), int(self.sharded), *[0] * (2 * _DIGESTS)]

    def write(self, slots: np.ndarray) -> None:
        """Store the header in the first :data:`SLOTS` real values of ``slots``."""
        slots[:SLOTS] = self.values()
        if slots.shape[0] > SLOTS:
            slots[SLOTS:] = 0


class Summary(NamedTuple):
    """What the summed header tells every rank (the same everywhere)."""

    failed: int
    contributors: int
    attention: int
    views: int
    asynchronous: int
    sharded: int
    agree: bool

    @classmethod
    def of(cls, sums: np.ndarray) -> Summary:
        """Read summed header values (the first :data:`SLOTS` of a real array; exact integers)."""
        v = list(map(round, sums[:SLOTS].tolist()))
        contributors = v[1]
        agree = (contributors * v[9] == v[6] * v[6] and contributors * v[10] == v[7] * v[7]
                 and contributors * v[11] == v[8] * v[8])  # digests in slots 6-8, their squares in 9-11
        v[6] = agree  # failed, contributors, attention, views, asynchronous, sharded, agree
        return cls(*v[:7])

    def healthy(self, size: int) -> bool:
        """Every rank valid, contributing, starting the call the same way, with the same structure, no None."""
        return (self.failed == 0 and self.contributors == size and self.attention == 0 and self.agree
                and self.asynchronous in (0, size) and self.sharded in (0, size))


class CallInfo(NamedTuple):
    """A call's structure, the same on every rank, after the header was read.

    Attributes:
        contributors: ranks that contribute data.
        sparse: positions of RowSparse gradients (on every contributing rank).
        absent: positions whose gradient is None on every contributing rank.
        runs: every rank passes the reducer's own views, so that consecutive
            buckets may be reduced as one run.
        asynchronous: the contributing ranks started the call with ``begin()``.
        sharded: the contributing ranks started the call with ``reduce_scatter()``.
    """

    contributors: int
    sparse: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()
    runs: bool = False
    asynchronous: bool = False
    sharded: bool = False


def carries(dtype: np.dtype, size: int) -> bool:
    """Whether a message of ``dtype`` can carry the header with exact sums on ``size`` ranks."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "fc" or dtype.name == "bfloat16":
        return False
    real_bytes = dtype.itemsize // (2 if dtype.kind == "c" else 1)
    return real_bytes >= 8 or (real_bytes == 4 and size <= _FLOAT32_RANKS)


def lead(dtype: np.dtype) -> int:
    """Elements of ``dtype`` that hold the header at the start of a message."""
    dtype = np.dtype(dtype)
    per = 2 if dtype.kind == "c" else 1
    return -(-SLOTS // per)


def real_view(a: np.ndarray) -> np.ndarray:
    """``a`` (1-D, contiguous) as real values."""
    return a.view(a.real.dtype) if a.dtype.kind == "c" else a


def exchange(comm: MPI.Intracomm, local: Local) -> Summary:
    """The header alone: one small Allreduce, for calls whose first message cannot carry it."""
    buf = np.array(local.values(), dtype=np.int64)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return Summary.of(buf)


def settle(comm: MPI.Intracomm, local: Local, summary: Summary, count: int, healthy: bool | None = None) -> CallInfo:
    """The call's structure on every rank; raises on every rank when a rank's input is bad.

    Free when the summary is healthy; otherwise one ``Allgather`` of every
    rank's flags (and, on failure, the agreement's exchange of the message).

    Args:
        comm: the reducer's communicator.
        local: this rank's header.
        summary: the summed header.
        count: the number of parameters.
        healthy: ``summary.healthy(size)``, where the caller knows it already.

    Raises:
        ValueError, TypeError: the failing rank's error, or a disagreement
            between contributing ranks, on every rank; ``ValueError`` on every
            rank for ``reduce_scatter()`` while some rank has joined.
    """
    size = comm.Get_size()
    runs, asynchronous, sharded = summary.views == size, summary.asynchronous > 0, summary.sharded > 0
    if summary.healthy(size) if healthy is None else healthy:
        return CallInfo(size, local.sparse, runs=runs, asynchronous=asynchronous, sharded=sharded)
    if summary.failed:
        agreement.raise_if_any(comm, local.error)
    row = np.zeros(_FIXED + count, dtype=np.int64)
    row[0], row[1], row[2], row[3] = local.call, int(local.contributing), int(local.asynchronous), int(local.sharded)
    row[_FIXED + np.asarray(local.absent, dtype=np.int64)] = ABSENT
    row[_FIXED + np.asarray(local.sparse, dtype=np.int64)] = SPARSE
    table = np.empty((size, row.shape[0]), dtype=np.int64)
    comm.Allgather(row, table)
    active = np.flatnonzero(table[:, 1])
    if active.shape[0] == 0:
        return CallInfo(0, runs=runs, asynchronous=asynchronous)
    first = table[active[0]]
    for r in active[1:]:
        if table[r, 0] != first[0]:
            raise ValueError(
                f"the ranks are at different calls: rank {active[0]} at call {first[0]}, rank {r} at call "
                f"{table[r, 0]}; a rank skipped or repeated a call (every rank must call the reducer "
                "equally often; use join() on a rank that has run out of data)")
        if table[r, 3] != first[3]:
            raise ValueError(
                f"the ranks started call {first[0]} differently: rank {active[(table[active, 3] == 1).argmax()]} "
                f"with reduce_scatter(), rank {active[(table[active, 3] == 0).argmax()]} with a plain call "
                "(reducer(grads), begin() or reduce_async()); start each call the same way on every rank")
        if table[r, 2] != first[2]:
            raise ValueError(
                f"the ranks started call {first[0]} differently: rank {active[(table[active, 2] == 1).argmax()]} "
                f"with begin() or reduce_async(), rank {active[(table[active, 2] == 0).argmax()]} with a "
                "blocking call; start each call the same way on every rank")
        if not np.array_equal(table[r, _FIXED:] == SPARSE, first[_FIXED:] == SPARSE):
            raise ValueError(
                "the ranks passed differently structured arguments (e.g. a RowSparse entry "
                "on one rank where another passed a dense array); pass the same structure on every rank")
    if first[3] and active.shape[0] < size:
        joined = [int(r) for r in np.flatnonzero(table[:, 1] == 0)]
        raise ValueError(
            f"reduce_scatter() (call {first[0]}) while rank{'s' if len(joined) > 1 else ''} "
            f"{', '.join(map(str, joined))} {'have' if len(joined) > 1 else 'has'} joined: reduce_scatter with "
            "joined ranks is not supported (each rank owns a part of every bucket); call it on every rank, "
            "or use the plain call while ranks join")
    flags = table[active, _FIXED:]
    return CallInfo(int(active.shape[0]), tuple(int(i) for i in np.flatnonzero(first[_FIXED:] == SPARSE)),
                    tuple(int(i) for i in np.flatnonzero((flags == ABSENT).all(axis=0))), runs, asynchronous,
                    bool(first[3]))


#: Packers of a few 64-bit little-endian integers (a call without RowSparse entries digests two).
_FEW = 8
_PACKERS = [struct.Struct(f"<{n}q") for n in range(_FEW)]


def _digests(values: Sequence[int]) -> tuple[int, int, int]:
    """Three 8-bit digests of ``values``: bytes of the CRC-32 of their 64-bit little-endian form."""
    n = len(values)
    d = zlib.crc32(_PACKERS[n].pack(*values) if n < _FEW else struct.pack(f"<{n}q", *values))
    return d & 0xFF, (d >> 8) & 0xFF, (d >> 16) & 0xFF
