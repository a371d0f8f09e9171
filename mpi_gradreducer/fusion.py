"""A bucket's fusion buffer and the copies in and out of it."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import backend
from .planning import Bucket

__all__ = ["FusionBuffer", "join_runs", "largest_finite"]


class FusionBuffer:
    """Owns one bucket's buffer (allocated on first use, then reused) and its views.

    Args:
        bucket: the bucket from the plan.
        shapes: the shape of each member, in bucket order.
    """

    def __init__(self, bucket: Bucket, shapes: Sequence[tuple[int, ...]]) -> None:
        self.bucket = bucket
        #: True when MPI sums the members' own dtype, so that they can be
        #: reduced where they lie instead of being packed.
        self.native = bucket.wire_dtype == bucket.dtype
        #: Largest finite magnitude of the members' dtype (results beyond it overflow).
        self.limit = largest_finite(bucket.dtype)
        # Scaling is computed in the wider of the two dtypes, then cast.
        self._compute_dtype = np.promote_types(bucket.dtype, bucket.wire_dtype)
        self._shapes = tuple(shapes)
        self._host = backend.is_host(bucket.device)
        self.buffer: Any = None
        self.views: list[Any] = []
        #: Kernel launches made by device packs and unpacks (for benchmarks).
        self.launches = 0

    def allocate(self, buffer: Any = None) -> Any:
        """The buffer: allocated on the first call, or ``buffer`` (a 1-D slice of a larger block)."""
        if buffer is not None or self.buffer is None:
            b = self.bucket
            self.buffer = backend.empty(b.count, b.wire_dtype, b.device) if buffer is None else buffer
            self.views = [
                self.buffer[o : o + n].reshape(s) for o, n, s in zip(b.offsets, b.sizes, self._shapes)
            ]
        return self.buffer

    def in_place(self, members: Sequence[Any]) -> Optional[Any]:
        """A 1-D view over all members where they lie, or None when they must be packed.

        That is the case for the reducer's own views (``allocate_grads``), for a
        single C-contiguous member, and for members lying back to back, in
        bucket order, in one C-contiguous base array.
        """
        if not self.native:
            return None
        if self.views and all(g is v for g, v in zip(members, self.views)):
            return self.buffer
        if len(members) == 1:
            return backend.flat_view(members[0])
        return _adjacent_run(members, self.bucket)

    def pack(self, members: Sequence[Any], scale: float = 1.0, skip: Sequence[bool] = ()) -> None:
        """Copy (and cast, and scale) the members into the buffer; skipped slots get zeros."""
        self.allocate()
        if not self._host:
            self._device_copy(members, scale, False, skip)
            return
        if self.native and scale == 1.0 and not skip:
            np.concatenate(members, axis=None, out=self.buffer)  # one C-level loop over all members
            return
        with np.errstate(over="ignore"):  # beyond a 16-bit wire format's range: inf, as in IEEE
            self._pack(members, scale, skip)

    def _pack(self, members: Sequence[Any], scale: float, skip: Sequence[bool]) -> None:
        for k, (v, g) in enumerate(zip(self.views, members)):
            if skip and skip[k]:
                v[...] = 0  # its slot still travels: zeros, never stale values or NaN
                continue
            if scale == 1.0:
                np.copyto(v, g, casting="unsafe")
            else:
                np.multiply(g, scale, out=v, dtype=self._compute_dtype, casting="unsafe")

    def unpack(self, members: Sequence[Any], scale: float = 1.0, skip: Sequence[bool] = ()) -> None:
        """Copy (and cast, and scale) the reduced buffer back into the members."""
        if not self._host:
            self._device_copy(members, scale, True, skip)
            return
        if not self.native:
            with np.errstate(over="ignore"):  # a sum beyond float16's range becomes inf, as in IEEE
                self._unpack(members, scale, skip)
        else:
            self._unpack(members, scale, skip)

    def _unpack(self, members: Sequence[Any], scale: float, skip: Sequence[bool]) -> None:
        for k, (v, g) in enumerate(zip(self.views, members)):
            if skip and skip[k]:
                continue
            if scale == 1.0:
                np.copyto(g, v, casting="unsafe")
            else:
                np.multiply(v, scale, out=g, dtype=self._compute_dtype, casting="unsafe")


    def _device_copy(self, members: Sequence[Any], scale: float, unpack: bool, skip: Sequence[bool]) -> None:
        """One batched kernel for contiguous device members, else one copy per member."""
        skipped = [k for k in range(len(members)) if skip and skip[k]]
        if not skipped and all(g.flags.c_contiguous for g in members):
            # the kernel covers the buffer from its start to its end: only without gaps
            self.launches += backend.batched_copy(members, self.buffer, self.bucket.offsets, scale, unpack)
            return
        for k in range(len(members)):
            v, g = self.views[k], members[k]
            if k in skipped:
                if not unpack:
                    v[...] = 0  # its slot still travels: zeros
                    self.launches += 1
                continue
            src, dst = (v, g) if unpack else (g, v)
            dst[...] = src if scale == 1.0 else src * scale
            self.launches += 1


def join_runs(a: Any, b: Any) -> Optional[Any]:
    """One 1-D view covering host runs ``a`` and ``b`` when ``b`` starts where ``a`` ends, else None.

    Both must be views of one C-contiguous base array of their dtype (as the
    blocks of ``allocate_grads`` are), so that one chunked Allreduce can run
    across the boundary.
    """
    base = a.base
    if not isinstance(base, np.ndarray) or b.base is not base or base.dtype != a.dtype or b.dtype != a.dtype:
        return None
    if not base.flags.c_contiguous:
        return None
    start = a.__array_interface__["data"][0]
    if b.__array_interface__["data"][0] != start + a.nbytes:
        return None
    first = (start - base.__array_interface__["data"][0]) // a.itemsize
    return base.reshape(-1)[first : first + a.size + b.size]


def largest_finite(dtype: np.dtype) -> float:
    """Largest finite magnitude of a float (or complex) dtype, bfloat16 included."""
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)
    return float(np.finfo(dtype).max)


def _adjacent_run(members: Sequence[Any], bucket: Bucket) -> Optional[Any]:
    """A view of the members' common base when they lie back to back in bucket order."""
    base = members[0].base
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous or not base.flags.writeable:
        return None
    if base.dtype != bucket.dtype:
        return None
    for g in members:
        if g.base is not base or not g.flags.c_contiguous:
            return None
    itemsize = bucket.dtype.itemsize
    start = members[0].__array_interface__["data"][0]
    for g, off in zip(members, bucket.offsets):
        if g.__array_interface__["data"][0] != start + off * itemsize:
            return None
    first = (start - base.__array_interface__["data"][0]) // itemsize
    return base.reshape(-1)[first : first + bucket.count]
