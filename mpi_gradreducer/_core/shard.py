"""Sharded reduction for ZeRO-style optimizers: reduce-scatter of the plan, then allgather of the parameters.

``reducer.reduce_scatter(grads)`` is the first half of the reducer's
Allreduce: each bucket's buffer is cut into chunks of at most
``transport.CHUNK_BYTES`` (as the Allreduce is, since MPI is slower on
larger messages), each chunk split evenly into one contiguous slice per rank
(:func:`bounds`, :func:`cuts`) and reduce-scattered, so that each rank
receives the averaged values of its slices only. A slice, mapped back onto the bucket's
members, is a list of :class:`Piece`\\ s: ``(index, start, stop)``, a flat
element range of one parameter (:func:`layout`, a pure function of the
buckets and the number of ranks). Each rank keeps optimizer state for its
pieces only and updates those elements of its parameters; then
``shard.allgather(params)`` is the other half: one ``Allgather`` per chunk
(``Allgatherv`` where the slices are unequal),
in the parameters' own dtype, puts every rank's pieces into every rank's
``params``.

Bytes on the wire are those of an Allreduce of the plan (a reduce-scatter
plus an allgather of the parameters' dtype), except that float16 and bfloat16
buckets are reduce-scattered in float32 (MPI has no half-precision sum) and
compressed buckets uncompressed; halves are rounded once into the piece. Device
(cupy) gradients and parameters are staged through host memory here (not
tested on a GPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agreement, backend, transport
from .call import Call
from .dtypes import reduction_dtype, scaled_copy
from .fusion import FusionPlan
from .instrument import Instrument
from .planning import Bucket
from .summers import Summers
from .validation import Checked, check_grads

__all__ = ["Piece", "Shard", "Sharder", "Span", "arrays_only", "bounds", "cuts", "layout"]


@dataclass(frozen=True)
class Span:
    """Where one piece lies: a flat range of a parameter, inside one bucket and one rank's slice of it.

    Attributes:
        bucket: the bucket's position in the plan.
        index: the parameter.
        start: first flat element of the parameter in the piece.
        stop: one past the last.
        offset: where the piece begins among the values the rank receives for the bucket.
    """

    bucket: int
    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Piece:
    """One rank's part of one parameter after ``reduce_scatter``.

    Attributes:
        index: the parameter (its position in ``grads`` and ``params``).
        start: first element of the part, in the parameter's flat (C-order) elements.
        stop: one past the last.
        grad: the averaged gradient of those elements: a 1-D array of
            ``stop - start`` values in the parameter's dtype, on its device.
    """

    index: int
    start: int
    stop: int
    grad: Any


def bounds(count: int, size: int) -> list[int]:
    """The slice boundaries of a bucket of ``count`` elements over ``size`` ranks.

    Rank ``r`` owns elements ``[b[r], b[r + 1])``; the slices differ in length by at most one.
    """
    return [count * r // size for r in range(size + 1)]


def cuts(bucket: Bucket, size: int) -> list[tuple[int, list[int]]]:
    """The chunks of ``bucket`` and their slices: ``(chunk start, bounds(chunk length, size))`` each.

    Chunks hold at most ``transport.CHUNK_BYTES`` of the dtype the bucket is summed in.
    """
    step = max(1, transport.CHUNK_BYTES // reduction_dtype(bucket.dtype).itemsize)
    return [(c0, bounds(min(step, bucket.count - c0), size)) for c0 in range(0, bucket.count, step)]


def layout(buckets: Sequence[Bucket], size: int, rank: int) -> list[Span]:
    """The pieces of rank ``rank`` among ``size`` ranks, in plan order (pure: no MPI).

    Args:
        buckets: the plan.
        size: the number of ranks.
        rank: the rank whose pieces are wanted.

    Returns:
        One :class:`Span` per (chunk, member) that the rank's slice of the chunk touches.
    """
    spans = []
    for k, b in enumerate(buckets):
        received = 0  # where the rank's slice of this chunk starts among the values it receives for the bucket
        for c0, edges in cuts(b, size):
            lo, hi = c0 + edges[rank], c0 + edges[rank + 1]
            for i, o, n in zip(b.indices, b.offsets, b.sizes, strict=True):
                start, stop = max(lo, o), min(hi, o + n)
                if start < stop:
                    spans.append(Span(k, i, start - o, stop - o, received + start - lo))
            received += hi - lo
    return spans


def arrays_only(checked: Checked) -> Checked:
    """``checked``, with an error for what ``reduce_scatter`` cannot take: RowSparse or None gradients."""
    if checked.error is not None or not (checked.sparse or checked.absent):
        return checked
    if checked.sparse:
        i = checked.sparse[0]
        error = TypeError(f"grads[{i}]: reduce_scatter() takes dense arrays only, got a RowSparse gradient; "
                          "reduce RowSparse gradients with the plain call")
    else:
        i = checked.absent[0]
        error = TypeError(f"grads[{i}]: reduce_scatter() takes an array for every parameter, got None; "
                          "pass zeros")
    return checked._replace(error=error)


class Sharder:
    """A reducer's reduce-scatter and allgather over one plan; its buffers are reused from call to call.

    Args:
        comm: the reducer's communicator.
        plan: the reducer's plan.
        instrument: the reducer's counters and watchdog.
        summers: the reducer's summers (reduce-scatters in two levels across hosts).
    """

    def __init__(self, comm: MPI.Intracomm, plan: FusionPlan, instrument: Instrument, summers: Summers) -> None:
        self.comm, self.plan, self.instrument, self.summers = comm, plan, instrument, summers
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        buckets = plan.buckets
        self.cuts = [cuts(b, self.size) for b in buckets]
        self.spans = layout(buckets, self.size, self.rank)
        #: For each bucket, this rank's spans in it with their member's offset in the bucket.
        self._own: list[list[tuple[Span, int]]] = [[] for _ in buckets]
        for s in self.spans:
            b = buckets[s.bucket]
            self._own[s.bucket].append((s, b.offsets[b.indices.index(s.index)]))
        self._received: list[np.ndarray | None] = [None] * len(buckets)  # this rank's slice, summed dtype
        self._wide: list[np.ndarray | None] = [None] * len(buckets)  # half buckets widened to float32
        self._results: list[Any] = [None] * len(buckets)  # the same, scaled, in the members' dtype
        self._gathered: list[np.ndarray | None] = [None] * len(buckets)  # a whole bucket, members' dtype

    @classmethod
    def of(cls, current: Sharder | None, comm: MPI.Intracomm, plan: FusionPlan, instrument: Instrument,
           summers: Summers) -> Sharder:
        """``current`` if it was made for ``plan``, else a new one."""
        return current if current is not None and current.plan is plan else cls(comm, plan, instrument, summers)

    def chunks(self, k: int) -> Iterator[tuple[int, int, list[int], list[int], int]]:
        """For each chunk of bucket ``k``: start, length, counts and displacements per rank, and where this
        rank's slice begins among the values it receives for the bucket."""
        received = 0
        for c0, e in self.cuts[k]:
            counts = [e[r + 1] - e[r] for r in range(self.size)]
            yield c0, e[-1], counts, e[:-1], received
            received += counts[self.rank]

    def owned(self, k: int) -> int:
        """Elements of bucket ``k`` that this rank receives."""
        return sum(e[self.rank + 1] - e[self.rank] for _, e in self.cuts[k])

    def reduce_scatter(self, call: Call) -> Shard:
        """Reduce-scatter every bucket of ``call`` (validated, its header read) and return this rank's pieces."""
        scale = call.scale
        for k, f in enumerate(self.plan.buffers):
            b = f.bucket
            members = call.members(f)
            send = f.in_place(members) if backend.is_host(b.device) else None
            if send is None:
                send = self._packed(k, members, call.epoch)
            if send.dtype.itemsize == 2:  # MPI has no half-precision sum: reduce-scatter in float32
                send = self._widened(k, [send])
            received = self._received[k]
            if received is None:
                received = self._received[k] = np.empty(self.owned(k), reduction_dtype(b.dtype))
            for c0, n, counts, displs, at in self.chunks(k):
                mine = received[at: at + counts[self.rank]]
                if self.size > 1:
                    self.instrument.collective(partial("reduce-scatter of bucket {} ({} bytes)".format, k, b.nbytes),
                                               call.number, self.summers.scatter(send.dtype).reduce_scatter,
                                               send[c0: c0 + n], counts, displs, mine)
                else:
                    mine[...] = send[c0: c0 + n]
                self.instrument.stats.messages += 1
            self.instrument.stats.bytes += b.nbytes
            self._results[k] = self._scaled(k, received, scale)
            if call.check_finite:
                result = self._results[k]
                call.check_chunk(result if isinstance(result, np.ndarray) else received, f.limit)
        if call.check_finite:
            flag = np.array([int(call.nonfinite)], np.int64)
            if self.size > 1:
                self.instrument.collective(lambda: "the agreement on nonfinite results", call.number,
                                           self.comm.Allreduce, MPI.IN_PLACE, flag, op=MPI.MAX)
            call.nonfinite = bool(flag[0])
        pieces = tuple(Piece(s.index, s.start, s.stop, self._results[s.bucket][s.offset: s.offset + s.stop - s.start])
                       for s in self.spans)
        return Shard(self, call.number, pieces)

    def _widened(self, k: int, parts: Sequence[Any]) -> np.ndarray:
        """Bucket ``k``'s members (or its one 16-bit buffer) in the dtype they are summed in, on the host."""
        b = self.plan.buffers[k].bucket
        wide = self._wide[k]
        if wide is None:
            wide = self._wide[k] = np.empty(b.count, reduction_dtype(b.dtype))
        offsets = b.offsets if len(parts) == len(b.indices) else (0,)
        for part, o in zip(parts, offsets, strict=True):
            flat = backend.to_numpy(part).reshape(-1) if not isinstance(part, np.ndarray) else part.reshape(-1)
            scaled_copy(flat, wide[o: o + flat.shape[0]])
        return wide

    def _packed(self, k: int, members: Sequence[Any], epoch: int | None) -> np.ndarray:
        """Bucket ``k``'s members in one host buffer of its wire dtype (``epoch``: the call's replay epoch)."""
        f = self.plan.buffers[k]
        if backend.is_host(f.bucket.device):
            f.pack(members, epoch=epoch)
            return f.buffer
        host = np.empty(f.bucket.count, f.bucket.wire_dtype)  # staged through host memory
        for g, o, n in zip(members, f.bucket.offsets, f.bucket.sizes, strict=True):
            scaled_copy(backend.to_numpy(g).reshape(-1), host[o: o + n])
        return host

    def _scaled(self, k: int, received: np.ndarray, scale: float) -> Any:
        """This rank's slice of bucket ``k``, scaled and in the members' dtype (rounded once), on their device."""
        b = self.plan.buffers[k].bucket
        if b.dtype == received.dtype:
            scaled_copy(received, received, scale)
            out = received
        else:
            out = self._results[k]
            if out is None or not isinstance(out, np.ndarray):
                out = np.empty(received.shape[0], b.dtype)
            scaled_copy(received, out, scale, received.dtype)
        if not backend.is_host(b.device):
            import cupy

            with cupy.cuda.Device(int(b.device.split(":")[1])):
                return cupy.asarray(out)
        return out

    def allgather(self, shard: Shard, params: Sequence[Any]) -> Sequence[Any]:
        """Every rank's pieces of ``params`` into every rank's ``params``, in place (collective).

        Raises:
            ValueError, TypeError: on every rank, before anything moves, when any rank's ``params`` do
                not match the plan.
        """
        checked = check_grads(params, self.plan, aliasing=True)
        error, arrays = _as_params(checked), checked.arrays
        self.instrument.collective(lambda: "the agreement on allgather's params", shard.call,
                                   agreement.raise_if_any, self.comm, error)
        for k, f in enumerate(self.plan.buffers):
            b = f.bucket
            members = [arrays[i] for i in b.indices]
            host = backend.is_host(b.device)
            whole: np.ndarray | None = backend.flat_view(members[0]) if host and len(members) == 1 else None
            if whole is None:
                gathered = self._gathered[k]
                if gathered is None:
                    gathered = self._gathered[k] = np.empty(b.count, b.dtype)
                whole = gathered
                for s, o in self._own[k]:  # this rank's pieces, where the others expect them
                    part = arrays[s.index].reshape(-1)[s.start: s.stop]
                    whole[o + s.start: o + s.stop] = part if host else backend.to_numpy(part)
            wire = _bits(whole)
            for c0, n, counts, displs, _ in self.chunks(k):
                if self.size > 1:
                    what = partial("allgather of bucket {} ({} bytes)".format, k, b.count * b.dtype.itemsize)
                    if counts.count(counts[0]) == self.size:  # MPICH's Allgatherv is far slower than its Allgather
                        self.instrument.collective(what, shard.call, self.comm.Allgather, MPI.IN_PLACE,
                                                   wire[c0: c0 + n])
                    else:
                        self.instrument.collective(what, shard.call, self.comm.Allgatherv, MPI.IN_PLACE,
                                                   [wire[c0: c0 + n], (counts, displs)])
                self.instrument.stats.messages += 1
            if whole is not self._gathered[k]:
                continue  # gathered where it lies
            for g, o, n in zip(members, b.offsets, b.sizes, strict=True):
                if host:
                    g[...] = whole[o: o + n].reshape(g.shape)
                else:
                    backend.copy_from_host(g, whole[o: o + n].reshape(g.shape))
        return params


