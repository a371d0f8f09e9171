"""How a buffer is summed across ranks: the algorithms, and the one factory that makes them for a reducer.

A *summer* sums a 1-D host chunk across the ranks in place, times a scale,
and returns the collectives it made. :class:`OrderedSum` adds in rank order
in the chunk's dtype; :class:`SliceSum` sums 16-bit chunks in float32, each
rank one slice; :class:`CastSum` sends a float32/float64 chunk as 16 bits
through a :class:`SliceSum`. Each can have two levels (the ranks of one host,
then the hosts). :func:`allreduce` cuts a buffer into chunks and sums each.

:class:`Summers` makes them for one reducer's communicator, once each, and
is what every user asks: the buckets' paths, PowerSGD's products and the
sharded reduce-scatter. Where the ranks span several hosts with the same
number of ranks, more than one, on each, its summers have two levels: each
host's ranks first sum their blocks over shared memory, the ranks with the
same place on every host sum those partial sums among themselves, and the
blocks are shared on each host again: each host sends ``2 (hosts - 1) /
hosts`` of a chunk, the ring's optimum, where a flat sum over 2 hosts x 2
ranks sends 1.75 times it. Two levels add each host's sum in host order,
``(g0 + g1) + (g2 + g3)``; with ``deterministic=True`` the reducer asks for
flat summers (rank order, ``((g0 + g1) + g2) + g3``). All data movement goes
through :class:`~.transport.Exchange`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from . import transport
from .halves import CAST_PIECES, CastSum, SliceSum
from .topology import Topology
from .transport import CHUNK_BYTES, Exchange
from .wire import Compression

__all__ = ["GATHERED_SUM_BYTES", "SPLIT_MEAN_BYTES", "LevelledScatter", "OrderedSum", "Summer", "Summers",
           "allreduce"]

#: From this chunk size up, a mean is summed by :class:`OrderedSum` (each rank
#: sums and scales one slice); below it one Allreduce has less latency.
SPLIT_MEAN_BYTES = 256 << 10
#: Chunks up to this size are summed in rank order by gathering them whole on
#: every rank (one collective); larger ones one slice per rank (two).
GATHERED_SUM_BYTES = 128 << 10
#: What sums a host chunk in place across ranks, times a scale, and returns the collectives it made
#: (an :class:`OrderedSum`, a :class:`SliceSum` or a :class:`CastSum`).
Summer = Callable[[np.ndarray, float], int]


def allreduce(
    comm: MPI.Comm,
    buf: Any,
    scale: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    op: MPI.Op = MPI.SUM,
    after: Callable[[Any], None] | None = None,
    ordered: Summer | None = None,
    every_chunk: bool = False,
    split_sums: bool = False,
) -> int:
    """Sum a 1-D contiguous buffer over ``comm`` in place, chunk by chunk.

    A mean (``scale`` != 1) of a large host chunk is summed in rank order by
    :class:`OrderedSum` (each rank sums one slice, scales it while it is in
    cache, and the slices are shared): each rank multiplies 1/size of the
    data, and the process's memory stays flat (MPICH's
    ``Reduce_scatter_block`` grows it with every call); with ``split_sums``,
    so is a large sum (an MPI whose own ``Allreduce`` of large messages is
    not reproducible: :attr:`Summers.split_sums`). With ``every_chunk``
    every chunk is summed so, whatever its size: each element is then
    ``((g0 + g1) + g2) + ...`` whatever the chunk boundaries. Other chunks
    take one ``Allreduce`` and are scaled right after it, while in cache.
    Either way the result is bitwise identical on every rank.

    Args:
        comm: the communicator.
        buf: 1-D C-contiguous array (host, or device for a CUDA-aware MPI).
        scale: factor applied to the result (1.0: none).
        chunk_bytes: bytes per collective.
        op: the MPI reduction.
        after: called with each reduced (and scaled) chunk.
        ordered: the summer of ``buf``'s dtype on ``comm`` (rank order, or
            two levels, or 16 bits across hosts: a :data:`Summer`; its scratch
            buffers are reused); a rank-order one is made for this call when needed and None.
        every_chunk: sum every chunk in rank order (host buffers, ``MPI.SUM``).
        split_sums: sum large chunks in rank order also where ``scale`` is 1.

    Returns:
        The number of collective calls made.
    """
    n = buf.shape[0]
    step = chunk_bytes // buf.itemsize or 1
    host_sum = op == MPI.SUM and isinstance(buf, np.ndarray) and comm.Get_size() > 1
    split = host_sum and (every_chunk or split_sums or scale != 1.0)
    least = 0 if every_chunk else SPLIT_MEAN_BYTES
    calls = 0
    for start in range(0, n, step):
        chunk = buf[start : start + step]
        if split and chunk.nbytes >= least:
            if ordered is None:
                ordered = OrderedSum(comm, buf.dtype, chunk_bytes)
            calls += ordered(chunk, scale)
        else:
            calls += 1
            comm.Allreduce(MPI.IN_PLACE, chunk, op=op)
            if scale != 1.0:
                _scale(chunk, scale)
        if after is not None:
            after(chunk)
    return calls


class OrderedSum:
    """Sums host chunks of one dtype across ``comm`` in rank order, ``((g0 + g1) + g2) + ...``, then scales.

    Each element's sum is formed by one rank, adding every rank's value in
    rank order in the chunk's dtype, and scaled there; so the result does not
    depend on chunk boundaries, message sizes or the MPI library, and is the
    same on every rank. A chunk of up to ``gathered_bytes`` is gathered
    whole on every rank (one ``Allgather``) and summed there; a larger one is
    cut into one equal block per rank (``Alltoall``), each rank sums its
    block, and the blocks are shared (``Allgather``); the last ``n % size``
    elements, if any, are gathered whole. Scratch buffers are kept for the
    next chunk.

    Two levels (``across``): ``comm`` holds the ranks of one host, and each
    rank's sum of its block over the host is then summed with the other
    hosts' by ``across`` (the summer of the ranks with the same place on every
    host), which also scales it, before the blocks are shared on the host.
    Every element is then ``(host 0's sum + host 1's sum) + ...``, each host's
    in rank order, whatever the chunks; and each host sends
    ``2 (hosts - 1) / hosts`` of the bytes, as a ring does.

    Args:
        comm: the communicator (with ``across``: the ranks of one host).
        dtype: the chunks' dtype (float or complex).
        chunk_bytes: the largest chunk that will come (sizes the scratch buffers).
        across: the summer of the hosts' sums (an :class:`OrderedSum`, or a
            :class:`CastSum`), or None (``comm`` is all the ranks).
        wait: completes the nonblocking data movement (see :class:`Exchange`); None: blocking calls.
        gathered_bytes: the largest chunk gathered whole (one collective, not
            two); 0 where ``comm`` spans hosts, where a gathered chunk crosses
            the links ``size - 1`` times, twice what a ring sends at 4 hosts.
            Never with ``across``: every rank of the host would send all of
            the host's sum across.
    """

    def __init__(self, comm: MPI.Comm, dtype: Any, chunk_bytes: int = CHUNK_BYTES,
                 across: Summer | None = None, wait: Callable[[MPI.Request], None] | None = None,
                 gathered_bytes: int = GATHERED_SUM_BYTES) -> None:
        self.comm = comm
        self.gathered_bytes = 0 if across is not None else gathered_bytes
        self._moves = Exchange(comm, wait)
        self.across = across
        self.dtype = np.dtype(dtype)
        #: Bytes a value takes where it is handed to MPI (what crosses hosts, where a level across them casts).
        self.wire_itemsize: int = getattr(across, "wire_itemsize", self.dtype.itemsize)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._type = dtlib.from_numpy_dtype(self.dtype)
        self._step = max(1, chunk_bytes // self.dtype.itemsize)
        self._scratch = np.empty(0, self.dtype)

    def __call__(self, chunk: np.ndarray, scale: float = 1.0) -> int:
        """Sum ``chunk`` (1-D, contiguous) across ranks in place, times ``scale``; returns the collectives made."""
        n, size = chunk.shape[0], self.size
        if n == 0:
            return 0
        if size == 1:
            if self.across is not None:
                return self.across(chunk, scale)
            if scale != 1.0:
                _scale(chunk, scale)
            return 0
        if chunk.nbytes <= self.gathered_bytes or n < size:
            return self._gathered(chunk, scale)
        block = n // size
        body = chunk[: block * size]  # equal blocks: MPICH's Allgatherv is far slower than its Allgather
        recv = self._rows(size * block)
        self._moves.alltoall([body, self._type], [recv, self._type])
        calls = 2 + self._sum(recv.reshape(size, block), body[self.rank * block : (self.rank + 1) * block], scale)
        self._moves.allgather(MPI.IN_PLACE, [body, self._type])
        if body.shape[0] == n:
            return calls
        return calls + self._gathered(chunk[body.shape[0] :], scale)  # the last n % size elements

    def _gathered(self, chunk: np.ndarray, scale: float) -> int:
        """Sum ``chunk`` whole on every rank, from one ``Allgather`` of it."""
        n = chunk.shape[0]
        rows = self._rows(self.size * n).reshape(self.size, n)
        self._moves.allgather([chunk, self._type], [rows, self._type])
        return 1 + self._sum(rows, chunk, scale)

    def _sum(self, rows: np.ndarray, out: np.ndarray, scale: float) -> int:
        """``out`` = the rows summed in rank order (then across the hosts), times ``scale``; the collectives made."""
        if self.across is None:
            _sum_rows(rows, out, scale)
            return 0
        _sum_rows(rows, out, 1.0)
        return self.across(out, scale)

    def reduce_scatter(self, chunk: np.ndarray, counts: Sequence[int], displs: Sequence[int], out: np.ndarray) -> int:
        """``out`` = this rank's slice of ``chunk`` (``counts[rank]`` elements from ``displs[rank]``), summed
        over the ranks in rank order; returns the collectives made.

        MPICH's own ``Reduce_scatter`` grows the process's memory with every call, as its
        ``Reduce_scatter_block`` does.
        """
        size, mine = self.size, counts[self.rank]
        recv = self._rows(size * mine)
        self.comm.Alltoallv([chunk, (list(counts), list(displs)), self._type],
                            [recv, ([mine] * size, [r * mine for r in range(size)]), self._type])
        if size == 1:
            np.copyto(out, recv)
        else:
            _sum_rows(recv.reshape(size, mine), out, 1.0)
        return 1

    def _rows(self, count: int) -> np.ndarray:
        if self._scratch.shape[0] < count:
            gathered = self.size * max(1, GATHERED_SUM_BYTES // self.dtype.itemsize)
            sliced = self.size * -(-self._step // self.size)
            self._scratch = np.empty(max(count, gathered, sliced), self.dtype)
        return self._scratch[:count]


def _sum_rows(rows: np.ndarray, out: np.ndarray, scale: float) -> None:
    """``out = (((rows[0] + rows[1]) + rows[2]) + ...) * scale``, in ``out``'s dtype."""
    np.add(rows[0], rows[1], out=out)
    for r in range(2, rows.shape[0]):
        np.add(out, rows[r], out=out)
    if scale != 1.0:
        if out.dtype.kind == "c":
            _scale(out, scale)
        else:
            np.multiply(out, scale, out=out)


