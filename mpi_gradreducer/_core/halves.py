"""16-bit sums: buffers of 16-bit floats summed in float32, each rank one slice; float32 sent as 16 bits.

MPI has no half-precision sum. :class:`SliceSum` gives each rank one slice of
a 16-bit chunk from every rank (``Alltoall``), adds them in float32 in rank
order, rounds once, and shares the slices again (``Allgather``): every
element is the correctly rounded float32 sum, whatever the number of ranks.
:class:`CastSum` sends a float32/float64 chunk through it as 16 bits, cast
where it lies, in pieces that travel while the next is cast. The reducer's
:class:`~mpi_gradreducer._core.summers.Summers` makes them; the casts are the
wire format's (:mod:`~mpi_gradreducer._core.wire`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from .transport import CHUNK_BYTES, Exchange
from .wire import Compression, pack, unpack

__all__ = ["CAST_PIECES", "CastSum", "SliceSum", "compressed_allreduce"]


def compressed_allreduce(
    comm: MPI.Comm,
    wire_buf: Any,
    compression: Compression,
    chunk_bytes: int = CHUNK_BYTES,
    *,
    method: str = "alltoall",
    after: Callable[[Any], None] | None = None,
    scale: float = 1.0,
) -> int:
    """Sum a 1-D wire buffer over ``comm`` in place, chunk by chunk (times ``scale``, rounded once).

    Collective: every rank passes a buffer of the same length, the same
    compression name and the same method. The result is bitwise identical on
    every rank.

    Args:
        comm: the communicator.
        wire_buf: 1-D C-contiguous host array of ``compression.wire_dtype``.
        compression: the wire format.
        chunk_bytes: wire bytes per collective.
        method: ``"alltoall"`` (default): each rank receives every rank's
            share of one equal slice of the chunk (``Alltoall``), adds them in
            float32 in rank order, rounds once, and the slices are shared
            again (``Allgather``; the last ``n % size`` elements are gathered
            whole and summed on every rank): every element is the correctly rounded
            float32 sum, and no Python code runs inside MPI. ``"allreduce"``:
            one ``Allreduce`` with :meth:`Compression.op`; each step of MPI's
            reduction tree rounds its partial sum to the wire format. Both
            move the same number of bytes as a bandwidth-optimal Allreduce.
        after: called with each reduced chunk (a wire-dtype view), e.g. to
            unpack it while it is still in cache.
        scale: factor applied to each sum in float32 before it is rounded.

    Returns:
        The number of collective calls made.

    Raises:
        TypeError: ``wire_buf`` does not have the wire dtype.
        ValueError: ``wire_buf`` is not 1-D and contiguous, or an unknown
            ``method``.
    """
    if wire_buf.dtype != compression.wire_dtype:
        raise TypeError(
            f"wire_buf: expected dtype {compression.wire_dtype} (compression {compression.name!r}), "
            f"got {wire_buf.dtype}"
        )
    if wire_buf.ndim != 1 or not wire_buf.flags.c_contiguous:
        raise ValueError(f"wire_buf: expected a 1-D contiguous array, got shape {wire_buf.shape}")
    return SliceSum(comm, compression, chunk_bytes, method).reduce(wire_buf, scale, after)


_METHODS = ("alltoall", "allreduce")
#: Pieces of a chunk that :class:`CastSum` casts while the piece before travels (:meth:`SliceSum.pipelined`):
#: enough that the casts and the transfers overlap; more gained nothing (``CHANGELOG.rst``, 0.6.0).
CAST_PIECES = 4


@functools.cache
def _float16_table() -> np.ndarray:
    """The float32 value of every float16 bit pattern (256 KiB, read-only): ``table[bits]`` gives numpy's own
    cast, faster than the cast (``CHANGELOG.rst``, 0.5.0)."""
    table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    table.flags.writeable = False
    return table


class SliceSum:
    """Sums one 16-bit chunk at a time across ``comm`` in float32, reusing its scratch buffers.

    With the default method, rank ``k`` receives every rank's copy of slice
    ``k`` of the chunk, adds them in float32 in rank order, scales, rounds
    once and the slices are shared again: the reducer's way to sum float16
    and bfloat16 gradients, whether they are compressed float32 ones or
    half-precision ones of their own.

    Two levels (``across``), as :class:`~mpi_gradreducer._core.summers.OrderedSum`
    has them: ``comm`` holds the ranks of one host; each rank rounds its
    block's sum over the host to 16 bits, ``across`` sums the hosts' in
    float32 and rounds again, and the blocks are shared on the host. Each
    host sends ``2 (hosts - 1) / hosts`` of the 16-bit bytes.
    """

    def __init__(self, comm: MPI.Comm, compression: Compression, chunk_bytes: int, method: str,
                 across: SliceSum | None = None, wait: Callable[[MPI.Request], None] | None = None) -> None:
        if method not in _METHODS:
            raise ValueError(f"method: expected one of {_METHODS}, got {method!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
        self.comm = comm
        self._moves = Exchange(comm, wait)  # wait: see transport.Exchange
        self.across = across
        self.compression = compression
        #: Bytes a value takes where it is handed to MPI.
        self.wire_itemsize = compression.wire_dtype.itemsize
        self.method = method
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.step = max(1, int(chunk_bytes) // compression.wire_dtype.itemsize)
        self._recv: Any = None
        self._recv2: Any = None  # a second receive buffer: pipelined pieces in flight
        self._acc: Any = None
        self._tmp: Any = None

    def reduce(self, buf: Any, scale: float = 1.0, after: Callable[[Any], None] | None = None) -> int:
        """Sum the 1-D wire buffer ``buf`` chunk by chunk (``__call__`` each); returns the collectives made.

        ``after`` is called with each reduced chunk.
        """
        calls = 0
        for start in range(0, buf.shape[0], self.step):
            chunk = buf[start : start + self.step]
            calls += self(chunk, scale)
            if after is not None:
                after(chunk)
        return calls

    def __call__(self, chunk: Any, scale: float = 1.0) -> int:
        """Sum ``chunk`` across ranks in place, times ``scale`` (rounded once); returns the collectives made."""
        if chunk.shape[0] == 0:
            return 0
        if self.size == 1 and self.across is not None:
            return self.across(chunk, scale)
        if self.size == 1 or self.method == "allreduce":
            if self.size > 1:
                self.comm.Allreduce(MPI.IN_PLACE, [chunk.view(np.uint16), self.compression.mpi_datatype()],
                                    op=self.compression.op())
            if scale != 1.0:
                with np.errstate(over="ignore"):
                    np.multiply(chunk, scale, out=chunk, dtype=np.float32, casting="unsafe")
            return int(self.size > 1)
        n, size = chunk.shape[0], self.size
        if n < size:
            return self._gathered(chunk, scale)
        block = n // size
        bits = chunk.view(np.uint16)
        body = bits[: block * size]  # equal blocks: MPICH's Allgatherv is far slower than its Allgather
        u16 = self.compression.mpi_datatype()
        recv = self._rows(size * block)
        self._moves.alltoall([body, u16], [recv, u16])
        seg = chunk[self.rank * block : (self.rank + 1) * block]
        calls = 2 + self._sum(recv.view(self.compression.wire_dtype).reshape(size, block), seg, scale)
        self._moves.allgather(MPI.IN_PLACE, [body, u16])
        if body.shape[0] == n:
            return calls
        return calls + self._gathered(chunk[body.shape[0] :], scale)  # the last n % size elements

    def pipelined(self, src: Any, wire: Any, pre: float, post: float, pieces: int) -> int:
        """Sum the float32/float64 ``src`` (1-D) across ranks as 16 bits, in place, times ``post``, in
        ``pieces`` equal pieces: each piece travels while the next is cast and the one before cast back.

        Every element is what casting ``src * pre`` into ``wire`` (as many wire elements), ``__call__``
        and casting back times ``post`` give: the float32 sum of the ranks' 16-bit values in rank order,
        rounded once, whatever the pieces. A flat summer (no ``across``) of the default method. Returns the
        collectives made.
        """
        assert self.across is None and self.method == "alltoall"
        size, n = self.size, src.shape[0]
        length = (n // max(1, pieces)) // size * size  # each piece: equal slices, one per rank
        done = 0
        calls = 0
        if size > 1 and length > 0:
            block, u16 = length // size, self.compression.mpi_datatype()
            recvs = self._pair(size * block)
            alltoalls: dict[int, MPI.Request] = {}
            allgathers: dict[int, MPI.Request] = {}

            def start(j: int) -> None:  # cast piece j, send its slices
                part = slice(j * length, (j + 1) * length)
                pack(src[part], wire[part], pre)
                alltoalls[j] = self._moves.comm.Ialltoall([wire[part].view(np.uint16), u16], [recvs[j % 2], u16])

            def middle(j: int) -> None:  # sum this rank's slice of piece j, share it
                self._moves.complete(alltoalls.pop(j))
                w = wire[j * length : (j + 1) * length]
                rows = recvs[j % 2].view(self.compression.wire_dtype).reshape(size, block)
                self._sum_rows(rows, w[self.rank * block : (self.rank + 1) * block], 1.0)
                allgathers[j] = self._moves.comm.Iallgather(MPI.IN_PLACE, [w.view(np.uint16), u16])

            def finish(j: int) -> None:  # cast piece j back
                self._moves.complete(allgathers.pop(j))
                part = slice(j * length, (j + 1) * length)
                unpack(wire[part], src[part], post)

            try:
                for j in range(pieces + 2):  # the same order of collectives on every rank
                    if j < pieces:
                        start(j)
                    if 0 <= j - 1 < pieces:
                        middle(j - 1)
                    if 0 <= j - 2 < pieces:
                        finish(j - 2)
            except BaseException:
                MPI.Request.Waitall([*alltoalls.values(), *allgathers.values()])  # MPI still writes the buffers
                raise
            done, calls = pieces * length, 2 * pieces
        if done < n:  # the rest (shorter than a piece of equal slices), in one go
            rest = slice(done, n)
            pack(src[rest], wire[rest], pre)
            calls += self(wire[rest])
            unpack(wire[rest], src[rest], post)
        return calls

    def _pair(self, count: int) -> tuple[Any, Any]:
        """Two receive buffers of ``count`` elements (the accumulators sized for them): pieces in flight."""
        first = self._rows(count)
        if self._recv2 is None or self._recv2.shape[0] < count:
            self._recv2 = np.empty(count, dtype=np.uint16)
        return first, self._recv2[:count]

    def _gathered(self, chunk: Any, scale: float) -> int:
        """Sum ``chunk`` whole on every rank, from one ``Allgather`` of it (a chunk shorter than the ranks)."""
        n, u16 = chunk.shape[0], self.compression.mpi_datatype()
        rows = self._rows(self.size * n)
        self._moves.allgather([chunk.view(np.uint16), u16], [rows, u16])
        return 1 + self._sum(rows.view(self.compression.wire_dtype).reshape(self.size, n), chunk, scale)

    def _sum(self, rows: Any, out: Any, scale: float) -> int:
        """``out`` = the rows' sum (rounded), then summed across the hosts, times ``scale``; the collectives made."""
        if self.across is None:
            self._sum_rows(rows, out, scale)
            return 0
        self._sum_rows(rows, out, 1.0)
        return self.across(out, scale)

    def _sum_rows(self, rows: Any, out: Any, scale: float) -> None:
        """``out`` = the rows' float32 sum in rank order, times ``scale``, rounded once to the wire format."""
        n = rows.shape[1]
        acc = self._acc[:n]
        if rows.dtype == np.float16:  # numpy's float16 casts are slow; a table gives the same float32 values
            table, bits, tmp = _float16_table(), rows.view(np.uint16), self._tmp[:n]
            np.take(table, bits[0], out=acc)
            for k in range(1, rows.shape[0]):  # rank order: the same bits wherever it is computed
                np.take(table, bits[k], out=tmp)
                np.add(acc, tmp, out=acc)
        else:
            np.copyto(acc, rows[0], casting="unsafe")
            for k in range(1, rows.shape[0]):
                np.add(acc, rows[k], out=acc, dtype=np.float32, casting="unsafe")
        if scale != 1.0:
            np.multiply(acc, np.float32(scale), out=acc)
        with np.errstate(over="ignore"):
            np.copyto(out, acc, casting="unsafe")

    def _rows(self, count: int) -> Any:
        """``count`` elements of the receive buffer (and as many / size of the float32 accumulator), reused."""
        if self._recv is None or self._recv.shape[0] < count:
            share = max(-(-self.step // self.size), -(-count // self.size))
            self._recv = np.empty(self.size * share, dtype=np.uint16)
            self._acc, self._tmp = np.empty(share, dtype=np.float32), np.empty(share, dtype=np.float32)
        return self._recv[:count]


class CastSum:
    """Sums float32/float64 chunks as 16-bit floats with ``summer``: cast, :class:`SliceSum`, cast back.

    Each rank's chunk is divided by ``predivide``, rounded once to 16 bits
    where it lies, summed in float32 by ``summer`` and cast back, multiplied
    by ``predivide`` and the scale. In two levels it is the level across
    hosts (:meth:`Summers.cast`): each host's ranks sum their gradients as they
    are, over shared memory, and only each host's sum crosses the links; each
    rank casts 1/(ranks per host) of the chunk each way. A chunk goes in
    ``pieces`` pieces, each cast while the one before travels
    (:meth:`SliceSum.pipelined`); the bits do not depend on the pieces.

    Args:
        summer: a flat 16-bit summer of the default method.
        dtype: the chunks' dtype (float32 or float64).
        predivide: each chunk is divided by it before the cast (see
            ``Compression.scales``), and the result multiplied back.
        pieces: pieces of a chunk in flight at once (:data:`CAST_PIECES` across hosts).
    """

    def __init__(self, summer: SliceSum, dtype: Any, predivide: float, pieces: int = CAST_PIECES) -> None:
        if summer.across is not None or summer.method != "alltoall":
            raise ValueError("summer: expected a flat SliceSum of the default method")
        self.summer, self.dtype, self.pieces = summer, np.dtype(dtype), pieces
        self.pre, self.post = 1.0 / predivide, float(predivide)
        self.wire_dtype = summer.compression.wire_dtype
        #: Bytes a value takes where it is handed to MPI.
        self.wire_itemsize = self.wire_dtype.itemsize
        self._wire = np.empty(0, self.wire_dtype)

    def __call__(self, chunk: Any, scale: float = 1.0) -> int:
        """Sum ``chunk`` (of :attr:`dtype`) across ranks in place, times ``scale``; returns the collectives made."""
        assert chunk.dtype == self.dtype, (chunk.dtype, self.dtype)
        n = chunk.shape[0]
        if self._wire.shape[0] < n:
            self._wire = np.empty(n, self.wire_dtype)
        return self.summer.pipelined(chunk, self._wire[:n], self.pre, self.post * scale, self.pieces)
