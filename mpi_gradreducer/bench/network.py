"""Across hosts: how many hosts a run spans, the wire bound of a link rate, and the bytes each host's NICs send.

The host benchmark (and the ``compression`` and ``torch-optimizer``
subcommands) take ``--link-rate RATE``: the rate of each host's link, in
``tc``'s spelling (``1gbit``, ``500mbit``, ``2.5gbit``, ``100kbit``,
``1000000bit``)::

    python scripts/cluster.py --name bx run --hosts 2 --ppn 2 --rate 1gbit -- \\
        python -m mpi_gradreducer.bench --workload resnet50 --methods limit reducer reducer-fp16 \\
        --link-rate 1gbit --reps 3

With it, each workload gets a table "across H hosts": the **wire bound**,
the least time in which every host can send what an Allreduce needs it to
send, ``2 (H - 1) / H * gradient bytes`` (the ring optimum: a
reduce-scatter then an allgather between hosts; ranks on one host add
nothing on the links) divided by the rate; and each method's median time as
a multiple of it (``x wire``).

Without ``--link-rate`` the table is still printed when the run spans
several hosts, without the wire bound: it holds the **bytes each host sent
per call**, counted by the kernel. On each host its first rank (rank 0 of
``MPI_COMM_TYPE_SHARED``, split further by processor name) reads
``/sys/class/net/*/statistics/tx_bytes`` of every interface but the
loopback (or of those named by ``--nics``) right after the barrier that
follows each timed call and before the barrier that precedes it, outside the
timed region, so that with the methods interleaved each is charged its own
calls only. The figure printed is the busiest host's bytes per call, and its
ratio to the ring optimum ``2 (H - 1) / H`` times the uncompressed gradient
bytes (``x ring``); for a method that reports its wire bytes (the
compressed and PowerSGD methods), also the ratio to its own optimum,
``2 (H - 1) / H`` times those bytes (``x own``).

What the counters see, and do not:

* They count everything the interface sent: Ethernet, IP and TCP headers,
  TCP acknowledgements of the bytes received, the two barriers around each
  call, and, on a real host, any other traffic of the machine meanwhile (a
  file system, another job, ssh). On the cluster of
  ``scripts/cluster.py`` a host's only NIC is its ``eth0`` and nothing else
  runs there, so the figure is the job's own; on real hosts, run on quiet
  machines, and name the interface that carries MPI with ``--nics``
  (otherwise bridges, VLANs or bonds on top of a NIC count the same bytes
  twice).
* Traffic that bypasses the kernel is not counted at all: RDMA (InfiniBand,
  RoCE, EFA), and shared memory between ranks of one host. Such a run shows
  bytes per call far below the ring optimum.
* On a single host (H = 1) nothing crosses a link: no counter is read, and
  the table says so.

Across a cluster at several rates, ``scripts/bench_hosts.py`` runs the host
benchmark at 0.5, 1, 2 and 5 Gbit/s (``cluster.py rate`` reshapes the NICs
between runs) and plots the time per call of each method against the rate,
with the wire bound.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core.topology import Topology
from .output import bytes_label

__all__ = [
    "Hosts",
    "NicMeter",
    "SYS_NET",
    "figures",
    "format_lines",
    "format_ms",
    "format_rate",
    "host_layout",
    "interfaces",
    "parse_link_rate",
    "ring_bytes",
    "tx_bytes",
    "wire_bound_seconds",
]

#: Where Linux lists the network interfaces of this process's network namespace.
SYS_NET = "/sys/class/net"
#: ``tc``'s units of a rate, in bits per second.
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(bit|kbit|mbit|gbit|tbit)")
#: ``/sys/class/net/X/type`` of a loopback interface (ARPHRD_LOOPBACK).
_LOOPBACK_TYPE = "772"


def parse_link_rate(text: str) -> float:
    """A link rate in ``tc``'s spelling, in bits per second.

    Args:
        text: a positive number and a unit, ``bit``, ``kbit``, ``mbit``,
            ``gbit`` or ``tbit`` (decimal: ``1gbit`` is 10**9 bits per
            second), e.g. ``"1gbit"``, ``"500mbit"``, ``"2.5gbit"``; case and
            surrounding spaces do not matter.

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: ``text`` is not such a rate, or is zero.
    """
    m = _RATE.fullmatch(str(text).strip().lower())
    rate = float(m[1]) * _UNITS[m[2]] if m else 0.0
    if not m or not rate > 0 or rate == float("inf"):
        raise ValueError(f"--link-rate: expected a positive rate such as 1gbit, 500mbit or 2.5gbit "
                         f"(units bit, kbit, mbit, gbit, tbit), got {text!r}")
    return rate


def format_rate(bits_per_second: float) -> str:
    """``1e9`` as ``"1 Gbit/s"``, ``5e8`` as ``"500 Mbit/s"``, ``2.5e9`` as ``"2.5 Gbit/s"``."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g} {unit}"
    return f"{bits_per_second:g} bit/s"


