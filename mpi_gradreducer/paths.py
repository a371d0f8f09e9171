"""Execution paths: one small strategy per kind of bucket, chosen when the plan is made.

Each path reduces a run of consecutive buckets of its kind: pack, collective,
unpack (or, where the gradients allow, the collective alone, in place).

========================  ==================================================================
path                      buckets
========================  ==================================================================
:class:`HostPath`         host buckets summed in their own dtype: in place where the members
                          lie back to back (consecutive buckets as one run), else packed
:class:`PackedPath`       host buckets summed in another dtype (float16, bfloat16: float32)
:class:`CompressedPath`   host buckets sent as 16-bit floats (``compression=``)
:class:`DevicePath`       the buckets of one GPU: CUDA-aware MPI, or staged through pinned memory
:class:`SparsePath`       the call's ``RowSparse`` gradients (``Allgatherv``), after the buckets
========================  ==================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from . import backend, compression as wire, transport
from .config import Options
from .dtypes import largest_finite
from .fusion import FusionBuffer, FusionPlan, join_runs
from .instrument import Instrument
from .sparse import allgather_rowsparse
from .staging import StagingPipeline

__all__ = ["Call", "Context", "assign"]


@dataclass
class Call:
    """One reduction: its number, the gradients, what validation found, what the sums showed.

    Attributes:
        number: the call's number (1 for the first).
        grads: the caller's gradients (RowSparse entries are replaced by their results).
        sparse: positions of RowSparse gradients in ``grads``.
        check_finite: look for NaN/Inf in the results.
        on_thread: reduced on the communication thread.
        nonfinite: a result held NaN or Inf (with ``check_finite``).
    """

    number: int
    grads: Any
    sparse: tuple[int, ...] = ()
    check_finite: bool = False
    on_thread: bool = False
    nonfinite: bool = False

    def members(self, f: FusionBuffer) -> list[Any]:
        """Bucket ``f``'s gradients, in bucket order."""
        return [self.grads[i] for i in f.bucket.indices]

    def dense(self, f: FusionBuffer) -> bool:
        """Whether no member of bucket ``f`` is row-sparse in this call."""
        return not self.sparse or not any(i in self.sparse for i in f.bucket.indices)

    def finite_check(self, limit: float) -> Callable[[Any], None] | None:
        """The per-chunk NaN/Inf test, when ``check_finite`` is on."""
        return (lambda chunk: self.check_chunk(chunk, limit)) if self.check_finite else None

    def check_chunk(self, chunk: Any, limit: float) -> None:
        """Flag NaN, Inf or a value beyond ``limit`` (min/max propagate NaN; no temporaries)."""
        if self.nonfinite or chunk.size == 0:
            return
        real = chunk.view(chunk.real.dtype) if chunk.dtype.kind == "c" else chunk
        if not (-limit <= float(real.min()) and float(real.max()) <= limit):
            self.nonfinite = True


@dataclass
class Context:
    """What every path shares: the communicator, the plan, the options, the instrument."""

    comm: MPI.Intracomm
    plan: FusionPlan
    options: Options
    instrument: Instrument
    compression: wire.Compression | None = None

    def allreduce(self, k: int, buf: Any, call: Call, scale: float | None = None) -> None:
        """Sum (and scale) bucket ``k``'s 1-D buffer ``buf`` in place, chunk by chunk."""
        scale = self.options.scale if scale is None else scale
        after = call.finite_check(self.plan.buffers[k].limit)
        self.instrument.stats.messages += self.instrument.collective(
            self.describe(k, call), transport.allreduce, self.comm, buf, scale, after=after)

    def describe(self, k: int, call: Call) -> Callable[[], str]:
        """What bucket ``k`` is, for the watchdog."""
        return lambda: f"call {call.number}, bucket {k} ({self.plan.buffers[k].bucket.nbytes} bytes)"

    def record(self, call: Call, ks: Sequence[int], t0: float, t1: float, t2: float, t3: float) -> None:
        """Count and trace the phases of buckets ``ks``."""
        nbytes = sum(self.plan.buffers[k].bucket.nbytes for k in ks)
        self.instrument.phases(call.number, ks, nbytes, t0, t1, t2, t3)


