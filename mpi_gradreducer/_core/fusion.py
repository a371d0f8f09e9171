"""The plan's fusion buffers: each bucket's buffer, its views, the copies in and out of it."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import backend
from .compression import get_compression
from .dtypes import largest_finite, reduction_dtype, scaled_copy
from .options import Options
from .planning import DIRECT_BYTES, FIRST_BUCKET_BYTES, Bucket, ParamSpec, make_plan
from .transport import GATHER_MEMBERS, Gather

__all__ = ["FusionBuffer", "FusionPlan", "distinct_caps", "join_runs", "owner", "plan_for", "zeros"]


class FusionBuffer:
    """Owns one bucket's buffer (allocated on first use, then reused) and its views.

    Args:
        bucket: the bucket from the plan.
        shapes: the shape of each member, in bucket order.
        gather: copies many host members in one MPI call each way (else numpy copies each).
    """

    def __init__(self, bucket: Bucket, shapes: Sequence[tuple[int, ...]], gather: Gather | None = None) -> None:
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
        self._gather = gather if self.native and self._host and len(shapes) >= GATHER_MEMBERS else None
        self._take = operator.itemgetter(*bucket.indices)
        self._gathered = False  # the last pack went through the gather
        self._run: tuple[int, Any] | None = None  # (replay epoch, None or the buffer: in_place()'s answer then)
        self.buffer: Any = None
        self.views: list[Any] = []

    def allocate(self, buffer: Any = None) -> Any:
        """The buffer: allocated on the first call, or ``buffer`` (a 1-D slice of a larger block)."""
        if buffer is not None or self.buffer is None:
            b = self.bucket
            self.buffer = backend.empty(b.count, b.wire_dtype, b.device) if buffer is None else buffer
            self._gathered, self._run = False, None  # nothing packed into this buffer yet, nothing known of it
            self.views = [
                self.buffer[o : o + n].reshape(s) for o, n, s in zip(b.offsets, b.sizes, self._shapes, strict=True)
            ]
        return self.buffer

    def members_of(self, grads: Sequence[Any]) -> tuple[Any, ...]:
        """The bucket's entries of ``grads`` (one per parameter), in bucket order."""
        taken = self._take(grads)
        return taken if len(self.bucket.indices) > 1 else (taken,)

    def in_place(self, members: Sequence[Any], epoch: int | None = None) -> Any | None:
        """A 1-D view over all members where they lie, or None when they must be packed.

        That is the case for the reducer's own views (``allocate_grads``), for a
        single C-contiguous member, and for members lying back to back, in
        bucket order, in one C-contiguous base array. ``epoch``: the members
        are the replay epoch's armed gradients (see :class:`~.replay.Replay`),
        which lie where they lay: a "no" is kept for them (a view of the
        caller's memory is not: it would keep that memory alive).
        """
        if not self.native:
            return None
        if epoch is not None and self._run is not None and self._run[0] == epoch:
            return self._run[1]
        if self.views and all(g is v for g, v in zip(members, self.views, strict=True)):
            run = self.buffer
        elif len(members) == 1:
            run = backend.flat_view(members[0])
        else:
            run = _adjacent_run(members, self.bucket)
        self._run = (epoch, run) if epoch is not None and (run is None or run is self.buffer) else None
        return run

    def pack(self, members: Sequence[Any], scale: float = 1.0, skip: Sequence[bool] = (), epoch: int | None = None
             ) -> int:
        """Copy (and cast, and scale) the members into the buffer; skipped slots get zeros.

        ``epoch``: the members are the replay epoch's armed gradients (see
        :class:`~.transport.Gather`), or None.

        Returns:
            The number of device kernel launches made (0 on the host).
        """
        self.allocate()
        if not self._host:
            return self._device_copy(members, scale, False, skip)
        if self.native and scale == 1.0 and not skip:
            self._gathered = self._gather is not None and self._gather.pack(members, self.buffer, epoch)
            if self._gathered:
                return 0
            if len(members) < GATHER_MEMBERS:  # a few numpy copies cost less than one concatenate
                for v, g in zip(self.views, members, strict=True):
                    v[...] = g
            else:
                np.concatenate(members, axis=None, out=self.buffer)  # one C-level loop over all members
        else:
            for k, (v, g) in enumerate(zip(self.views, members, strict=True)):
                if skip and skip[k]:
                    v[...] = 0  # its slot still travels: zeros, never stale values or NaN
                else:
                    scaled_copy(g, v, scale, self._compute_dtype)
        return 0

    def unpack(self, members: Sequence[Any], scale: float = 1.0, skip: Sequence[bool] = (),
               packed: bool = False) -> int:
        """Copy (and cast, and scale) the reduced buffer back into the members.

        ``packed``: ``members`` are those of the last :meth:`pack`, in the same call.

        Returns:
            The number of device kernel launches made (0 on the host).
        """
        if not self._host:
            return self._device_copy(members, scale, True, skip)
        if self.native and scale == 1.0 and not skip:
            if self._gather is not None and self._gather.unpack(self.buffer, members, packed and self._gathered):
                return 0
            for v, g in zip(self.views, members, strict=True):  # the common case: one C call per member, nothing else
                g[...] = v
            return 0
        for k, (v, g) in enumerate(zip(self.views, members, strict=True)):
            if not (skip and skip[k]):
                scaled_copy(v, g, scale, self._compute_dtype)
        return 0

    def free(self) -> None:
        """Release what the copies hold in MPI (rebuilt when needed)."""
        if self._gather is not None:
            self._gather.free()

    def _device_copy(self, members: Sequence[Any], scale: float, unpack: bool, skip: Sequence[bool]) -> int:
        """One batched kernel for contiguous device members, else one copy per member; returns launches."""
        skipped = [k for k in range(len(members)) if skip and skip[k]]
        if not skipped and all(g.flags.c_contiguous for g in members):
            # the kernel covers the buffer from its start to its end: only without gaps
            return backend.batched_copy(members, self.buffer, self.bucket.offsets, scale, unpack)
        launches = 0
        for k in range(len(members)):
            v, g = self.views[k], members[k]
            if k in skipped:
                if not unpack:
                    v[...] = 0  # its slot still travels: zeros
                    launches += 1
                continue
            src, dst = (v, g) if unpack else (g, v)
            scaled_copy(src, dst, scale, self._compute_dtype)
            launches += 1
        return launches


