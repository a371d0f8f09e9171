"""Execution paths: one small strategy per kind of bucket, chosen when the plan is made.

Each path reduces a run of consecutive buckets of its kind: pack, collective,
unpack (or, where the gradients allow, the collective alone, in place).

========================  ==================================================================
path                      buckets
========================  ==================================================================
:class:`HostPath`         host buckets of 32/64-bit floats and complex: in place where the
                          members lie back to back (consecutive buckets as one run), else
                          packed (:class:`PackedPath`, the base of the host paths)
:class:`HalfPath`         host float16/bfloat16 buckets: 16 bits on the wire, summed in float32
:class:`CompressedPath`   float32/float64 host buckets sent as 16-bit floats (``compression=``)
:class:`DevicePath`       the buckets of one GPU: CUDA-aware MPI, or staged through pinned memory
:class:`SparsePath`       the call's ``RowSparse`` gradients (``Allgatherv``), after the buckets
========================  ==================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from . import backend, compression as wire, control, transport
from .call import Call
from .dtypes import largest_finite, scaled_copy
from .fusion import FusionBuffer, FusionPlan, join_runs
from .hosts import Hosts
from .instrument import Instrument
from .options import Options
from .sparse import allgather_rowsparse
from .staging import StagingPipeline, reduce_direct
from .topology import Topology

__all__ = ["HEAD_BYTES", "Context", "assign", "run"]

#: Bytes of the first bucket that travel with the call header (the rest follows in its own messages).
HEAD_BYTES = 64 << 10


class Context:
    """What every path shares: the communicator, the plan, the options, the instrument.

    It also knows which bucket's first message carries the call header (the
    first bucket, where it is a host bucket of 32 or 64-bit floats; else the
    header travels alone).
    """

    def __init__(self, comm: MPI.Intracomm, plan: FusionPlan, options: Options, instrument: Instrument,
                 compression: wire.Compression | None = None, hosts: Hosts | None = None) -> None:
        self.comm, self.plan, self.options, self.instrument = comm, plan, options, instrument
        #: Which ranks share a host: it makes the summers (two levels across hosts); flat without it.
        self.hosts = hosts if hosts is not None else Hosts(comm, Topology.of(comm), two_levels=False)
        self.compression = compression
        #: The compression that only the sums across hosts take (:attr:`.Hosts.casts_across`; the buckets are
        #: then uncompressed).
        self.across_hosts = compression if compression is not None and self.hosts.casts_across else None
        first = plan.buffers[0].bucket if plan.buffers else None
        carried = (first is not None and backend.is_host(first.device)
                   and not (compression is not None and first.wire_dtype == compression.wire_dtype)
                   and not self.cast_across(first)  # all of a compressed bucket is summed so
                   and control.carries(first.wire_dtype, comm.Get_size()))
        #: The bucket whose first message carries the header, or None.
        self.carrier: int | None = 0 if carried else None
        self._message: Any = None  # the carrier's first message: header, then its head
        self._slots: Any = None  # its header, as real values
        self._body: Any = None  # the rest: the carrier's first elements
        self._summers: dict[tuple[np.dtype, bool], transport.Summer] = {}  # by dtype and cast across hosts
        self._head_count = 0 if first is None else min(first.count, max(1, HEAD_BYTES // first.wire_dtype.itemsize))
        #: The carrier when all of it travels in the first message (a small model's one bucket), else None.
        self.whole_with_header = self.carrier if first is not None and first.count <= self._head_count else None
        if self.whole_with_header is not None:  # a small first bucket is packed behind the header
            self._first_message()
            plan.buffers[0].allocate(self._body)  # (until allocate_grads gives it another buffer)

    def _first_message(self) -> Any:
        """The buffer of the first message (allocated once), its header slots and its body."""
        if self._message is None:
            b = self.plan.buffers[0].bucket
            lead = control.lead(b.wire_dtype)
            self._message = backend.empty(lead + self.head_count(), b.wire_dtype, "cpu")
            self._slots = control.real_view(self._message[:lead])
            self._body = self._message[lead:]
        return self._message

    def head_count(self) -> int:
        """Elements of the carrier bucket that travel with the header."""
        return self._head_count

    def first_message(self, call: Call, head: Any = None, packed: bool = False, header: bool = True) -> None:
        """Sum the header (and the carrier's first elements, ``head``; zeros if None) and settle the call.

        ``packed``: ``head`` is the start of the carrier's own buffer, which
        may lie right behind the header already. Raises on every rank when
        some rank's input is bad; nothing of the caller's has been modified
        then. Without ``header``, the same message carries zeros in the
        header's place: the head of a call whose header went ahead travels in
        a message of the same length, at the same offset, and so is summed
        to the same bits.
        """
        msg = self._first_message()
        slots = self._slots
        if header:
            call.local.write(slots)
        else:
            slots[...] = 0
        body = self._body
        same = packed and self.plan.buffers[0].buffer is body  # the carrier's buffer is the body itself
        if head is None:
            body[...] = 0
        elif not same:
            body[...] = head
        if self.comm.Get_size() > 1:
            if self.options.deterministic:  # the header's sums are exact in any order
                self.instrument.collective(self.describe(0), call.number, self.summer(msg.dtype), msg)
            else:
                self.instrument.collective(self.describe(0), call.number,
                                           self.comm.Allreduce, MPI.IN_PLACE, msg, op=MPI.SUM)
        self.instrument.stats.messages += 1
        if header:
            assert call.settle is not None
            call.settle(control.Summary.of(slots))
        if head is not None:
            scaled_copy(body, body if same else head, call.scale)
            check = call.finite_check(self.plan.buffers[0].limit)
            if check is not None:
                check(head)

    def take_head(self, k: int, data: Any, call: Call) -> Any:
        """What of bucket ``k``'s 1-D ``data`` is left to reduce once the header has gone.

        On the carrier bucket, the first elements travel with the header (now,
        if it is still pending, or they already went as zeros with it, on a
        rank that has joined); when the header went ahead on its own, they
        travel now in a message of the first message's layout (so that they
        are summed to the same bits); elsewhere nothing is taken.
        """
        if k != self.carrier:
            return data
        m = self.head_count()
        if call.head == "pending":
            self.first_message(call, data[:m], packed=data is self.plan.buffers[k].buffer)
            call.head = "sent"
        elif call.head == "ahead":
            if call.info is None or call.info.sharded:
                return data
            self.first_message(call, data[:m], packed=data is self.plan.buffers[k].buffer, header=False)
        return data[m:]

    def summer(self, dtype: np.dtype, cast: bool = False) -> transport.Summer:
        """The summer of ``dtype`` host chunks on the reducer's communicator (made once): in rank order, or in
        two levels across hosts; with ``cast``, the sums cross hosts compressed (:meth:`cast_across`)."""
        summer = self._summers.get((dtype, cast))
        if summer is None:
            summer = self._summers[dtype, cast] = self.hosts.ordered_sum(
                dtype, compression=self.across_hosts if cast else None, predivide=self.options.predivide)
        return summer

    def cast_across(self, bucket: Any) -> bool:
        """Whether ``bucket``'s sums cross hosts compressed: a host bucket of a compressible dtype, with
        :attr:`across_hosts` (every chunk then goes through :meth:`summer`, and counts 16 bits a value)."""
        return (self.across_hosts is not None and backend.is_host(bucket.device)
                and self.across_hosts.applies_to(bucket.dtype))

    def allreduce(self, k: int, buf: Any, call: Call, every_chunk: bool = False) -> None:
        """Sum (and scale) ``buf``, bucket ``k``'s 1-D data (or what is left of it), in place, chunk by chunk.

        ``every_chunk``: sum every chunk in rank order (as ``deterministic`` does), so that the
        result does not depend on where the chunks begin.
        """
        if call.void or buf.shape[0] == 0:
            return
        after = call.finite_check(self.plan.buffers[k].limit)
        cast = self.cast_across(self.plan.buffers[k].bucket)  # not a device bucket staged through host memory
        ordered = self.summer(buf.dtype, cast) if isinstance(buf, np.ndarray) else None
        every_chunk = every_chunk or self.options.deterministic or cast
        self.instrument.stats.messages += self.instrument.collective(
            self.describe(k), call.number, transport.allreduce, self.comm, buf, call.scale, self.hosts.chunk_bytes,
            after=after, ordered=ordered, every_chunk=every_chunk)

    def describe(self, k: int) -> Callable[[], str]:
        """What bucket ``k`` is, for the watchdog."""
        return lambda: f"bucket {k} ({self.plan.buffers[k].bucket.nbytes} bytes)"

    def record(self, call: Call, ks: Sequence[int], t0: float, t1: float, t2: float, t3: float) -> None:
        """Count and trace the phases of buckets ``ks``."""
        nbytes = sum(self._wire_bytes(self.plan.buffers[k].bucket) for k in ks)
        self.instrument.phases(call.number, ks, nbytes, t0, t1, t2, t3)

    def _wire_bytes(self, bucket: Any) -> int:
        """``bucket``'s bytes in the format it crosses hosts (16 bits a value where cast across hosts)."""
        if self.across_hosts is not None and self.cast_across(bucket):
            return bucket.count * self.across_hosts.wire_dtype.itemsize
        return int(bucket.nbytes)


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
        sparse = call.sparse
        skip = [i in sparse for i in f.bucket.indices] if sparse else ()
        if (skip and all(skip)) or call.void:  # gathered by SparsePath, or nobody contributes
            if k == self.ctx.carrier and call.head == "pending":
                self.ctx.first_message(call)  # the header still goes, with the zeros the others see here
                call.head = "sent"
            return
        pre, post = self.scales(call)
        t0 = time.perf_counter()
        f.pack(members, pre, skip, call.epoch)
        t1 = time.perf_counter()
        self.sum(k, f, call)
        t2 = time.perf_counter()
        if not call.void:
            f.unpack(members, post, skip, packed=True)
        self.ctx.record(call, (k,), t0, t1, t2, time.perf_counter())

    def scales(self, call: Call) -> tuple[float, float]:
        """Factors applied when packing and when unpacking (the sum itself is scaled by ``call.scale``).

        Returns:
            ``(pack factor, unpack factor)``: 1 and 1 for buckets summed in their own dtype.
        """
        return 1.0, 1.0

    def before_launch(self) -> Any:
        """On the training thread, when a batch is handed to the communication thread (nothing on the host)."""
        return None

    def after_wait(self) -> None:
        """On the training thread, at the end of ``wait()`` (nothing on the host)."""

    #: What ``before_launch`` returned for the batch being reduced (host paths: nothing).
    launched: Any = None

    def sum(self, k: int, f: FusionBuffer, call: Call) -> None:
        """Sum (and scale) the packed buffer of bucket ``k`` across ranks."""
        self.reduce_buffer(k, self.ctx.take_head(k, f.buffer, call), call)

    def reduce_buffer(self, k: int, buf: Any, call: Call, every_chunk: bool = False) -> None:
        """The collective: sum (and scale) ``buf`` of bucket ``k`` in place, chunk by chunk, while in cache.

        ``every_chunk``: every chunk in rank order (see :meth:`Context.allreduce`).
        """
        self.ctx.allreduce(k, buf, call, every_chunk)


