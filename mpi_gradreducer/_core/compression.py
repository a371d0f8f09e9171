"""Wire compression: send float32/float64 gradients as 16-bit floats.

A :class:`Compression` is a small strategy in the manner of Horovod's
``Compressor``: :func:`pack` casts (and pre-scales) a gradient into a 16-bit
wire buffer, :func:`compressed_allreduce` sums the wire buffer across ranks,
:func:`unpack` casts (and post-scales) it back into the gradient::

    comp = get_compression("fp16")
    pre, post = comp.scales(size=comm.Get_size(), degree=degree, mean=True)
    pack(grad, wire, pre)                   # wire = grad * pre, as float16
    compressed_allreduce(comm, wire, comp)  # wire = sum over ranks
    unpack(wire, grad, post)                # grad = wire * post, as float32
    comp.free()

MPI has no half-precision sum. By default (``method="alltoall"``) each rank
receives every rank's share of one slice of the buffer, adds them in float32
in rank order and rounds once, and the slices are shared again: each element
is the float32 sum rounded to the wire format, whatever the number of ranks.
``method="allreduce"`` instead hands MPI :meth:`Compression.op`, a
user-defined reduction that adds two wire buffers in float32 and rounds back,
so every level of MPI's reduction tree rounds. Each :class:`Compression` owns
at most one such op, created on first use and released by
:meth:`Compression.free` (mpi4py allows only a few dozen live user-defined
ops per process, so free the ones you no longer need).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
from mpi4py import MPI

from . import transport
from .dtypes import scaled_copy

__all__ = [
    "COMPRESSIONS",
    "CastSum",
    "Compression",
    "SliceSum",
    "compressed_allreduce",
    "get_compression",
    "half_format",
    "pack",
    "unpack",
]

#: The accepted compression names (besides None, no compression).
COMPRESSIONS = ("fp16", "bf16")

_COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class Compression:
    """One wire format: its name, its 16-bit dtype and the MPI op that sums it.

    Create instances with :func:`get_compression`.

    Attributes:
        name: ``"fp16"`` or ``"bf16"``.
        wire_dtype: ``float16`` or ``ml_dtypes.bfloat16``.
    """

    name: str
    wire_dtype: np.dtype
    _op: MPI.Op | None = field(default=None, init=False, repr=False, compare=False)

    def applies_to(self, dtype: Any) -> bool:
        """Whether gradients of ``dtype`` are compressed (float32 and float64 only).

        Complex, half-precision and integer gradients travel uncompressed.
        """
        try:
            return np.dtype(dtype) in _COMPRESSIBLE
        except TypeError:
            return False

    def default_predivide(self, size: int) -> float:
        """The pre-division factor used when none is given.

        float16 overflows above 65504, so each rank's values are divided by the
        number of ranks before the sum: the sum of ``size`` such terms is then
        no larger in magnitude than the largest input, and cannot overflow.
        bfloat16 has float32's exponent range, so nothing is divided.

        Args:
            size: number of ranks taking part in the sum.

        Returns:
            ``size`` for fp16, 1.0 for bf16.
        """
        return float(size) if self.name == "fp16" else 1.0

    def scales(
        self, size: int, degree: int = 1, mean: bool = False, predivide: float | None = None
    ) -> tuple[float, float]:
        """Factors for :func:`pack` and :func:`unpack` (Horovod's pre/post-scaling).

        The sum of ``x * prescale`` over the ranks, times ``postscale``, is the
        requested result: the sum of ``x``, or the sum divided by ``degree``.

        Args:
            size: number of ranks taking part in the sum.
            degree: divisor of the mean.
            mean: divide the sum by ``degree``.
            predivide: the pre-division factor ``f`` (Horovod's and DeepSpeed's
                ``gradient_predivide_factor``); None: :meth:`default_predivide`.
                A larger ``f`` guards against overflow of the half-precision
                sum, a smaller one against underflow of small gradients.

        Returns:
            ``(1 / f, f / degree)`` for a mean, ``(1 / f, f)`` for a sum.

        Raises:
            ValueError: ``predivide``, ``size`` or ``degree`` is not positive
                (``predivide`` also: not finite).
        """
        f = self.default_predivide(size) if predivide is None else predivide
        if isinstance(f, bool) or not isinstance(f, (int, float, np.integer, np.floating)) \
                or not 0 < f < float("inf"):
            raise ValueError(f"predivide: expected a positive finite number, got {predivide!r}")
        if not size > 0 or not degree > 0:
            raise ValueError(f"size and degree: expected positive ints, got {size!r} and {degree!r}")
        f = float(f)
        return 1.0 / f, (f / degree if mean else f)

    def mpi_datatype(self) -> MPI.Datatype:
        """The datatype that describes a wire buffer to MPI: 2-byte unsigned ints.

        The bits are reinterpreted as :attr:`wire_dtype` inside :meth:`op`;
        this is also what mpi4py infers for ``wire.view(numpy.uint16)``.
        """
        return MPI.UNSIGNED_SHORT

    def op(self) -> MPI.Op:
        """The commutative MPI op that sums wire buffers in float32.

        Created on the first call and reused until :meth:`free`.
        """
        op = self._op
        if op is None:
            op = MPI.Op.Create(self._sum, commute=True)
            object.__setattr__(self, "_op", op)
        return op

    def free(self) -> None:
        """Release the MPI op, if one was created (not collective)."""
        if self._op is not None:
            op = self._op
            object.__setattr__(self, "_op", None)
            op.Free()

    def _sum(self, inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        # Buffers arrive as raw bytes. The ufunc reads both operands as float32
        # and casts the sum back in its own chunked loop: no temporaries.
        a = np.frombuffer(inbuf, dtype=self.wire_dtype)
        b = np.frombuffer(inoutbuf, dtype=self.wire_dtype)
        with np.errstate(over="ignore"):  # an overflow becomes inf, as a native sum would
            np.add(a, b, out=b, dtype=np.float32, casting="unsafe")


@overload
def get_compression(name: None) -> None: ...


@overload
def get_compression(name: str) -> Compression: ...


def get_compression(name: str | None) -> Compression | None:
    """The compression called ``name``, a new instance on each call.

    Args:
        name: None (no compression), ``"fp16"`` or ``"bf16"``.

    Returns:
        None for None, else a :class:`Compression` (free it when done).

    Raises:
        ValueError: ``name`` is not one of the accepted names.
        ImportError: ``"bf16"`` without ``ml_dtypes`` installed.
    """
    if name is None:
        return None
    if name == "fp16":
        return Compression("fp16", np.dtype(np.float16))
    if name == "bf16":
        try:
            import ml_dtypes
        except ImportError as exc:
            raise ImportError(
                "compression='bf16' needs the ml_dtypes package: pip install ml_dtypes "
                "(or mpi_gradreducer[bf16])"
            ) from exc
        return Compression("bf16", np.dtype(ml_dtypes.bfloat16))
    raise ValueError(
        f"compression: expected None or one of {', '.join(repr(n) for n in COMPRESSIONS)}, got {name!r}"
    )


def half_format(dtype: Any) -> Compression:
    """The 16-bit format of ``dtype`` (float16 or bfloat16), to sum such buffers with :class:`SliceSum`."""
    dtype = np.dtype(dtype)
    return Compression("fp16" if dtype == np.float16 else "bf16", dtype)


def pack(src: Any, wire_view: Any, prescale: float = 1.0) -> None:
    """Write ``src * prescale`` into ``wire_view``, cast to the wire dtype, in one pass.

    The product is formed in ``src``'s precision and rounded once to the wire
    dtype. Values beyond the wire format's range become infinities.

    Args:
        src: a float32 or float64 array (any layout).
        wire_view: a writeable wire-dtype array of ``src``'s shape, or 1-D
            with ``src.size`` elements.
        prescale: the factor (1.0: a plain cast).
    """
    scaled_copy(src, wire_view, prescale, src.dtype)


def unpack(wire_view: Any, dst: Any, postscale: float = 1.0) -> None:
    """Write ``wire_view * postscale`` into ``dst``, computed in ``dst``'s precision.

    Args:
        wire_view: the reduced wire buffer (``dst``'s shape, or 1-D).
        dst: the float32 or float64 gradient to overwrite (any layout).
        postscale: the factor (1.0: a plain cast).
    """
    scaled_copy(wire_view.reshape(dst.shape), dst, postscale, dst.dtype)


def compressed_allreduce(
    comm: MPI.Comm,
    wire_buf: Any,
    compression: Compression,
    chunk_bytes: int = transport.CHUNK_BYTES,
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
#: Pieces of a chunk that :class:`CastSum` casts while the piece before travels (:meth:`SliceSum.pipelined`).
#: ResNet-50 with fp16 at 1 Gbit/s, over the uncompressed call: 2 hosts x 2 ranks 0.55 (1 piece), 0.59 (2),
#: 0.51 (4), 0.51 (8); 4 hosts x 1 rank 0.61, 1.00 (a stalled run), 0.52, 0.51.
CAST_PIECES = 4


@functools.cache
def _float16_table() -> np.ndarray:
    """The float32 value of every float16 bit pattern (256 KiB, read-only): ``table[bits]`` is numpy's own cast,
    at 0.7 ns an element where the cast takes 1.2 (measured for 1 Mi elements on this machine)."""
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

    Two levels (``across``), as :class:`~mpi_gradreducer._core.transport.OrderedSum`
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
        self._moves = transport.Exchange(comm, wait)  # wait: see transport.Exchange
        self.across = across
        self.compression = compression
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

    What crosses hosts where compression applies only there
    (:meth:`~mpi_gradreducer._core.hosts.Hosts.ordered_sum`). In two levels it is
    the level across hosts: each host's ranks sum their gradients as they
    are, over shared memory, and only each host's sum crosses the links,
    divided by ``predivide`` and rounded once to 16 bits, where the hosts'
    sums are added in float32 and rounded again; each rank casts 1/(ranks per
    host) of the gradient each way. With one rank on each host ``summer``
    spans all the ranks, and each rank's chunk is cast where it lies. Either
    way each host sends half the bytes of the uncompressed sum, and a chunk
    goes in :data:`CAST_PIECES` pieces, each cast while the one before
    travels (:meth:`SliceSum.pipelined`).

    Args:
        summer: the 16-bit summer of the ranks with the same place on every host.
        dtype: the chunks' dtype (float32 or float64).
        predivide: each host's sum is divided by it before the cast (see
            ``Compression.scales``), and the result multiplied back.
    """

    def __init__(self, summer: SliceSum, dtype: Any, predivide: float) -> None:
        if summer.across is not None or summer.method != "alltoall":
            raise ValueError("summer: expected a flat SliceSum of the default method")
        self.summer, self.dtype = summer, np.dtype(dtype)
        self.pre, self.post = 1.0 / predivide, float(predivide)
        self._wire = np.empty(0, summer.compression.wire_dtype)

    def __call__(self, chunk: Any, scale: float = 1.0) -> int:
        """Sum ``chunk`` (of :attr:`dtype`) across ranks in place, times ``scale``; returns the collectives made."""
        assert chunk.dtype == self.dtype, (chunk.dtype, self.dtype)
        n = chunk.shape[0]
        if self._wire.shape[0] < n:
            self._wire = np.empty(n, self.summer.compression.wire_dtype)
        return self.summer.pipelined(chunk, self._wire[:n], self.pre, self.post * scale, CAST_PIECES)
