"""Execution paths: one small strategy per kind of bucket, chosen when the plan is made.

Each path reduces a run of consecutive buckets of its kind: pack, sum,
unpack (or, where the gradients allow, the sum alone, in place). How a
bucket is summed is the context's (:class:`~.context.Context`: the reducer's
summers, or a bucket hook).

========================  ==================================================================
path                      buckets
========================  ==================================================================
:class:`HostPath`         host buckets: in place where the members lie back to back
                          (consecutive buckets of the reducer's own views as one run), else
                          packed into the bucket's buffer
:class:`DevicePath`       the buckets of one GPU: CUDA-aware MPI, or staged through pinned memory
:class:`SparsePath`       the call's ``RowSparse`` gradients (``Allgatherv``), after the buckets
========================  ==================================================================
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from . import backend
from .call import Call
from .context import Context
from .dtypes import largest_finite
from .fusion import join_runs
from .sparse import allgather_rowsparse
from .staging import StagingPipeline, reduce_direct

__all__ = ["DevicePath", "HostPath", "SparsePath", "assign", "runs"]


class HostPath:
    """Host buckets: reduced where they lie when they can be, else packed, summed and unpacked.

    Consecutive buckets whose members lie back to back in one array (the
    blocks of ``allocate_grads``) are reduced as one chunked run where no
    hook sums them.
    """

    #: What ``before_launch`` returned for the batch being reduced (host paths: nothing).
    launched: Any = None

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def before_launch(self) -> Any:
        """On the training thread, when a batch is handed to the communication thread (nothing on the host)."""
        return None

    def after_wait(self) -> None:
        """On the training thread, at the end of ``wait()`` (nothing on the host)."""

    def reduce(self, ks: Sequence[int], call: Call) -> None:
        """Reduce buckets ``ks`` (consecutive in the plan) of ``call``."""
        ctx = self.ctx
        first = ctx.first
        if ks[0] == 0 and first.whole and call.head == "pending" and not call.sparse:
            self._whole_with_header(call)
            ks = ks[1:]
        buffers = ctx.plan.buffers
        count = len(ks)
        start = 0
        while start < count:
            k = ks[start]
            f = buffers[k]
            dense = not call.sparse or call.dense(f)
            run = f.in_place(f.members_of(call.grads), call.epoch) if dense and not call.void else None
            end = start + 1
            if run is None:
                self._packed(k, call)
                start = end
                continue
            t0 = time.perf_counter()
            run = first.take_head(k, run, call)  # the header may go now: what follows reads the verdict
            info = call.info
            runs = info is not None and info.runs and ctx.hook is None
            # The same on every rank. Which buckets go together in an asynchronous call depends on each rank's
            # order of ready(): there, each bucket is its own run.
            joins = runs and info is not None and not info.asynchronous
            while joins and end < count:
                nxt = buffers[ks[end]]
                following = nxt.in_place(nxt.members_of(call.grads), call.epoch) \
                    if not call.sparse or call.dense(nxt) else None
                joined = None if following is None else join_runs(run, following)
                if joined is None:
                    break
                run, end = joined, end + 1
            ctx.reduce(k, run, call, every_chunk=runs)  # the same sums, joined or not
            t2 = time.perf_counter()
            ctx.record(call, ks[start:end], t0, t0, t2, t2)
            start = end

    def _packed(self, k: int, call: Call) -> None:
        """Reduce bucket ``k`` through its buffer; row-sparse members travel as zeros."""
        ctx = self.ctx
        f = ctx.plan.buffers[k]
        members = call.members(f)
        sparse = call.sparse
        skip = [i in sparse for i in f.bucket.indices] if sparse else ()
        if (skip and all(skip)) or call.void:  # gathered by SparsePath, or nobody contributes
            if k == ctx.first.carrier and call.head == "pending":
                ctx.first.send(call)  # the header still goes, with the zeros the others see here
            return
        t0 = time.perf_counter()
        f.pack(members, 1.0, skip, call.epoch)
        t1 = time.perf_counter()
        ctx.reduce(k, ctx.first.take_head(k, f.buffer, call), call)
        t2 = time.perf_counter()
        if not call.void:
            f.unpack(members, 1.0, skip, packed=True)
        ctx.record(call, (k,), t0, t1, t2, time.perf_counter())

    def _whole_with_header(self, call: Call) -> None:
        """The carrier bucket, all of it in the first message: one message, packed or where it lies.

        What :meth:`_packed` and :meth:`.FirstMessage.take_head` do for it, in
        one step (a small model's call is mostly such steps).
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
        ctx.first.send(call, run, packed=run is f.buffer)
        t2 = time.perf_counter()
        if packed:  # only what this call packed is unpacked
            f.unpack(members, 1.0, (), packed=True)
        ctx.record(call, (0,), t0, t1, t2, time.perf_counter())


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
            ctx.reduce(ks[pos], buf, call)

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
    """The path of each bucket of ``ctx.plan`` (one object for the host, one per device).

    Returns:
        One path per bucket, in plan order; consecutive buckets of one path
        are reduced together (:func:`runs`).
    """
    host = HostPath(ctx)
    devices: dict[str, DevicePath] = {}
    return [host if backend.is_host(f.bucket.device) else devices.setdefault(f.bucket.device,
                                                                             DevicePath(ctx, f.bucket.device))
            for f in ctx.plan.buffers]


def runs(paths: Sequence[Any], ks: Sequence[int]) -> list[tuple[Any, Sequence[int]]]:
    """Buckets ``ks`` as maximal runs of one path, in order: ``[(path, buckets), ...]``."""
    found: list[tuple[Any, Sequence[int]]] = []
    start = 0
    while start < len(ks):
        end = start + 1
        while end < len(ks) and paths[ks[end]] is paths[ks[start]]:
            end += 1
        found.append((paths[ks[start]], ks[start:end]))
        start = end
    return found
