"""Which ranks share a host: worked out once per communicator, used by everything that needs it.

A *host* is a set of ranks that share memory (``Split_type`` with
``MPI_COMM_TYPE_SHARED``) and report the same processor name: ranks that MPI
places apart, or whose host names differ, are on different hosts. Hosts are
numbered by their lowest rank; a rank's *local rank* is its place among the
ranks of its host, its *cross rank* its place among the ranks of its local
rank, one per host, in host order (Horovod's names; the number of its host
where every host holds as many ranks).

All traffic is buffer-based (fixed-size name buffers, integer arrays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

__all__ = ["Topology", "processor_names"]

#: Bytes of a processor name that are compared (MPI's ``MPI_MAX_PROCESSOR_NAME`` is 256 or less in practice).
_NAME_BYTES = 256


@dataclass(frozen=True)
class Topology:
    """The hosts of a communicator's ranks, the same on every rank.

    Attributes:
        rank: this rank in the communicator.
        host_of: the host of every rank, in rank order (hosts numbered by their lowest rank).
        names: every rank's processor name, in rank order.
    """

    rank: int
    host_of: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, comm: MPI.Intracomm) -> Topology:
        """The topology of ``comm`` (collective)."""
        names = processor_names(comm)
        rank = comm.Get_rank()
        color = sorted(set(names)).index(names[rank])
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            host = node.Split(color, key=rank)
            try:
                leader = np.array([rank], dtype=np.int64)
                host.Bcast(leader, root=0)  # a host is named by its lowest rank
            finally:
                host.Free()
        finally:
            node.Free()
        leaders = np.empty(comm.Get_size(), dtype=np.int64)
        comm.Allgather(leader, leaders)
        first = np.unique(leaders)
        return cls(rank, tuple(int(h) for h in np.searchsorted(first, leaders)), tuple(names))

    @classmethod
    def named(cls, names: Sequence[str], rank: int) -> Topology:
        """The topology that processor names alone give (one host per name; local): for ranks that no
        communicator spans yet, such as the world a replacement will join.

        Args:
            names: every rank's processor name, in rank order.
            rank: this rank.
        """
        first: dict[str, int] = {}
        for name in names:
            first.setdefault(name, len(first))
        return cls(rank, tuple(first[name] for name in names), tuple(names))

    @property
    def size(self) -> int:
        """The number of ranks."""
        return len(self.host_of)

    @property
    def hosts(self) -> int:
        """The number of hosts."""
        return max(self.host_of) + 1

    @property
    def host(self) -> int:
        """This rank's host (Horovod's cross rank where every host holds as many ranks; see :attr:`cross_rank`)."""
        return self.host_of[self.rank]

    def ranks_on(self, host: int) -> list[int]:
        """The ranks of ``host``, in rank order."""
        return [r for r, h in enumerate(self.host_of) if h == host]

    @property
    def local_rank(self) -> int:
        """This rank's place among the ranks of its host."""
        return self.ranks_on(self.host).index(self.rank)

    @property
    def local_size(self) -> int:
        """The number of ranks on this rank's host."""
        return self.host_of.count(self.host)

    @property
    def cross_size(self) -> int:
        """The number of hosts with a rank of this rank's local rank (Horovod's cross size)."""
        local = self.local_rank
        return sum(1 for h in range(self.hosts) if self.host_of.count(h) > local)

    @property
    def cross_rank(self) -> int:
        """This rank's place among the ranks of its local rank, in host order (Horovod's cross rank: the rank
        in the second communicator of :meth:`split`)."""
        local = self.local_rank
        return sum(1 for h in range(self.host) if self.host_of.count(h) > local)

    @property
    def ranks_per_host(self) -> int | None:
        """The number of ranks on every host, or None where hosts hold different numbers."""
        counts = {self.host_of.count(h) for h in range(self.hosts)}
        return counts.pop() if len(counts) == 1 else None

    def split(self, comm: MPI.Intracomm) -> tuple[MPI.Intracomm, MPI.Intracomm]:
        """This host's ranks, and the ranks with this rank's local rank on every host (collective; free both).

        Returns:
            ``(node, cross)``: ``node`` in rank order; ``cross`` in host order.
        """
        node = comm.Split(self.host, key=self.rank)
        cross = comm.Split(self.local_rank, key=self.host)
        assert isinstance(node, MPI.Intracomm) and isinstance(cross, MPI.Intracomm)  # mpi4py's stubs say Comm
        return node, cross


def processor_names(comm: MPI.Intracomm | None = None) -> list[str]:
    """Every rank's processor (host) name, in rank order, on every rank (collective).

    Gathered as fixed-size byte buffers: nothing is pickled.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    name = np.zeros(_NAME_BYTES, dtype=np.uint8)
    raw = MPI.Get_processor_name().encode()[:_NAME_BYTES]
    name[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    table = np.empty((comm.Get_size(), _NAME_BYTES), dtype=np.uint8)
    comm.Allgather(name, table)
    return [row.tobytes().rstrip(b"\0").decode(errors="replace") for row in table]