def format_ms(ms: float) -> str:
    """A time in milliseconds to 3 significant digits, without an exponent: ``"0.308"``, ``"818"``, ``"1635"``."""
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def ring_bytes(nbytes: int | float, hosts: int) -> float:
    """The bytes every host must send for an Allreduce of ``nbytes`` across ``hosts`` hosts.

    A bandwidth-optimal Allreduce (reduce-scatter, then allgather) has every
    host send ``(H - 1) / H`` of the data in each half: ``2 (H - 1) / H *
    nbytes`` in all. Ranks that share a host reduce among themselves first
    and add nothing on the links.

    Args:
        nbytes: the bytes reduced (what each rank holds).
        hosts: the number of hosts, at least 1.

    Returns:
        The bytes per host; 0 on one host.

    Raises:
        ValueError: ``hosts`` is below 1 or ``nbytes`` negative.
    """
    if hosts < 1:
        raise ValueError(f"hosts: expected at least 1, got {hosts}")
    if nbytes < 0:
        raise ValueError(f"nbytes: expected at least 0, got {nbytes}")
    return 2.0 * (hosts - 1) / hosts * nbytes


def wire_bound_seconds(nbytes: int | float, hosts: int, bits_per_second: float) -> float:
    """The least time of an Allreduce of ``nbytes`` across ``hosts`` hosts, each with a link of that rate.

    Args:
        nbytes: the bytes reduced (what each rank holds).
        hosts: the number of hosts, at least 1.
        bits_per_second: each host's send rate.

    Returns:
        :func:`ring_bytes` in bits over the rate, in seconds; 0 on one host.

    Raises:
        ValueError: ``hosts`` below 1, ``nbytes`` negative, or the rate not positive.
    """
    if not bits_per_second > 0:
        raise ValueError(f"bits_per_second: expected a positive rate, got {bits_per_second}")
    return ring_bytes(nbytes, hosts) * 8.0 / bits_per_second


@dataclass(frozen=True)
class Hosts:
    """Where the ranks of a communicator are, host by host.

    Attributes:
        count: the number of hosts (H).
        index: this rank's host, from 0 (hosts numbered in the order of their lowest rank).
        leader: True on one rank per host: the one that reads the host's NIC counters.
        ranks_per_host: the number of ranks on each host, by index.
    """

    count: int
    index: int
    leader: bool
    ranks_per_host: tuple[int, ...]


def host_layout(comm: MPI.Intracomm) -> Hosts:
    """The hosts the ranks of ``comm`` run on (collective).

    Hosts as the package's ``Topology`` sees them (ranks that share memory and
    a processor name). The environment (``CLUSTER_HOSTS`` and the like) is not consulted.

    Args:
        comm: the communicator.

    Returns:
        The layout; the same ``count`` and ``ranks_per_host`` on every rank.
    """
    topology = Topology.of(comm)
    return Hosts(count=topology.hosts, index=topology.host, leader=topology.local_rank == 0,
                 ranks_per_host=tuple(len(topology.ranks_on(h)) for h in range(topology.hosts)))