def join_runs(a: Any, b: Any) -> Any | None:
    """One 1-D view covering host runs ``a`` and ``b`` when ``b`` starts where ``a`` ends, else None.

    Both must be views of one C-contiguous base array (as the blocks of
    ``allocate_grads`` are; the base may be of another dtype, such as the
    bytes of a huge-page mapping), so that one chunked Allreduce can run
    across the boundary.
    """
    base = a.base
    if not isinstance(base, np.ndarray) or b.base is not base or b.dtype != a.dtype or not base.flags.c_contiguous:
        return None
    if not (a.flags.c_contiguous and b.flags.c_contiguous):
        return None
    start = a.__array_interface__["data"][0]
    if b.__array_interface__["data"][0] != start + a.nbytes:
        return None
    first = start - base.__array_interface__["data"][0]
    return base.reshape(-1).view(np.uint8)[first : first + a.nbytes + b.nbytes].view(a.dtype)


def _adjacent_run(members: Sequence[Any], bucket: Bucket) -> Any | None:
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
    for g, off in zip(members, bucket.offsets, strict=True):
        if g.__array_interface__["data"][0] != start + off * itemsize:
            return None
    first = (start - base.__array_interface__["data"][0]) // itemsize
    return base.reshape(-1)[first : first + bucket.count]