class HostPath(PackedPath):
    """Host buckets summed in their own dtype: reduced where they lie when they can be.

    Consecutive buckets whose members lie back to back in one array (the
    blocks of ``allocate_grads``) are reduced as one chunked run.
    """

    def reduce(self, ks: Sequence[int], call: Call) -> None:
        """Reduce buckets ``ks`` (consecutive in the plan) of ``call``."""
        if len(ks) == 1 and call.head == "pending" and ks[0] == self.ctx.whole_with_header and not call.sparse:
            self._whole_with_header(call)
            return
        start = 0
        while start < len(ks):
            run = self._in_place(ks[start], call)
            end = start + 1
            if run is None or call.void:
                self.packed(ks[start], call)
                start = end
                continue
            t0 = time.perf_counter()
            run = self.ctx.take_head(ks[start], run, call)
            # The same on every rank. Which buckets go together in an asynchronous call depends on
            # each rank's order of ready(): there, each bucket is its own run.
            views = call.info is not None and call.info.runs
            joins = views and call.info is not None and not call.info.asynchronous
            while joins and end < len(ks) and (nxt := self._in_place(ks[end], call)) is not None:
                joined = join_runs(run, nxt)
                if joined is None:
                    break
                run, end = joined, end + 1
            self.reduce_buffer(ks[start], run, call, every_chunk=views)  # the same sums, joined or not
            t2 = time.perf_counter()
            self.ctx.record(call, ks[start:end], t0, t0, t2, t2)
            start = end

    def _whole_with_header(self, call: Call) -> None:
        """The carrier bucket, all of it in the first message: one message, packed or where it lies.

        What :meth:`packed` and :meth:`Context.take_head` do for it, in one
        step (a small model's call is mostly such steps).
        """
        ctx = self.ctx
        f = ctx.plan.buffers[0]
        members = call.members(f)
        run = f.in_place(members, call.epoch)
        packed = run is None  # else reduced where it lies (the reducer's own views, one array, one block)
        t0 = time.perf_counter()
        if packed:
            f.pack(members, 1.0, (), call.epoch)
            run = f.buffer
        t1 = time.perf_counter()
        ctx.first_message(call, run, packed=run is f.buffer)
        call.head = "sent"
        t2 = time.perf_counter()
        if packed:  # only what this call packed is unpacked
            f.unpack(members, 1.0, (), packed=True)
        ctx.record(call, (0,), t0, t1, t2, time.perf_counter())

    def _in_place(self, k: int, call: Call) -> Any | None:
        """The 1-D view over bucket ``k``'s gradients where they lie, if it can be reduced so."""
        f = self.ctx.plan.buffers[k]
        return f.in_place(call.members(f), call.epoch) if call.dense(f) else None


