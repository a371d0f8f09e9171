"""One call, from its gradients to its results: its first message, stand-ins for None and for a joined rank.

A call's arrays are the caller's, except where the caller has nothing to give:
a ``None`` gradient (an unused parameter) and every gradient of a rank that
has joined are reduced as zeros in stand-in arrays. The call's header
(:mod:`.header`) travels in its first message (:class:`FirstMessage`), with the
first elements of the first bucket where it can; the verdict read from it is
applied to the call there, before any caller's array is modified. At the end
(:func:`close`) the results of stand-ins and of ``RowSparse`` gradients are
put into the caller's list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import backend, header
from .dtypes import scaled_copy
from .fusion import FusionBuffer, FusionPlan, zeros
from .instrument import Instrument
from .options import Options
from .sparse import RowSparse
from .validation import Checked

__all__ = ["HEAD_BYTES", "Call", "FirstMessage", "close", "open_call"]

#: Bytes of the first bucket that travel with the call header (the rest follows in its own messages).
HEAD_BYTES = 64 << 10


@dataclass
class Call:
    """One reduction: its number, its gradients, its header, what the sums showed.

    Attributes:
        number: the call's number (1 for the first).
        grads: the arrays reduced: the caller's (or views of them), with stand-ins for None.
        local: this rank's header.
        caller: the list the caller gets back (the one it passed, or a list of
            what its iterable gave); None on a rank that has joined.
        check_finite: look for NaN/Inf in the results.
        on_thread: reduced on the communication thread.
        info: the call's structure on every rank, once the header was read.
        degree: the divisor of a mean for this call (set with ``info``).
        scale: the factor applied to every sum (set with ``info``).
        head: where the header and the carrier bucket's first elements are
            (:class:`FirstMessage` alone changes it): ``"pending"``, the
            header is to ride with those elements; ``"sent"``, both have been
            summed (as zeros, on a rank that had none); ``"ahead"``, the
            header went on its own and those elements are still to travel.
        nonfinite: a result held NaN or Inf (with ``check_finite``).
        void: no rank contributes (every rank has joined): nothing more is sent (set with ``info``).
        sparse: positions of RowSparse gradients (this rank's until the header was read, then every rank's).
        gather_sparse: the RowSparse gradients are gathered (not when
            ``wait()`` found a rank that was not ready).
        epoch: the replay epoch whose armed gradients this call reduces
            (:class:`~.replay.Replay`), or None.
    """

    number: int
    grads: Any
    local: header.Local
    caller: Any = None
    check_finite: bool = False
    on_thread: bool = False
    info: header.CallInfo | None = None
    degree: int = 1
    scale: float = 1.0
    head: str = "pending"
    nonfinite: bool = False
    void: bool = False
    sparse: tuple[int, ...] = ()
    gather_sparse: bool = True
    epoch: int | None = None

    def members(self, f: FusionBuffer) -> tuple[Any, ...]:
        """Bucket ``f``'s gradients, in bucket order."""
        return f.members_of(self.grads)

    def dense(self, f: FusionBuffer) -> bool:
        """Whether no member of bucket ``f`` is row-sparse in this call."""
        sparse = self.sparse
        return not sparse or not any(i in sparse for i in f.bucket.indices)

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

    def settle(self, info: header.CallInfo, options: Options, plan: FusionPlan) -> None:
        """Take the verdict: the call's structure, its divisor and scale (a joined rank: empty RowSparse)."""
        self.info, self.void, self.sparse = info, info.contributors == 0, info.sparse
        self.degree = options.divisor(info.contributors) if options.mean else 1
        self.scale = 1.0 / self.degree if options.mean else 1.0
        if not self.local.contributing:
            for i in info.sparse:  # a joined rank contributes no rows
                spec = plan.specs[i]
                self.grads[i] = RowSparse(np.empty(0, np.int64), np.empty((0, *spec.shape[1:]), spec.dtype),
                                          spec.shape)


def open_call(number: int, grads: Any, plan: FusionPlan, checked: Checked | None, *, check_finite: bool,
              asynchronous: bool = False, sharded: bool = False) -> Call:
    """A call of ``grads`` (validated into ``checked``), or of a joined rank (``checked`` None).

    A joined rank contributes zeros: the reducer's own views when it has
    them (so that its messages are those of the ranks that use them), else
    zero-filled stand-ins.
    """
    if checked is None:
        local = header.Local(number, contributing=False, views=plan.own_count == len(plan.checked) > 0,
                             asynchronous=asynchronous, sharded=sharded)
        work = plan.stand_ins()
        for i in plan.checked:
            work[i][...] = 0
        return Call(number, list(work), local, check_finite=check_finite)  # (no rows: sparse is empty)
    local = header.Local(number, checked.error, True, checked.sparse, checked.absent, checked.views, asynchronous,
                         sharded)
    if checked.error is not None:
        return Call(number, grads, local, grads, check_finite)
    work = checked.arrays
    if checked.absent:
        work = list(work)
        for i in checked.absent:
            work[i] = zeros(plan.specs[i])
    return Call(number, work, local, grads, check_finite, sparse=checked.sparse)


def close(call: Call) -> None:
    """Put the results of stand-ins and RowSparse gradients into the caller's list."""
    grads = call.caller
    if call.grads is grads or not call.local.contributing:
        return
    info = call.info
    assert info is not None
    for i in call.local.absent:
        grads[i] = None if i in info.absent else call.grads[i]
    for i in info.sparse:
        grads[i] = call.grads[i]