class FusionPlan:
    """The buckets of a plan with their fusion buffers, and where each parameter travels.

    Args:
        specs: every parameter.
        buckets: the plan (from :func:`plan_for`).
        checked: the parameters whose gradients are looked at (not skipped).
        local: a duplicate of ``COMM_SELF`` for the buckets' :class:`~.transport.Gather`
            copies (None: numpy copies only).
    """

    def __init__(self, specs: Sequence[ParamSpec], buckets: Sequence[Bucket], checked: Sequence[int],
                 local: MPI.Intracomm | None = None) -> None:
        self.specs = tuple(specs)
        self.buffers = [FusionBuffer(b, [specs[i].shape for i in b.indices],
                                     None if local is None else Gather(local, k)) for k, b in enumerate(buckets)]
        #: For each parameter, its bucket, or -1.
        self.bucket_of = [-1] * len(specs)
        for k, b in enumerate(buckets):
            for i in b.indices:
                self.bucket_of[i] = k
        #: Parameters in some bucket, in plan order.
        self.bucketed = tuple(i for b in buckets for i in b.indices)
        self.checked = tuple(checked)
        #: Every parameter is on the host.
        self.host = all(backend.is_host(s.device) for s in self.specs)
        #: ``(shape, dtype)`` of every parameter.
        self.shapes_dtypes = [(s.shape, s.dtype) for s in self.specs]
        #: The views handed out by :meth:`allocate_grads` (None where none was).
        self.own_views: list[Any] = [None] * len(specs)
        #: How many of the checked parameters have such a view.
        self.own_count = 0
        self._stand_ins: list[Any] | None = None

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, in the order they are sent."""
        return tuple(f.bucket for f in self.buffers)

    def free(self) -> None:
        """Release what the buffers' copies hold in MPI."""
        for f in self.buffers:
            f.free()

    def buffer_owners(self) -> set[int]:
        """``id`` of the memory owner of every allocated fusion buffer."""
        return {id(owner(f.buffer)) for f in self.buffers if f.buffer is not None}

    def stand_ins(self) -> list[Any]:
        """What a rank that has joined reduces: the own views where there are, else arrays made once.

        None for the parameters that are not checked (skipped). The caller zeroes them.
        """
        if self._stand_ins is None or any(a is not v for a, v in zip(self._stand_ins, self.own_views, strict=True)
                                          if v is not None):
            self._stand_ins = [None] * len(self.specs)
            for i in self.checked:
                view = self.own_views[i]
                self._stand_ins[i] = view if view is not None else zeros(self.specs[i])
        return self._stand_ins

    def allocate_grads(self) -> list[Any]:
        """Zero-filled gradients; those of native buckets are views into one block per (device, dtype)."""
        grads: list[Any] = [None] * len(self.specs)
        groups: dict[tuple[str, str], list[FusionBuffer]] = {}
        for f in self.buffers:
            if f.native:
                groups.setdefault((f.bucket.device, f.bucket.dtype.str), []).append(f)
        for (device, _), members in groups.items():
            block = backend.empty(sum(f.bucket.count for f in members), members[0].bucket.dtype, device)
            block[...] = 0
            offset = 0
            for f in members:
                f.allocate(block[offset : offset + f.bucket.count])
                offset += f.bucket.count
                for i, v in zip(f.bucket.indices, f.views, strict=True):
                    grads[i] = self.own_views[i] = v
        for i, spec in enumerate(self.specs):
            if grads[i] is None:
                grads[i] = zeros(spec)
        self.own_count = sum(self.own_views[i] is not None for i in self.checked)
        return grads


def plan_for(specs: Sequence[ParamSpec], options: Options, bucket_bytes: int,
             local: MPI.Intracomm | None = None, compressed: bool = True) -> FusionPlan:
    """The reducer's plan: backward order, a small first bucket, large gradients alone.

    Host gradients travel in their own dtype (float16 and bfloat16 too: each
    rank then sums one slice in float32); with compression, float32 and
    float64 ones as 16-bit floats, unless not ``compressed`` (across hosts
    only what crosses them is: :attr:`.Hosts.casts_across`); device halves in
    float32.
    """
    comp = get_compression(options.wire_format) if compressed else None

    def wire_dtype(dtype: np.dtype, device: str) -> np.dtype:
        if not backend.is_host(device):
            return reduction_dtype(dtype)  # device halves are summed by MPI in float32
        if comp is not None and comp.applies_to(dtype):
            return comp.wire_dtype
        return np.dtype(dtype)  # host halves travel as 16 bits, summed slice by slice in float32

    exclude = list(options.skipped)
    if options.powersgd is not None:  # its gradients are reduced by the PowerSGD path (mpi_gradreducer._core.lowrank)
        for i in options.powersgd.compressed(specs, options.skipped):
            exclude[i] = True
    buckets = make_plan(
        specs, options.ids, bucket_bytes, DIRECT_BYTES, reverse=True,
        first_bucket_bytes=FIRST_BUCKET_BYTES, exclude=exclude, wire_dtype=wire_dtype,
    )
    return FusionPlan(specs, buckets, [i for i, skip in enumerate(options.skipped) if not skip], local)


def distinct_caps(specs: Sequence[ParamSpec], options: Options, caps: Sequence[int],
                  compressed: bool = True) -> list[int]:
    """The caps among ``caps`` that give different plans (the smallest of each kind; ``compressed``: as for
    :func:`plan_for`)."""
    seen, kept = set(), []
    for cap in caps:
        shape = tuple(b.indices for b in plan_for(specs, options, cap, compressed=compressed).buckets)
        if shape not in seen:
            seen.add(shape)
            kept.append(cap)
    return kept


def zeros(spec: ParamSpec) -> Any:
    """A new zero-filled array for a parameter like ``spec``, on its device."""
    a = backend.empty(spec.size, spec.dtype, spec.device).reshape(spec.shape)
    a[...] = 0
    return a


def owner(a: Any) -> Any:
    """The object that owns ``a``'s memory (the end of its chain of bases)."""
    base = getattr(a, "base", None)
    while base is not None:
        a, base = base, getattr(base, "base", None)
    return a
