"""The seam between the buckets and the wire: a bucket hook sums one bucket of one call.

In the manner of PyTorch DDP's communication hooks: the reducer packs each
bucket (or takes it where it lies), hands it to the hook as a
:class:`GradBucket`, and unpacks what the hook leaves in its buffer. Without a
hook (``hook=None``) the reducer sums every bucket itself, with the header
riding on the first one and consecutive buckets of its own views as one run;
``compression="fp16"`` and ``"bf16"`` are the hook :class:`Cast`. A hook is any
callable ``hook(bucket) -> None``; it runs on every rank for every bucket, in
plan order (on the communication thread with ``progress="thread"``), and
must make the same collectives on every rank.

PowerSGD is not a bucket hook: it sums the products of every compressed
matrix of a call in one message each (two per call), where one hook call per
bucket would send two per bucket (ResNet-50's large gradients travel alone:
about fifty buckets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .options import Options
from .summers import Summer, Summers
from .wire import Compression, get_compression

__all__ = ["BucketHook", "Cast", "GradBucket", "bucket_hook"]

#: A bucket hook: ``hook(bucket)`` leaves the bucket's sum across ranks, times ``bucket.scale``, in ``bucket.buffer``.
BucketHook = Callable[["GradBucket"], None]


class GradBucket:
    """One bucket of one call, as a hook sees it (DDP's ``GradBucket``).

    Attributes:
        index: the bucket's place in the plan (``reducer.buckets[index]``).
        indices: the parameters it holds, in buffer order.
        buffer: its data, 1-D, in the gradients' dtype (packed, or where the
            gradients lie): the hook leaves the result here.
        scale: the factor of the result (``1 / degree`` for a mean, 1 for a sum).
        summers: the reducer's summing algorithms (``Summers``: ``ordered``, ``cast``, ``sliced``): flat, or in two
            levels across hosts.
    """

    __slots__ = ("index", "indices", "buffer", "scale", "summers", "_reduce")

    def __init__(self, index: int, indices: Any, buffer: Any, scale: float, summers: Summers,
                 reduce: Callable[..., None]) -> None:
        self.index, self.indices, self.buffer, self.scale, self.summers = index, indices, buffer, scale, summers
        self._reduce = reduce

    @property
    def dtype(self) -> np.dtype:
        """The buffer's dtype."""
        return np.dtype(self.buffer.dtype)

    def reduce(self, buf: Any = None, scale: float | None = None, summer: Summer | None = None,
               chunk_bytes: int | None = None) -> None:
        """The reducer's own sum of ``buf`` (default: :attr:`buffer`) across ranks, in place, times ``scale``
        (default: :attr:`scale`), chunk by chunk, watched by the watchdog.

        Args:
            buf: a 1-D contiguous array (host, or device for a CUDA-aware MPI).
            scale: the factor of the result.
            summer: how each host chunk is summed (from :attr:`summers`); default: the reducer's for the dtype.
            chunk_bytes: the bytes of ``buf`` summed at a time; default: the summers' own.
        """
        self._reduce(self.buffer if buf is None else buf, self.scale if scale is None else scale, summer,
                     chunk_bytes)


class Cast:
    """Compression as a hook: float32 and float64 buckets travel as 16-bit floats (``compression="fp16"``).

    Each rank's values are divided by ``predivide`` and rounded once to the
    format, summed in float32 in rank order, rounded again, and multiplied
    back and by the bucket's scale; across hosts only what crosses them is
    cast (:meth:`~mpi_gradreducer._core.summers.Summers.cast`). Buckets of
    other dtypes are summed as without it.

    Args:
        compression: the 16-bit format.
        predivide: see ``Options.predivide``; None: the format's default for the number of ranks.
    """

    def __init__(self, compression: Compression, predivide: float | None = None) -> None:
        self.compression, self.predivide = compression, predivide

    def __call__(self, bucket: GradBucket) -> None:
        """Sum ``bucket`` as 16 bits (or as it is, for a dtype the format does not apply to)."""
        dtype = bucket.dtype
        if not self.compression.applies_to(dtype):
            bucket.reduce()
            return
        summers = bucket.summers
        bucket.reduce(summer=summers.cast(dtype, self.compression, self.predivide),
                      chunk_bytes=summers.cast_chunk_bytes(dtype, self.compression))


def bucket_hook(options: Options) -> BucketHook | None:
    """What sums each bucket of a reducer with ``options``: the user's hook, :class:`Cast` for
    ``compression="fp16"``/``"bf16"``, or None (the reducer itself)."""
    if options.hook is not None:
        return options.hook
    name = options.wire_format
    return None if name is None else Cast(get_compression(name), options.predivide)