class FirstMessage:
    """A call's first message: its header, with the first elements of the carrier bucket where it can.

    The carrier is the plan's first bucket where it is a host bucket of 32 or
    64-bit floats summed as it is (``carried``); otherwise the header travels
    alone. Its first :data:`HEAD_BYTES` travel behind the header in one
    message (the whole of a small model's one bucket), so that a healthy call
    pays no message for its header. The verdict is read from the sums here
    and applied to the call (:meth:`Call.settle`), before anything of the
    caller's is written.

    Args:
        comm: the reducer's communicator.
        plan: the reducer's plan.
        options: the reducer's (resolved) options.
        instrument: the reducer's counters and watchdog.
        carried: the first bucket may carry the header (it is summed as it is, by MPI or in rank order).
        summer: sums the message in rank order (``deterministic``); None: ``Allreduce``.
    """

    def __init__(self, comm: MPI.Intracomm, plan: FusionPlan, options: Options, instrument: Instrument,
                 carried: bool, summer: Callable[[np.ndarray, float], int] | None = None) -> None:
        self.comm, self.plan, self.options, self.instrument = comm, plan, options, instrument
        self._size = comm.Get_size()
        self._summer = summer
        first = plan.buffers[0].bucket if plan.buffers else None
        carried = (carried and first is not None and backend.is_host(first.device)
                   and header.carries(first.wire_dtype, self._size))
        #: The bucket whose first message carries the header (0), or None: the header travels alone.
        self.carrier: int | None = 0 if carried else None
        self.head_count = 0 if first is None else min(first.count, max(1, HEAD_BYTES // first.wire_dtype.itemsize))
        #: Whether all of the carrier travels in the first message (a small model's one bucket).
        self.whole = self.carrier is not None and first is not None and first.count <= self.head_count
        self._message: Any = None  # header, then the carrier's head (allocated once)
        self._slots: Any = None  # its header, as real values
        self._body: Any = None  # the carrier's first elements
        if self.whole:  # a small first bucket is packed right behind the header
            self._allocate()
            plan.buffers[0].allocate(self._body)  # (until allocate_grads gives it another buffer)

    def _allocate(self) -> None:
        b = self.plan.buffers[0].bucket
        lead = header.lead(b.wire_dtype)
        self._message = backend.empty(lead + self.head_count, b.wire_dtype, "cpu")
        self._slots = header.real_view(self._message[:lead])
        self._body = self._message[lead:]

    def announce(self, call: Call) -> None:
        """Send the header now, ahead of the data (a call of ``begin()``, ``reduce_scatter()``, a rank with
        nothing to give or with bad input): alone, or with zeros in the carrier's place. Raises on every rank
        when some rank's input is bad."""
        if self.carrier is None:
            summary = self.instrument.collective(lambda: "the call header", call.number, header.exchange,
                                                 self.comm, call.local)
            self._settle(call, summary)
            call.head = "ahead"
        else:
            self.send(call)

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
        head = call.head
        if head == "ahead":
            info = call.info
            if info is None or info.sharded:
                return data
            self.send(call, data[: self.head_count], data is self.plan.buffers[k].buffer, with_header=False)
        elif head == "pending":
            self.send(call, data[: self.head_count], data is self.plan.buffers[k].buffer)
        return data[self.head_count:]

    def send(self, call: Call, head: Any = None, packed: bool = False, with_header: bool = True) -> None:
        """Sum the header (and the carrier's first elements, ``head``; zeros if None) and apply the verdict.

        ``packed``: ``head`` is the start of the carrier's own buffer, which
        may lie right behind the header already. Raises on every rank when
        some rank's input is bad; nothing of the caller's has been modified
        then. Without ``with_header``, the same message carries zeros in the
        header's place: the head of a call whose header went ahead travels in
        a message of the same length, at the same offset, and so is summed
        to the same bits.
        """
        if self._message is None:
            self._allocate()
        msg, slots, body = self._message, self._slots, self._body
        if with_header:
            call.local.write(slots)
        else:
            slots[...] = 0
        same = packed and self.plan.buffers[0].buffer is body  # the carrier's buffer is the body itself
        if head is None:
            body[...] = 0
        elif not same:
            body[...] = head
        if self._size > 1:
            wd = self.instrument.watchdog
            if wd is not None:
                wd.arm(self._describe, call.number, self.instrument.watching)
            try:
                if self._summer is not None:  # in rank order: the header's sums are exact in any order
                    self._summer(msg, 1.0)
                else:
                    self.comm.Allreduce(MPI.IN_PLACE, msg, op=MPI.SUM)
            finally:
                if wd is not None:
                    wd.disarm()
        self.instrument.stats.messages += 1
        if with_header:
            self._settle(call, header.Summary.of(slots))
        if head is not None:
            scaled_copy(body, body if same else head, call.scale)
            if call.check_finite:
                call.check_chunk(head, self.plan.buffers[0].limit)
            call.head = "sent"
        elif with_header and call.info is not None:
            call.head = "ahead" if call.info.asynchronous or call.info.sharded else "sent"

    def _settle(self, call: Call, summary: header.Summary) -> None:
        """Read the summed header into ``call``: free when it is healthy, else collective, and watched."""
        count = len(self.plan.specs)
        if summary.healthy(self._size):
            info = header.settle(self.comm, call.local, summary, count, healthy=True)
        else:
            info = self.instrument.collective(lambda: "the reading of the call header", call.number, header.settle,
                                              self.comm, call.local, summary, count, healthy=False)
        call.settle(info, self.options, self.plan)

    def _describe(self) -> str:
        return f"bucket 0 ({self.plan.buffers[0].bucket.nbytes} bytes)"