class HalfPath(HostPath):
    """float16 and bfloat16 host buckets: sent as 16 bits, each rank summing one slice in float32.

    MPI has no half-precision sum; summing in float32 on our side (the
    compressed path's way) sends half the bytes of a float32 buffer, needs no
    cast, and reduces contiguous gradients where they lie.
    """

    def __init__(self, ctx: Context, dtype: np.dtype) -> None:
        super().__init__(ctx)
        self._summer = ctx.hosts.slice_sum(wire.half_format(dtype))

    def reduce_buffer(self, k: int, buf: Any, call: Call, every_chunk: bool = False) -> None:
        """Sum ``buf`` slice by slice in float32 (always in rank order), scaled, rounded once."""
        _slice_sum(self.ctx, self._summer, k, buf, call, call.scale)


class CompressedPath(PackedPath):
    """float32/float64 buckets sent as 16-bit floats, each rank summing one slice in float32."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        assert ctx.compression is not None
        self._summer = ctx.hosts.slice_sum(ctx.compression)

    def scales(self, call: Call) -> tuple[float, float]:
        """Pre-division before the cast to 16 bits, and its inverse with the mean after."""
        ctx = self.ctx
        assert ctx.compression is not None
        return ctx.compression.scales(ctx.comm.Get_size(), call.degree, ctx.options.mean, ctx.options.predivide)

    def sum(self, k: int, f: FusionBuffer, call: Call) -> None:
        """Sum the wire buffer of bucket ``k`` across ranks (scaled on unpack)."""
        _slice_sum(self.ctx, self._summer, k, f.buffer, call, 1.0)


def _slice_sum(ctx: Context, summer: wire.SliceSum, k: int, buf: Any, call: Call, scale: float) -> None:
    """Sum bucket ``k``'s 16-bit ``buf`` chunk by chunk, each rank one slice in float32 (reused buffers)."""
    ctx.instrument.stats.messages += ctx.instrument.collective(
        ctx.describe(k), call.number, summer.reduce, buf, scale, call.finite_check(ctx.plan.buffers[k].limit))