class PackedPath:
    """Pack into the bucket's buffer, sum it, unpack: buckets summed in another dtype."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def reduce(self, ks: Sequence[int], call: Call) -> None:
        """Reduce buckets ``ks`` (consecutive in the plan) of ``call``."""
        for k in ks:
            self.packed(k, call)

    def packed(self, k: int, call: Call) -> None:
        """Reduce bucket ``k`` through its buffer; row-sparse members travel as zeros."""
        f = self.ctx.plan.buffers[k]
        members = call.members(f)
        skip = [i in call.sparse for i in f.bucket.indices] if call.sparse else ()
        if skip and all(skip):
            return  # every member is row-sparse this call: gathered by SparsePath
        t0 = time.perf_counter()
        f.pack(members, self.pack_scale, skip)
        t1 = time.perf_counter()
        self.sum(k, f, call)
        t2 = time.perf_counter()
        f.unpack(members, self.unpack_scale, skip)
        self.ctx.record(call, (k,), t0, t1, t2, time.perf_counter())

    pack_scale = 1.0
    unpack_scale = 1.0

    def sum(self, k: int, f: FusionBuffer, call: Call) -> None:
        """Sum (and scale) the packed buffer of bucket ``k`` across ranks."""
        self.ctx.allreduce(k, f.buffer, call)  # scaled chunk by chunk, while in cache


class HostPath(PackedPath):
    """Host buckets summed in their own dtype: reduced where they lie when they can be.

    Consecutive buckets whose members lie back to back in one array (the
    blocks of ``allocate_grads``) are reduced as one chunked run.
    """

    def reduce(self, ks: Sequence[int], call: Call) -> None:
        """Reduce buckets ``ks`` (consecutive in the plan) of ``call``."""
        start = 0
        while start < len(ks):
            run = self._in_place(ks[start], call)
            end = start + 1
            if run is None:
                self.packed(ks[start], call)
                start = end
                continue
            while end < len(ks) and (nxt := self._in_place(ks[end], call)) is not None:
                joined = join_runs(run, nxt)
                if joined is None:
                    break
                run, end = joined, end + 1
            t0 = time.perf_counter()
            self.ctx.allreduce(ks[start], run, call)
            t2 = time.perf_counter()
            self.ctx.record(call, ks[start:end], t0, t0, t2, t2)
            start = end

    def _in_place(self, k: int, call: Call) -> Any | None:
        """The 1-D view over bucket ``k``'s gradients where they lie, if it can be reduced so."""
        f = self.ctx.plan.buffers[k]
        return f.in_place(call.members(f)) if call.dense(f) else None


