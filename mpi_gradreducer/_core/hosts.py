"""Which ranks share a host, and the two-level summers that send across hosts only what a ring must.

Summed flat, in rank order (:class:`~mpi_gradreducer._core.transport.OrderedSum`),
a chunk travels between every pair of ranks: with 2 ranks on each of 2
hosts, each host sends 1.75 times the chunk, where a ring sends it once.
Summed in two levels, each host's ranks first sum their blocks over shared
memory, the ranks with the same place on every host sum those partial sums
among themselves, and the blocks are shared on each host again: each host
sends ``2 (hosts - 1) / hosts`` of the chunk, the ring's optimum.

Two levels are used where the ranks span several hosts with the same number
of ranks, more than one, on each (otherwise, one rank per host or uneven
hosts, the flat sum is as good or the only one possible), unless the reducer
sums in rank order (``deterministic=True``): the two levels add each host's
sum in host order, ``(g0 + g1) + (g2 + g3)`` where rank order is
``((g0 + g1) + g2) + g3``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import compression as wire, transport
from .topology import Topology

__all__ = ["Hosts"]


class Hosts:
    """The communicators of a two-level sum over the hosts of ``comm`` (collective).

    Args:
        comm: the reducer's communicator.
        topology: its hosts.
        two_levels: allow two levels where they apply (False: always flat).
        wait: completes the summers' nonblocking data movement (see
            :class:`~mpi_gradreducer._core.transport.Exchange`); None: blocking calls.

    Attributes:
        count: the number of hosts (the same on every rank).
        ranks_per_host: the ranks on every host, or None where hosts hold different numbers.
        ranks_here: the ranks on this rank's host.
        two_levels: whether the summers it makes sum in two levels.
        casts_across: whether compression casts only what crosses hosts (two
            levels, or one rank on each of several hosts; see :meth:`ordered_sum`).
        wait: what completes the summers' nonblocking data movement, or None.
        chunk_bytes: the bytes of one collective: ``transport.CHUNK_BYTES`` on
            one host, ``transport.CHUNK_BYTES_ACROSS_HOSTS`` across hosts.
    """

    def __init__(self, comm: MPI.Intracomm, topology: Topology, two_levels: bool = True,
                 wait: Callable[[MPI.Request], None] | None = None) -> None:
        self.comm, self.wait = comm, wait
        self.count = topology.hosts
        self.ranks_per_host = topology.ranks_per_host
        self.ranks_here = topology.local_size
        even = self.ranks_per_host is not None
        self.chunk_bytes = transport.CHUNK_BYTES if self.count == 1 else transport.CHUNK_BYTES_ACROSS_HOSTS
        self.two_levels = bool(two_levels) and even and 1 < self.ranks_here < comm.Get_size()
        self.casts_across = bool(two_levels) and even and self.count > 1
        self.node: MPI.Intracomm | None = None
        self.across: MPI.Intracomm | None = None
        if self.two_levels:
            self.node, self.across = topology.split(comm)

    def ordered_sum(self, dtype: Any, chunk_bytes: int | None = None, compression: wire.Compression | None = None,
                    predivide: float | None = None) -> transport.Summer:
        """A summer of ``dtype`` host chunks (of up to ``chunk_bytes``, default :attr:`chunk_bytes`): two levels
        where they apply, else rank order over ``comm``.

        With ``compression`` (where :attr:`casts_across`, for a dtype it
        applies to), the hosts' sums cross the links as 16-bit floats
        (:class:`~.compression.CastSum`, dividing by ``predivide``, default
        the compression's own for the ranks of ``comm``), each chunk cast
        while it is in cache.
        """
        chunk_bytes = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        cast = compression is not None and self.casts_across and compression.applies_to(dtype)
        if cast:
            assert compression is not None
            f = compression.default_predivide(self.comm.Get_size()) if predivide is None else predivide
            wire_bytes = chunk_bytes * 2 // np.dtype(dtype).itemsize  # the largest chunk, in 16 bits
            if self.across is None:  # one rank on each host
                return wire.CastSum(self.slice_sum(compression, wire_bytes), dtype, f)
        if self.node is None or self.across is None:
            return transport.OrderedSum(self.comm, dtype, chunk_bytes, wait=self.wait)
        across: transport.Summer = transport.OrderedSum(self.across, dtype, chunk_bytes, wait=self.wait)
        if cast:
            assert compression is not None
            block_bytes = max(2, wire_bytes // self.node.Get_size())  # a block of the host's sum, in 16 bits
            across = wire.CastSum(wire.SliceSum(self.across, compression, block_bytes, "alltoall", wait=self.wait),
                                  dtype, f)
        return transport.OrderedSum(self.node, dtype, chunk_bytes, across=across, wait=self.wait)

    def slice_sum(self, compression: wire.Compression, chunk_bytes: int | None = None) -> wire.SliceSum:
        """A summer of 16-bit chunks in float32 (``chunk_bytes`` of wire data a collective, default
        :attr:`chunk_bytes`): two levels where they apply, else slices over ``comm``."""
        chunk_bytes = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        if self.node is None or self.across is None:
            return wire.SliceSum(self.comm, compression, chunk_bytes, "alltoall", wait=self.wait)
        return wire.SliceSum(self.node, compression, chunk_bytes, "alltoall", wait=self.wait,
                             across=wire.SliceSum(self.across, compression, chunk_bytes, "alltoall", wait=self.wait))

    def free(self) -> None:
        """Release the communicators of the two levels (collective). Idempotent."""
        for comm in (self.node, self.across):
            if comm is not None:
                comm.Free()
        self.node = self.across = None