def _scale(a: Any, scale: float, out: Any = None) -> None:
    """``out = a * scale`` (in place by default); complex values component-wise: (inf+0j) stays (inf+0j)."""
    out = a if out is None else out
    if a.dtype.kind == "c":
        a, out = a.view(a.real.dtype), out.view(out.real.dtype)
    np.multiply(a, scale, out=out)


class LevelledScatter:
    """A reduce-scatter in two levels: over each host's shared memory, then across the hosts.

    Rank ``r`` receives its slice of the chunk summed over every rank, as
    ``(host 0's sum + host 1's sum) + ...``, each host's in rank order (the
    two-level allreduce's order). First each rank receives, from every rank of
    its host, the slices of the ranks with its place on every host, and adds
    them (one ``Alltoallv`` on the host); then the ranks with the same place on
    every host reduce-scatter those sums among themselves. Each host sends
    ``(hosts - 1) / hosts`` of the chunk across the links, as a ring does.

    Args:
        node: the rank-order summer of this host's ranks.
        across: the rank-order summer of the ranks with this rank's place on every host (in host order).
        topology: the hosts of the reducer's communicator (the same number of ranks on each).
    """

    def __init__(self, node: OrderedSum, across: OrderedSum, topology: Topology) -> None:
        self.node, self.across = node, across
        self._ranks = [topology.ranks_on(h) for h in range(topology.hosts)]
        self._local = topology.local_rank
        self._send = np.empty(0, node.dtype)
        self._block = np.empty(0, node.dtype)

    def reduce_scatter(self, chunk: np.ndarray, counts: Sequence[int], displs: Sequence[int], out: np.ndarray) -> int:
        """``out`` = this rank's slice of ``chunk`` (``counts[rank]`` elements from ``displs[rank]``), summed
        over every rank; returns the collectives made."""
        n = chunk.shape[0]
        if self._send.shape[0] < n:
            self._send = np.empty(n, chunk.dtype)
        send, places, at = self._send, len(self._ranks[0]), 0
        per_place = []
        for place in range(places):  # the slices of each place's ranks, host by host
            start = at
            for ranks in self._ranks:
                r = ranks[place]
                send[at: at + counts[r]] = chunk[displs[r]: displs[r] + counts[r]]
                at += counts[r]
            per_place.append(at - start)
        mine = per_place[self._local]
        if self._block.shape[0] < mine:
            self._block = np.empty(mine, chunk.dtype)
        block = self._block[:mine]
        node = self.node
        recv = node._rows(places * mine)
        node.comm.Alltoallv([send[:at], (per_place, list(np.cumsum([0, *per_place[:-1]]))), node._type],
                            [recv, ([mine] * places, [p * mine for p in range(places)]), node._type])
        _sum_rows(recv.reshape(places, mine), block, 1.0)
        across = [counts[ranks[self._local]] for ranks in self._ranks]
        return 1 + self.across.reduce_scatter(block, across, list(np.cumsum([0, *across[:-1]])), out)