def interfaces(names: Sequence[str] | None = None, root: str = SYS_NET) -> list[str]:
    """The interfaces whose bytes count: ``names``, or every interface of this namespace but the loopback.

    Args:
        names: interfaces to count, or None for all but the loopback.
        root: where the interfaces are listed (``/sys/class/net``).

    Returns:
        Their names, sorted.

    Raises:
        ValueError: one of ``names`` does not exist here.
    """
    try:
        present = sorted(os.listdir(root))
    except OSError:
        present = []
    if names is not None:
        missing = [n for n in names if n not in present]
        if missing:
            raise ValueError(f"--nics: no interface {', '.join(missing)} here; there are {', '.join(present)}")
        return sorted(names)
    return [n for n in present if _read(os.path.join(root, n, "type")) != _LOOPBACK_TYPE and n != "lo"]


def tx_bytes(names: Sequence[str], root: str = SYS_NET) -> int:
    """The bytes the interfaces ``names`` have sent so far, summed (their kernel counters).

    Args:
        names: interface names, e.g. from :func:`interfaces`.
        root: where the interfaces are listed.

    Returns:
        The sum of their ``statistics/tx_bytes``; an interface that has
        gone counts 0.
    """
    total = 0
    for name in names:
        text = _read(os.path.join(root, name, "statistics", "tx_bytes"))
        total += int(text) if text.isdigit() else 0
    return total


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


class NicMeter:
    """Counts what each host's NICs send during each case's timed calls (a meter for ``time_cases``).

    Built collectively; on one rank per host it reads the NIC counters in
    :meth:`before` and :meth:`after`, which :func:`~.timing.time_cases`
    calls around each timed call, outside the timed region. :meth:`after`
    starts with a barrier, so that every rank's part of the call is done
    (and so sent) before the counters are read; the barrier that precedes
    the next call comes after the next :meth:`before`, so that no other
    case's traffic falls between the two readings.

    Args:
        comm: the communicator the cases run over.
        nics: the interfaces to count (default: all but the loopback).
    """

    def __init__(self, comm: MPI.Intracomm, nics: Sequence[str] | None = None) -> None:
        self.comm = comm
        self.hosts = host_layout(comm)
        problem = ""
        names: list[str] = []
        if self.hosts.leader:
            try:
                names = interfaces(nics)
            except ValueError as exc:
                problem = str(exc)
        problems = [p for p in comm.allgather(problem) if p]
        if problems:
            raise ValueError(problems[0])
        self.names = names
        self.active = self.hosts.count > 1
        self._start = 0
        self._sent: dict[int, int] = {}
        self._calls: dict[int, int] = {}

    def before(self, index: int) -> None:
        """Just before case ``index``'s barrier and timed call: read the counters (leaders only)."""
        if self.active and self.hosts.leader:
            self._start = tx_bytes(self.names)

    def after(self, index: int) -> None:
        """Just after case ``index``'s timed call: a barrier, then read the counters (leaders only)."""
        if not self.active:
            return
        self.comm.Barrier()
        if self.hosts.leader:
            self._sent[index] = self._sent.get(index, 0) + tx_bytes(self.names) - self._start
        self._calls[index] = self._calls.get(index, 0) + 1

    def per_call(self, names: Sequence[str]) -> dict[str, list[float]]:
        """Each case's bytes per call, host by host (collective; the same on every rank).

        Args:
            names: the cases' names, by index as given to :meth:`before`.

        Returns:
            For each case that was metered, the bytes per call each host's
            NICs sent, by host index; empty on one host.
        """
        if not self.active:
            return {}
        table = np.zeros((len(names), self.hosts.count), dtype=np.float64)
        if self.hosts.leader:
            for j in range(len(names)):
                table[j, self.hosts.index] = self._sent.get(j, 0) / max(1, self._calls.get(j, 0))
        self.comm.Allreduce(MPI.IN_PLACE, table, op=MPI.SUM)
        return {name: [float(b) for b in table[j]] for j, name in enumerate(names) if self._calls.get(j)}


