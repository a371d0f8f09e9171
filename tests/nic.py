"""What each host's NIC sends while the ranks do some collective work, read from the kernel's counters in the job.

Under ``scripts/cluster.py run`` every host is a network namespace whose
only NIC is ``eth0``; ``CLUSTER_HOSTS`` and ``CLUSTER_PPN`` in the ranks'
environment give the layout of the launch. :class:`Wire` reads the NIC
counters from inside the job, so that what the launch and the output send
(the proxies' start, PMI, the ranks' lines to ``mpiexec``) falls outside
what it counts; the only other traffic in a window, the barriers that
close it, is counted in an empty window and subtracted. Every other source
(a host's own traffic) does not exist in such a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from conftest import WORLD

#: The hosts of the launch, as ``scripts/cluster.py`` tells the ranks (1 when not launched by it).
LAUNCH_HOSTS = int(os.environ.get("CLUSTER_HOSTS", "1"))
#: Ranks per host of the launch (0 when not launched by ``scripts/cluster.py``).
LAUNCH_PPN = int(os.environ.get("CLUSTER_PPN", "0"))
#: The counter of a host's NIC (``scripts/cluster.py`` gives each host ``eth0`` and the loopback only).
COUNTER = "/sys/class/net/eth0/statistics/tx_bytes"


def ring_bytes(nbytes: float, hosts: int) -> float:
    """What each host must send for an Allreduce of ``nbytes`` between ``hosts`` hosts: ``2 (H - 1) / H`` of it."""
    return 2 * (hosts - 1) / hosts * nbytes


class Wire:
    """Counts the bytes each host's NIC sends during windows of collective work (collective to build and use).

    A host is the ranks with one processor name (``scripts/cluster.py``
    gives each host a host name of its own); its lowest rank reads the
    counter. A window is ``Barrier``, read, ``Barrier``, the work,
    ``Barrier``, read: no rank starts the work before its host's counter
    is read, and every rank's part is done before it is read again.

    Raises:
        AssertionError: (on every rank) the hosts are not those of the
            launch, or a counter cannot be read.
    """

    def __init__(self) -> None:
        names = WORLD.allgather(MPI.Get_processor_name())
        self.hosts = list(dict.fromkeys(names))
        mine = names[WORLD.Get_rank()]
        self.host = self.hosts.index(mine)
        self.leader = names.index(mine) == WORLD.Get_rank()
        self.ranks_per_host = [names.count(h) for h in self.hosts]
        assert len(self.hosts) == LAUNCH_HOSTS and self.ranks_per_host == [LAUNCH_PPN] * LAUNCH_HOSTS, (
            f"the ranks run on {len(self.hosts)} hosts ({self.ranks_per_host} ranks), the launch said "
            f"{LAUNCH_HOSTS} x {LAUNCH_PPN}")
        self._empty: np.ndarray | None = None

    def _read(self) -> tuple[int, str]:
        """This host's counter (leaders), and why it could not be read."""
        if not self.leader:
            return 0, ""
        try:
            with open(COUNTER) as f:
                return int(f.read()), ""
        except (OSError, ValueError) as exc:
            return -1, f"host {self.host} (rank {WORLD.Get_rank()}): cannot read {COUNTER}: {exc}"

    def _window(self, work: Callable[[], object]) -> np.ndarray:
        """The bytes each host sent while ``work`` ran on every rank, by host."""
        WORLD.Barrier()
        start, problem = self._read()
        WORLD.Barrier()
        work()
        WORLD.Barrier()
        end, later = self._read()
        problems = [p for p in WORLD.allgather(problem or later) if p]
        assert not problems, "; ".join(problems)
        sent = np.zeros(len(self.hosts), dtype=np.int64)
        if self.leader:
            sent[self.host] = end - start
        WORLD.Allreduce(MPI.IN_PLACE, sent, op=MPI.SUM)
        return sent

    def empty(self) -> np.ndarray:
        """What a window with no work sends (its barriers), by host: the least of five."""
        if self._empty is None:
            self._empty = np.min([self._window(lambda: None) for _ in range(5)], axis=0)
        return self._empty

    def per_call(self, call: Callable[[], object], calls: int = 1) -> np.ndarray:
        """Bytes each host sent per ``call()``, the empty window's bytes taken off: ``calls`` windows of one call."""
        base = self.empty()
        return np.mean([self._window(call) - base for _ in range(calls)], axis=0)
