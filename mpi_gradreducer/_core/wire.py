"""Wire formats: float32/float64 gradients sent as 16-bit floats, and nothing else.

A :class:`Compression` is a format, in the manner of Horovod's
``Compressor``: its 16-bit dtype, the pre- and post-scaling that keep a sum in
range, and the casts in and out (:func:`pack`, :func:`unpack`, one numpy pass
each). How a 16-bit buffer is summed across ranks is a summer's business
(:class:`~mpi_gradreducer._core.halves.SliceSum`: MPI has no half-precision
sum, so each rank adds one slice in float32), and which buckets travel so is
a hook's (:class:`~mpi_gradreducer._core.hooks.Cast`)::

    comp = get_compression("fp16")
    pre, post = comp.scales(size=comm.Get_size(), degree=degree, mean=True)
    pack(grad, wire, pre)                   # wire = grad * pre, as float16
    compressed_allreduce(comm, wire, comp)  # wire = sum over ranks (halves)
    unpack(wire, grad, post)                # grad = wire * post, as float32

:meth:`Compression.op` is the format's sum as a user-defined MPI op (for
``method="allreduce"`` of :class:`~mpi_gradreducer._core.halves.SliceSum`: every level of MPI's reduction tree
then rounds); each :class:`Compression` owns at most one, created on first
use and released by :meth:`Compression.free` (mpi4py allows only a few dozen
live user-defined ops per process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
from mpi4py import MPI

from .dtypes import scaled_copy

__all__ = ["COMPRESSIONS", "Compression", "get_compression", "half_format", "pack", "unpack"]

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