def figures(hosts: Hosts, nbytes: int, link_rate: float | None, medians_ms: Mapping[str, float],
            sent: Mapping[str, Sequence[float]], own_bytes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The figures across hosts of one workload: wire bound, and per method its multiple of it and its bytes.

    Args:
        hosts: the run's layout.
        nbytes: the gradient bytes (uncompressed) of one call.
        link_rate: each host's link rate in bits per second, or None when not given.
        medians_ms: each method's median time per call.
        sent: each method's bytes per call, host by host (:meth:`NicMeter.per_call`).
        own_bytes: the bytes a compressed method hands to MPI per call, by method.

    Returns:
        ``hosts``, ``ranks_per_host``, ``gradient_bytes``, ``ring_bytes``,
        ``link_rate_bps``, ``wire_bound_ms`` (None without a rate) and
        ``methods``: per method ``median_ms``, ``x_wire``, ``host_bytes``,
        ``busiest_bytes``, ``x_ring`` and, with its own wire bytes,
        ``own_wire_bytes`` and ``x_own`` (None where not measured or not defined).
    """
    ring = ring_bytes(nbytes, hosts.count)
    bound = wire_bound_seconds(nbytes, hosts.count, link_rate) * 1e3 if link_rate else None
    own_bytes = own_bytes or {}
    methods: dict[str, Any] = {}
    for name, median in medians_ms.items():
        per_host = list(sent.get(name, []))
        busiest = max(per_host) if per_host else None
        own = own_bytes.get(name)
        own_ring = ring_bytes(own, hosts.count) if own is not None else None
        methods[name] = {
            "median_ms": median,
            "x_wire": median / bound if bound else None,
            "host_bytes": per_host or None,
            "busiest_bytes": busiest,
            "x_ring": busiest / ring if busiest is not None and ring > 0 else None,
            "own_wire_bytes": own,
            "x_own": busiest / own_ring if busiest is not None and own_ring else None,
        }
    return {"hosts": hosts.count, "ranks_per_host": list(hosts.ranks_per_host), "gradient_bytes": nbytes,
            "ring_bytes": ring, "link_rate_bps": link_rate, "wire_bound_ms": bound, "methods": methods}


def _cell(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_lines(fig: Mapping[str, Any]) -> list[str]:
    """The table across hosts that a benchmark prints under its own (from :func:`figures`)."""
    h = fig["hosts"]
    layout = f"{h} host{'s' if h != 1 else ''} x {'/'.join(map(str, sorted(set(fig['ranks_per_host']))))} ranks"
    rate = fig["link_rate_bps"]
    if h == 1:
        bound = ("wire bound 0" if rate else "no --link-rate") + ": one host, nothing crosses a link"
        return [f"  across hosts ({layout}{', ' + format_rate(rate) if rate else ''}): {bound}; "
                "no NIC bytes counted"]
    head = (f"  across hosts ({layout}): every host sends at least 2(H-1)/H x {bytes_label(fig['gradient_bytes'])} "
            f"= {bytes_label(int(fig['ring_bytes']))} per call (the ring optimum)")
    head += (f"; at {format_rate(rate)} the wire bound is {format_ms(fig['wire_bound_ms'])} ms" if rate
             else "; no --link-rate: no wire bound")
    lines = [head, f"  {'method':<20}{'median ms':>11}{'x wire':>9}{'sent/call':>12}{'x ring':>9}{'x own':>8}"
                   "  (sent: by the busiest host's NICs)"]
    for name, m in fig["methods"].items():
        busiest = "-" if m["busiest_bytes"] is None else bytes_label(int(m["busiest_bytes"]))
        lines.append(f"  {name:<20}{m['median_ms']:>11.2f}{_cell(m['x_wire'], '.2f', 9)}{busiest:>12}"
                     f"{_cell(m['x_ring'], '.2f', 9)}{_cell(m['x_own'], '.2f', 8)}")
    return lines
