"""One call, from its gradients to its results: the header, stand-ins for None and for a joined rank.

A call's arrays are the caller's, except where the caller has nothing to give:
a ``None`` gradient (an unused parameter) and every gradient of a rank that
has joined are reduced as zeros in stand-in arrays. When the header has been
read (:func:`settle`), every rank knows the call's structure; at the end
(:func:`close`) the results of stand-ins and of ``RowSparse`` gradients are
put into the caller's list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import control
from .fusion import FusionBuffer, FusionPlan, zeros
from .options import Options
from .sparse import RowSparse
from .validation import Checked

__all__ = ["Call", "close", "open_call", "settle"]


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
        settle: reads the summed header into ``info`` (raises on every rank
            when some rank's input is bad); the front class's.
        head: ``"pending"`` while the header is to ride on the carrier
            bucket's first elements; ``"sent"`` once it has (those elements
            are then reduced); ``"ahead"`` when it travelled on its own.
        nonfinite: a result held NaN or Inf (with ``check_finite``).
        gather_sparse: the RowSparse gradients are gathered (not when
            ``wait()`` found a rank that was not ready).
        epoch: the replay epoch whose armed gradients this call reduces
            (:class:`~.replay.Replay`), or None.
    """

    number: int
    grads: Any
    local: control.Local
    caller: Any = None
    check_finite: bool = False
    on_thread: bool = False
    info: control.CallInfo | None = None
    degree: int = 1
    scale: float = 1.0
    settle: Callable[[control.Summary], None] | None = None
    head: str = "pending"
    nonfinite: bool = False
    gather_sparse: bool = True
    epoch: int | None = None

    @property
    def sparse(self) -> tuple[int, ...]:
        """Positions of RowSparse gradients (this rank's until the header was read)."""
        return self.info.sparse if self.info is not None else self.local.sparse

    @property
    def void(self) -> bool:
        """No rank contributes (every rank has joined): nothing more is sent."""
        return self.info is not None and self.info.contributors == 0

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


def open_call(number: int, grads: Any, plan: FusionPlan, checked: Checked | None, *, check_finite: bool,
              asynchronous: bool = False, sharded: bool = False) -> Call:
    """A call of ``grads`` (validated into ``checked``), or of a joined rank (``checked`` None).

    A joined rank contributes zeros: the reducer's own views when it has
    them (so that its messages are those of the ranks that use them), else
    zero-filled stand-ins.
    """
    if checked is None:
        local = control.Local(number, contributing=False, views=plan.own_count == len(plan.checked) > 0,
                              asynchronous=asynchronous, sharded=sharded)
        work = plan.stand_ins()
        for i in plan.checked:
            work[i][...] = 0
        return Call(number, list(work), local, check_finite)
    local = control.Local(number, checked.error, True, checked.sparse, checked.absent, checked.views, asynchronous,
                          sharded)
    if checked.error is not None:
        return Call(number, grads, local, grads, check_finite)
    work = checked.arrays
    if checked.absent:
        work = list(work)
        for i in checked.absent:
            work[i] = zeros(plan.specs[i])
    return Call(number, work, local, grads, check_finite)


def settle(call: Call, comm: MPI.Intracomm, options: Options, plan: FusionPlan, summary: control.Summary) -> None:
    """Read the summed header into ``call`` (collective when it is not healthy; raises on every rank)."""
    info = control.settle(comm, call.local, summary, len(plan.specs))
    call.info = info
    call.degree = options.divisor(info.contributors) if options.mean else 1
    call.scale = 1.0 / call.degree if options.mean else 1.0
    if not call.local.contributing:
        for i in info.sparse:  # a joined rank contributes no rows
            spec = plan.specs[i]
            call.grads[i] = RowSparse(np.empty(0, np.int64), np.empty((0, *spec.shape[1:]), spec.dtype), spec.shape)


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
