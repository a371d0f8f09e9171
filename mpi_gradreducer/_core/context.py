"""What every path of a reducer shares: its plan, its summers, its hook, its first message, its instrument."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import backend, wire
from .call import Call, FirstMessage
from .fusion import FusionPlan
from .halves import SliceSum
from .hooks import BucketHook, GradBucket
from .instrument import Instrument
from .options import Options
from .summers import Summer, Summers, allreduce

__all__ = ["Context"]


class Context:
    """A reducer's plan with how each bucket is summed: by the reducer (on its summers), or by a hook.

    Args:
        comm: the reducer's communicator.
        plan: the reducer's plan.
        options: the reducer's (resolved) options.
        instrument: the reducer's counters and watchdog.
        summers: the reducer's summers (two levels across hosts, unless ``deterministic``).
        hook: sums each bucket instead of the reducer (``compression="fp16"``'s :class:`~.hooks.Cast`), or None.
    """

    def __init__(self, comm: MPI.Intracomm, plan: FusionPlan, options: Options, instrument: Instrument,
                 summers: Summers, hook: BucketHook | None = None) -> None:
        self.comm, self.plan, self.options, self.instrument = comm, plan, options, instrument
        self.summers, self.hook = summers, hook
        self._chunk = summers.chunk_bytes
        self._every_chunk = options.deterministic
        #: Per bucket: what the reducer sums its host chunks with (the summer of their dtype; a 16-bit host
        #: bucket slice by slice in float32). Device buffers go to MPI as they are.
        self._summers: list[Any] = [self._summer_of(f.bucket) for f in plan.buffers]
        #: Per bucket: what it is, for the watchdog.
        self._described = [self.describe(k) for k in range(len(plan.buffers))]
        #: Per bucket: the bytes of its last sum as handed to MPI (a hook's as its sums saw them, each call).
        self.wire_bytes = [int(f.bucket.nbytes) for f in plan.buffers]
        first = plan.buffers[0].bucket if plan.buffers else None
        ordered = summers.ordered(first.wire_dtype) if first is not None and options.deterministic \
            and backend.is_host(first.device) else None
        #: The call's first message: its header, with the first bucket's first elements where no hook sums it.
        self.first = FirstMessage(comm, plan, options, instrument, hook is None, ordered)

    def _summer_of(self, bucket: Any) -> Any:
        if backend.is_host(bucket.device) and bucket.wire_dtype.itemsize == 2:  # in float32, each rank one slice
            return self.summers.sliced(wire.half_format(bucket.wire_dtype))
        return self.summers.ordered(bucket.wire_dtype)

    def reduce(self, k: int, buf: Any, call: Call, every_chunk: bool = False) -> None:
        """Sum (and scale) ``buf``, bucket ``k``'s 1-D data (or what is left of it), in place: by the reducer
        chunk by chunk, each chunk scaled and checked while in cache, or by the hook.

        ``every_chunk``: sum every chunk in rank order (as ``deterministic`` does), so that the result does
        not depend on where the chunks begin.
        """
        if call.void or buf.shape[0] == 0:
            return
        if self.hook is not None:
            self._hooked(k, buf, call)
            return
        f = self.plan.buffers[k]
        after = (lambda chunk: call.check_chunk(chunk, f.limit)) if call.check_finite else None
        summer = self._summers[k]
        instrument = self.instrument
        wd = instrument.watchdog
        if wd is not None:
            wd.arm(self._described[k], call.number, instrument.watching)
        try:
            if isinstance(summer, SliceSum):  # always in rank order
                made = summer.reduce(buf, call.scale, after)
            else:
                made = allreduce(self.comm, buf, call.scale, self._chunk, MPI.SUM, after, summer,
                                 every_chunk or self._every_chunk, self.summers.split_sums)
        finally:
            if wd is not None:
                wd.disarm()
        instrument.stats.messages += made

    def _hooked(self, k: int, buf: Any, call: Call) -> None:
        """Bucket ``k``'s data through the hook; its sums through :meth:`GradBucket.reduce`."""
        f = self.plan.buffers[k]
        sent = [0]  # the bytes the hook's sums handed to MPI, counted where they are handed over

        def reduce(data: Any, scale: float, summer: Summer | None, chunk_bytes: int | None) -> None:
            if summer is None and isinstance(data, np.ndarray) and data.dtype.itemsize == 2:
                made = self.summers.sliced(wire.half_format(data.dtype)).reduce(data, scale)
            elif summer is None:
                ordered = self.summers.ordered(data.dtype) if isinstance(data, np.ndarray) else None
                made = allreduce(self.comm, data, scale, self._chunk, ordered=ordered,
                                 every_chunk=self._every_chunk, split_sums=self.summers.split_sums)
            else:
                made = allreduce(self.comm, data, scale, chunk_bytes or self._chunk, ordered=summer,
                                 every_chunk=True)
            sent[0] += data.size * getattr(summer, "wire_itemsize", data.dtype.itemsize)
            self.instrument.stats.messages += made

        assert self.hook is not None
        self.instrument.collective(self._described[k], call.number, self.hook,
                                   GradBucket(k, f.bucket.indices, buf, call.scale, self.summers, reduce))
        self.wire_bytes[k] = sent[0]
        if call.check_finite:
            call.check_chunk(buf, f.limit)

    def describe(self, k: int) -> Callable[[], str]:
        """What bucket ``k`` is, for the watchdog."""
        return lambda: f"bucket {k} ({self.plan.buffers[k].bucket.nbytes} bytes)"

    def record(self, call: Call, ks: Sequence[int], t0: float, t1: float, t2: float, t3: float) -> None:
        """Count and trace the phases of buckets ``ks``."""
        nbytes = self.wire_bytes[ks[0]] if len(ks) == 1 else sum(self.wire_bytes[k] for k in ks)
        self.instrument.phases(call.number, ks, nbytes, t0, t1, t2, t3)