class Shard:
    """This rank's pieces of one ``reduce_scatter`` call.

    Iterate over it for the :class:`Piece`\\ s (plan order); ``allgather``
    finishes the step. A piece's ``grad`` is valid until the next
    ``reduce_scatter`` of the same reducer.
    """

    def __init__(self, sharder: Sharder, call: int, pieces: tuple[Piece, ...]) -> None:
        self._sharder = sharder
        self.call = call
        self.pieces = pieces

    def __iter__(self) -> Iterator[Piece]:
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    @property
    def numel(self) -> int:
        """Elements in this rank's pieces."""
        return sum(p.stop - p.start for p in self.pieces)

    @property
    def comm(self) -> MPI.Intracomm:
        """The reducer's communicator, over which the pieces were reduced."""
        return self._sharder.comm

    def allgather(self, params: Sequence[Any]) -> Sequence[Any]:
        """Put every rank's pieces of ``params`` into every rank's ``params``, in place (collective).

        Each rank must have written its updated pieces into its own
        ``params``; the elements of other ranks' pieces are overwritten.

        Args:
            params: one array per parameter, of its shape, dtype and device
                (any array library, as for ``grads``); skipped parameters are
                left alone.

        Returns:
            ``params``.

        Raises:
            ValueError, TypeError: on every rank, before anything moves, when
                any rank's ``params`` do not match the plan.
        """
        return self._sharder.allgather(self, params)


def _as_params(checked: Checked) -> Exception | None:
    """The validation's verdict on ``params`` (not gradients: arrays only), named as ``params``."""
    error = checked.error
    if error is None and (checked.sparse or checked.absent):
        i = (checked.sparse or checked.absent)[0]
        error = TypeError(f"params[{i}]: expected an array, got {'a RowSparse' if checked.sparse else 'None'}")
    if error is None:
        return None
    text = str(error).replace("grads[", "params[").replace("grads:", "params:")
    return type(error)(text)


def _bits(a: np.ndarray) -> np.ndarray:
    """``a`` as values MPI can move unchanged (2-byte floats as unsigned 16-bit integers)."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a