class DevicePath:
    """The buckets of one GPU: straight to a CUDA-aware MPI, or through pinned host slots.

    Work is queued on the caller's current stream for a blocking call; on a
    communication thread it runs on the device's own work stream, after an
    event recorded on the caller's stream at launch, and the caller's stream
    waits for the last unpack at ``wait()``. Each bucket is packed just before
    its download and unpacked right after its upload (see :mod:`staging`).

    Args:
        ctx: the shared context.
        device: the buckets' device, ``"cuda:N"``.
    """

    def __init__(self, ctx: Context, device: str) -> None:
        self.ctx = ctx
        self.device = device
        self._ops: Any = None
        self._pipeline: StagingPipeline | None = None
        #: The event the next batch on the communication thread waits for (set by the thread, in order).
        self.launched: Any = None
        self._done: Any = None  # the last batch's done-event, for wait()

    @property
    def ops(self) -> Any:
        """The backend's operations for this device (created on first use)."""
        if self._ops is None:
            self._ops = backend.ops_for(self.device)
            self._pipeline = StagingPipeline(self._ops)
        return self._ops

    def before_launch(self) -> Any:
        """On the training thread, at launch: an event after the caller's queued kernels."""
        with self.ops.device:
            return self.ops.record()

    def after_wait(self) -> None:
        """On the training thread, in ``wait()``: order the caller's stream after the thread's unpacks."""
        if self._done is not None:
            with self.ops.device:
                self.ops.wait_event(self._done)
            self._done = None

    def reduce(self, ks: Sequence[int], call: Call) -> None:
        """Reduce buckets ``ks`` (consecutive, all on this device) of ``call``."""
        if call.void:
            return
        ops = self.ops
        with ops.device:  # kernels, copies and cupy temporaries on the buckets' device, on any thread
            if not call.on_thread:
                ops.begin_call()
                self._reduce(ks, call, ops)
                ops.end_call()
                return
            with ops.own_stream():
                if self.launched is not None:
                    ops.wait_event(self.launched)
                ops.begin_call()
                self._reduce(ks, call, ops)
                self._done = ops.end_call()

    def _reduce(self, ks: Sequence[int], call: Call, ops: Any) -> None:
        ctx = self.ctx
        launches = [0]
        t0 = time.perf_counter()
        buffers, members = [], []
        for k in ks:
            f = ctx.plan.buffers[k]
            mine = call.members(f)
            run = f.in_place(mine)
            members.append(None if run is not None else mine)
            buffers.append(run if run is not None else f.allocate())

        def pack(pos: int) -> None:
            m = members[pos]
            if m is not None:
                launches[0] += ctx.plan.buffers[ks[pos]].pack(m)

        def unpack(pos: int) -> None:
            m = members[pos]
            if m is not None:
                launches[0] += ctx.plan.buffers[ks[pos]].unpack(m)

        def reduce(pos: int, buf: Any) -> None:
            ctx.allreduce(ks[pos], buf, call)

        if ctx.options.cuda_aware:
            reduce_direct(ops, buffers, reduce, pack, unpack)
        else:
            assert self._pipeline is not None
            self._pipeline.run(buffers, reduce, pack, unpack)
        ctx.instrument.stats.launches += launches[0]
        t1 = time.perf_counter()  # pack, MPI and unpack interleave: the whole counts as MPI time
        ctx.record(call, ks, t0, t0, t1, t1)


