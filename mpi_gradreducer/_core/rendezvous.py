"""Where the ranks of a communicator can meet over TCP: rank 0's reachable address, and each rank's interface.

Libraries beside MPI that open their own TCP connections (torch's gloo, a
parameter server, a metrics collector) need an address of rank 0 that every
rank can reach, and the interface each rank should use for it. The host name
is no answer: on many machines it resolves to a loopback address
(Debian's ``127.0.1.1``), and on others not at all. Here rank 0 offers the
IPv4 addresses of its interfaces that are up (loopback last), every rank says
which of them it has a route to that is not loopback, and the first that
every rank can route to wins. Where all ranks share one host, it is
``127.0.0.1``.

Linux only for the interface names (``SIOCGIFADDR``); elsewhere the interface
is None and the address is the host name's.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from .topology import Topology

__all__ = ["Rendezvous", "interface_addresses", "tcp_rendezvous"]

_SIOCGIFADDR = 0x8915
#: How many of rank 0's addresses are offered to the others.
_MAX_OFFERED = 16


class Rendezvous(NamedTuple):
    """Where rank 0 listens and how this rank reaches it."""

    address: str
    """Rank 0's IPv4 address, the same on every rank."""
    port: int
    """A TCP port that was free on rank 0 when asked, the same on every rank."""
    interface: str | None
    """This rank's interface that holds its route to ``address`` (for ``GLOO_SOCKET_IFNAME``), or None."""

    @property
    def url(self) -> str:
        """``tcp://address:port``, as torch's ``init_method`` takes it."""
        return f"tcp://{self.address}:{self.port}"


def interface_addresses() -> dict[str, str]:
    """This host's interfaces that are up and have an IPv4 address: name to address (Linux; elsewhere empty)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or down
                continue
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def _source_for(address: str) -> str | None:
    """The local address this host would send from to reach ``address``, or None without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return None


def _offers() -> list[str]:
    """Rank 0's addresses worth offering: the host name's first if it is not loopback, then the interfaces'."""
    offers = []
    try:
        named = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(named).is_loopback:
            offers.append(named)
    except OSError:
        pass
    here = interface_addresses()
    offers += [a for a in here.values() if not ipaddress.ip_address(a).is_loopback and a not in offers]
    return offers[:_MAX_OFFERED]


def tcp_rendezvous(comm: MPI.Intracomm | None = None) -> Rendezvous:
    """Rank 0's address that every rank of ``comm`` can reach, a free port there, and this rank's interface.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``).

    Returns:
        The same address and port on every rank, and each rank's own interface.

    Raises:
        RuntimeError: on every rank alike, when no address of rank 0 is
            routable from every rank (the message lists what rank 0 offered).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if Topology.of(comm).hosts == 1:
        address = "127.0.0.1"
    else:
        offers = comm.bcast(_offers() if comm.Get_rank() == 0 else None, root=0)
        routable = np.zeros(_MAX_OFFERED, dtype=np.int32)
        for i, offer in enumerate(offers):
            source = _source_for(offer)
            routable[i] = source is not None and not ipaddress.ip_address(source).is_loopback
        if comm.Get_rank() == 0:
            routable[: len(offers)] = 1  # rank 0 reaches itself over whichever it offered
        comm.Allreduce(MPI.IN_PLACE, routable, op=MPI.MIN)
        usable = [offer for i, offer in enumerate(offers) if routable[i]]
        if not usable:
            raise RuntimeError(f"tcp_rendezvous: no address of rank 0 is routable from every rank; rank 0 offered "
                               f"{offers or 'none (no interface up besides loopback)'}")
        address = usable[0]
    port = 0
    if comm.Get_rank() == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    source = address if comm.Get_rank() == 0 else _source_for(address)
    interface = next((name for name, a in interface_addresses().items() if a == source), None)
    return Rendezvous(address, port, interface)