class CompressedPath(PackedPath):
    """float32/float64 buckets sent as 16-bit floats, each rank summing one slice in float32."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        assert ctx.compression is not None
        self.pack_scale, self.unpack_scale = ctx.compression.scales(
            ctx.comm.Get_size(), ctx.options.degree, ctx.options.mean, ctx.options.predivide)

    def sum(self, k: int, f: FusionBuffer, call: Call) -> None:
        """Sum the wire buffer of bucket ``k`` across ranks (scaled on unpack)."""
        ctx = self.ctx
        ctx.instrument.stats.messages += ctx.instrument.collective(
            ctx.describe(k, call), wire.compressed_allreduce, ctx.comm, f.buffer, ctx.compression,
            after=call.finite_check(f.limit))


class DevicePath:
    """The buckets of one GPU: straight to a CUDA-aware MPI, or through pinned host slots.

    Args:
        ctx: the shared context.
        device: the buckets' device, ``"cuda:N"``.
    """

    def __init__(self, ctx: Context, device: str) -> None:
        self.ctx = ctx
        self.device = device
        self._ops: Any = None
        self._pipeline: StagingPipeline | None = None

    @property
    def ops(self) -> Any:
        """The backend's operations for this device (created on first use)."""
        if self._ops is None:
            self._ops = backend.ops_for(self.device)
            self._pipeline = StagingPipeline(self._ops)
        return self._ops

    def before_launch(self) -> None:
        """Make the caller's queued kernels finish before another thread reads the buffers."""
        self.ops.ready_for_mpi()

    def reduce(self, ks: Sequence[int], call: Call) -> None:
        """Reduce buckets ``ks`` (consecutive, all on this device) of ``call``."""
        ops = self.ops
        with ops.device:  # kernels, copies and cupy temporaries on the buckets' device, on any thread
            self._reduce(ks, call, ops)

    def _reduce(self, ks: Sequence[int], call: Call, ops: Any) -> None:
        ctx = self.ctx
        launches = 0
        t0 = time.perf_counter()
        buffers, packed = [], []
        for k in ks:
            f = ctx.plan.buffers[k]
            members = call.members(f)
            run = f.in_place(members)
            if run is None:
                launches += f.pack(members)
                run = f.buffer
                packed.append((f, members))
            buffers.append(run)
        t1 = time.perf_counter()
        if ctx.options.cuda_aware:
            ops.ready_for_mpi()
            for k, buf in zip(ks, buffers):
                ctx.allreduce(k, buf, call)
        else:
            assert self._pipeline is not None
            self._pipeline.run(buffers, lambda pos, host: ctx.allreduce(ks[pos], host, call))
        t2 = time.perf_counter()
        for f, members in packed:
            launches += f.unpack(members)
        if call.on_thread:
            ops.ready_for_mpi()  # results complete before wait() returns
        ctx.instrument.stats.launches += launches
        ctx.record(call, ks, t0, t1, t2, time.perf_counter())


@dataclass
class SparsePath:
    """The call's RowSparse gradients: every rank's rows on every rank, in index order."""

    ctx: Context
    _limits: dict[int, float] = field(default_factory=dict)

    def reduce(self, call: Call) -> None:
        """Gather each RowSparse gradient of ``call`` and put the result in ``call.grads``."""
        ctx = self.ctx
        for i in call.sparse:
            t0 = time.perf_counter()
            result = ctx.instrument.collective(
                lambda i=i: f"call {call.number}, RowSparse grads[{i}]", allgather_rowsparse,
                ctx.comm, call.grads[i], ctx.options.scale, ctx.options.coalesce,
            )
            ctx.instrument.stats.messages += 3
            if result.values.size:
                limit = largest_finite(ctx.plan.specs[i].dtype)
                check = call.finite_check(limit)
                if check is not None:
                    check(result.values.reshape(-1))
            call.grads[i] = result
            ctx.instrument.event("allgather", t0, time.perf_counter(), call=call.number, index=i)


def assign(ctx: Context) -> list[Any]:
    """The path of each bucket of ``ctx.plan`` (one object per kind, one per device)."""
    host, packed = HostPath(ctx), PackedPath(ctx)
    compressed = CompressedPath(ctx) if ctx.compression is not None else None
    devices: dict[str, DevicePath] = {}
    paths: list[Any] = []
    for f in ctx.plan.buffers:
        b = f.bucket
        if not backend.is_host(b.device):
            paths.append(devices.setdefault(b.device, DevicePath(ctx, b.device)))
        elif compressed is not None and b.wire_dtype == ctx.compression.wire_dtype:
            paths.append(compressed)
        else:
            paths.append(host if f.native else packed)
    return paths


def run(paths: Sequence[Any], ks: Sequence[int], call: Call) -> None:
    """Reduce buckets ``ks`` in order, each maximal run of one path in one go."""
    start = 0
    while start < len(ks):
        end = start + 1
        while end < len(ks) and paths[ks[end]] is paths[ks[start]]:
            end += 1
        paths[ks[start]].reduce(ks[start:end], call)
        start = end