@dataclass
class SparsePath:
    """The call's RowSparse gradients: every rank's rows on every rank, in index order."""

    ctx: Context

    def reduce(self, call: Call) -> None:
        """Gather each RowSparse gradient of ``call`` and put the result in ``call.grads``."""
        ctx = self.ctx
        for i in call.sparse if call.gather_sparse and not call.void else ():
            t0 = time.perf_counter()
            result = ctx.instrument.collective(
                partial("RowSparse grads[{}]".format, i), call.number, allgather_rowsparse,
                ctx.comm, call.grads[i], call.scale, ctx.options.coalesce,
            )
            rows_hold_values = int(np.prod(ctx.plan.specs[i].shape[1:], dtype=np.int64)) > 0
            ctx.instrument.stats.messages += 3 if rows_hold_values else 2  # counts, indices, values
            if result.values.size:
                limit = largest_finite(ctx.plan.specs[i].dtype)
                check = call.finite_check(limit)
                if check is not None:
                    check(result.values.reshape(-1))
            call.grads[i] = result
            ctx.instrument.event("allgather", t0, time.perf_counter(), call=call.number, index=i)


def assign(ctx: Context) -> list[Any]:
    """The path of each bucket of ``ctx.plan`` (one object per kind, one per device).

    Returns:
        One path per bucket, in plan order; consecutive buckets of one path
        are reduced together by :func:`run`.
    """
    host = HostPath(ctx)
    compressed = CompressedPath(ctx) if ctx.compression is not None and ctx.across_hosts is None else None
    devices: dict[str, DevicePath] = {}
    halves: dict[str, HalfPath] = {}
    paths: list[Any] = []
    for f in ctx.plan.buffers:
        b = f.bucket
        if not backend.is_host(b.device):
            paths.append(devices.setdefault(b.device, DevicePath(ctx, b.device)))
        elif compressed is not None and b.dtype != b.wire_dtype:
            paths.append(compressed)
        elif b.wire_dtype.itemsize == 2:
            paths.append(halves.setdefault(b.wire_dtype.name, HalfPath(ctx, b.wire_dtype)))
        else:
            paths.append(host)
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