class Summers:
    """One reducer's summers over ``comm``, each made once: flat, or in two levels across hosts (collective).

    Args:
        comm: the reducer's communicator.
        topology: its hosts.
        two_levels: allow two levels where they apply (False: always flat, in rank order).
        wait: completes the summers' nonblocking data movement (see :class:`~.transport.Exchange`); None:
            blocking calls.

    Attributes:
        count: the number of hosts (the same on every rank).
        two_levels: whether the summers sum in two levels.
        casts_across: whether a cast sum sends only what crosses hosts as 16 bits (two levels, or one rank
            on each of several hosts; see :meth:`cast`).
        chunk_bytes: the bytes of one collective: ``CHUNK_BYTES`` on one host, ``CHUNK_BYTES_ACROSS_HOSTS``
            across hosts.
        split_sums: large sums go through the rank-order sum too (:func:`allreduce`'s ``split_sums``), as
            means do: under Intel MPI, whose own ``Allreduce`` of a large message gave other bits from one
            call to the next with the same input (so a call would not match itself, nor its asynchronous
            twin); MPICH's and Open MPI's did not.
        node: the ranks of this host (two levels only).
        across: the ranks with this rank's place on every host (two levels only).
    """

    def __init__(self, comm: MPI.Intracomm, topology: Topology, two_levels: bool = True,
                 wait: Callable[[MPI.Request], None] | None = None) -> None:
        self.comm, self.topology, self.wait = comm, topology, wait
        self.count = topology.hosts
        even = topology.ranks_per_host is not None
        self.chunk_bytes = CHUNK_BYTES if self.count == 1 else transport.CHUNK_BYTES_ACROSS_HOSTS
        self.split_sums = "Intel(R) MPI" in MPI.Get_library_version()
        self.two_levels = bool(two_levels) and even and 1 < topology.local_size < comm.Get_size()
        self.casts_across = bool(two_levels) and even and self.count > 1
        self.node: MPI.Intracomm | None = None
        self.across: MPI.Intracomm | None = None
        if self.two_levels:
            self.node, self.across = topology.split(comm)
        self._made: dict[tuple[Any, ...], Any] = {}

    def ordered(self, dtype: Any, chunk_bytes: int | None = None) -> Summer:
        """The summer of ``dtype`` chunks of up to ``chunk_bytes`` (default :attr:`chunk_bytes`): two levels
        where they apply, else rank order over ``comm``."""
        key = ("ordered", np.dtype(dtype), chunk_bytes)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._ordered(dtype, self.chunk_bytes if chunk_bytes is None else chunk_bytes)
        return made

    def _ordered(self, dtype: Any, chunk_bytes: int) -> OrderedSum:
        if self.node is None or self.across is None:  # small chunks gathered whole on one host only
            return OrderedSum(self.comm, dtype, chunk_bytes, wait=self.wait,
                              gathered_bytes=GATHERED_SUM_BYTES if self.count == 1 else 0)
        across = OrderedSum(self.across, dtype, chunk_bytes, wait=self.wait, gathered_bytes=0)
        return OrderedSum(self.node, dtype, chunk_bytes, across=across, wait=self.wait)

    def cast(self, dtype: Any, compression: Compression, predivide: float | None = None,
             chunk_bytes: int | None = None) -> Summer:
        """The summer of float32/float64 ``dtype`` chunks sent as ``compression``'s 16 bits (made once).

        Across hosts, where :attr:`casts_across`, only the hosts' sums cross
        the links as 16 bits: each host's ranks sum as they are over shared
        memory, and each host's sum is divided by ``predivide`` (default: the
        compression's own for the ranks of ``comm``), rounded once, summed in
        float32 across hosts and cast back (:class:`CastSum` as the level
        across hosts; a chunk in :data:`CAST_PIECES` pieces, each cast while
        the one before travels). Elsewhere every rank's chunk is cast where it
        lies and summed in float32, in rank order (:class:`CastSum` over all
        the ranks, in one piece on one host, where the links are not the
        bottleneck).
        """
        chunk_bytes = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        key = ("cast", np.dtype(dtype), compression.name, predivide, chunk_bytes)
        made = self._made.get(key)
        if made is not None:
            return made
        f = compression.default_predivide(self.comm.Get_size()) if predivide is None else predivide
        wire_bytes = chunk_bytes * compression.wire_dtype.itemsize // np.dtype(dtype).itemsize  # the largest chunk
        if self.casts_across and self.node is not None and self.across is not None:
            block_bytes = max(2, wire_bytes // self.node.Get_size())  # a block of the host's sum, in 16 bits
            across = CastSum(SliceSum(self.across, compression, block_bytes, "alltoall", wait=self.wait), dtype, f)
            made = OrderedSum(self.node, dtype, chunk_bytes, across=across, wait=self.wait)
        else:
            flat = SliceSum(self.comm, compression, wire_bytes, "alltoall", wait=self.wait)
            made = CastSum(flat, dtype, f, CAST_PIECES if self.casts_across else 1)
        self._made[key] = made
        return made

    def scatter(self, dtype: Any) -> OrderedSum | LevelledScatter:
        """What reduce-scatters ``dtype`` chunks (its ``reduce_scatter``): two levels where they apply, else
        rank order over ``comm`` (made once)."""
        key = ("scatter", np.dtype(dtype))
        made = self._made.get(key)
        if made is None:
            if self.node is None or self.across is None:
                made = OrderedSum(self.comm, dtype, CHUNK_BYTES)
            else:
                made = LevelledScatter(OrderedSum(self.node, dtype, CHUNK_BYTES),
                                       OrderedSum(self.across, dtype, CHUNK_BYTES), self.topology)
            self._made[key] = made
        return made

    def cast_chunk_bytes(self, dtype: Any, compression: Compression) -> int:
        """The bytes of ``dtype`` a cast sum takes at a time: :attr:`chunk_bytes` where only what crosses hosts
        is cast, else as many values as :attr:`chunk_bytes` of 16-bit wire data."""
        if self.casts_across:
            return self.chunk_bytes
        return self.chunk_bytes * np.dtype(dtype).itemsize // compression.wire_dtype.itemsize

    def sliced(self, compression: Compression, chunk_bytes: int | None = None) -> SliceSum:
        """The summer of 16-bit chunks in float32 (``chunk_bytes`` of wire data a collective, default
        :attr:`chunk_bytes`): two levels where they apply, else slices over ``comm`` (made once)."""
        chunk_bytes = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        key = ("sliced", compression.wire_dtype, chunk_bytes)
        made = self._made.get(key)
        if made is None:
            if self.node is None or self.across is None:
                made = SliceSum(self.comm, compression, chunk_bytes, "alltoall", wait=self.wait)
            else:
                across = SliceSum(self.across, compression, chunk_bytes, "alltoall", wait=self.wait)
                made = SliceSum(self.node, compression, chunk_bytes, "alltoall", wait=self.wait, across=across)
            self._made[key] = made
        return made

    def communicators(self) -> list[MPI.Intracomm]:
        """The communicators of the two levels, where made (the caller's ``comm`` is not the summers')."""
        return [c for c in (self.node, self.across) if c is not None]

    def free(self) -> None:
        """Release the communicators of the two levels (collective). Idempotent."""
        for comm in (self.node, self.across):
            if comm is not None:
                comm.Free()
        self.node = self.across = None
        self._made.clear()
