"""Where each rank is: hosts, ranks per host, and rank 0's address, on one host or across several.

These collective tests hold in any layout. Under ``scripts/cluster.py run``
(hosts made of network namespaces) the launch's layout is known from
``CLUSTER_HOSTS`` and ``CLUSTER_PPN``, and the tests check it as well.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest
from mpi4py import MPI

from conftest import WORLD
from mpi_gradreducer import local_rank, local_size
from mpi_gradreducer._core.rendezvous import interface_addresses, tcp_rendezvous
from mpi_gradreducer._core.topology import Topology, processor_names
from mpi_gradreducer.info import collect

pytestmark = pytest.mark.mpi

LAYOUT = (int(os.environ["CLUSTER_HOSTS"]), int(os.environ["CLUSTER_PPN"])) if "CLUSTER_PPN" in os.environ else None


def test_local_rank_counts_the_ranks_with_this_processor_name():
    names = processor_names(WORLD)
    mine = [r for r, n in enumerate(names) if n == names[WORLD.Get_rank()]]
    rank = local_rank(WORLD)
    assert isinstance(rank, int) and rank == mine.index(WORLD.Get_rank())
    assert local_size(WORLD) == len(mine)
    with pytest.warns(DeprecationWarning, match="local_rank\\(\\) returns an int"):
        old_rank, old_size = rank  # the form before 0.8 still unpacks
    assert (old_rank, old_size) == (mine.index(WORLD.Get_rank()), len(mine))


@pytest.mark.skipif(LAYOUT is None, reason="not launched by scripts/cluster.py")
def test_the_cluster_layout_is_seen():
    hosts, ppn = LAYOUT  # type: ignore[misc]
    if WORLD.Get_size() != hosts * ppn:
        pytest.skip("a communicator other than the whole launch")  # the same on every rank
    assert len(set(processor_names(WORLD))) == hosts
    assert (local_rank(WORLD), local_size(WORLD)) == (WORLD.Get_rank() % ppn, ppn)
    facts = collect(WORLD)
    assert sorted(facts["hosts"].values()) == [list(range(h * ppn, (h + 1) * ppn)) for h in range(hosts)]


def test_info_groups_the_ranks_by_host():
    """Each rank's host is told by the kernel's host name here (not MPI's processor name nor its shared-memory
    split, from which ``info`` works it out): the ranks grouped so, and the shared-memory nodes counted so."""
    facts = collect(WORLD)
    groups: dict[str, list[int]] = {}
    for rank, name in enumerate(WORLD.allgather(socket.gethostname())):
        groups.setdefault(name, []).append(rank)
    assert sorted(facts["hosts"].values()) == sorted(groups.values()), (facts["hosts"], groups)
    assert facts["nodes"] == len(groups) and sorted(facts["ranks_per_node"]) == sorted(map(len, groups.values()))


@pytest.mark.mpi(min_size=2)
def test_rendezvous_address_is_reached_by_every_rank():
    """Rank 0 listens where ``tcp_rendezvous`` says; every other rank connects and reads a byte."""
    meet = tcp_rendezvous(WORLD)
    assert WORLD.allgather((meet.address, meet.port)) == [(meet.address, meet.port)] * WORLD.Get_size()
    one_host = len(set(processor_names(WORLD))) == 1
    assert ipaddress.ip_address(meet.address).is_loopback == one_host, meet
    assert meet.interface in interface_addresses(), meet
    problem = ""
    if WORLD.Get_rank() == 0:
        try:
            server = socket.create_server((meet.address, meet.port))
            server.settimeout(20)
        except OSError as exc:
            problem = f"rank 0 cannot listen: {exc!r}"
        listening = WORLD.bcast(not problem, root=0)
        if listening:
            with server:
                try:
                    for _ in range(WORLD.Get_size() - 1):
                        peer, _ = server.accept()
                        with peer:
                            peer.sendall(b"!")
                except OSError as exc:
                    problem = f"rank 0: {exc!r}"
    elif WORLD.bcast(None, root=0):
        try:
            with socket.create_connection((meet.address, meet.port), timeout=20) as conn:
                conn.settimeout(20)
                if conn.recv(1) != b"!":
                    problem = f"rank {WORLD.Get_rank()}: no byte from rank 0"
        except OSError as exc:
            problem = f"rank {WORLD.Get_rank()}: {exc!r}"
    problems = [p for p in WORLD.allgather(problem) if p]
    assert not problems, problems


def test_rendezvous_on_one_rank_is_loopback():
    meet = tcp_rendezvous(MPI.COMM_SELF)
    assert meet.address == "127.0.0.1" and meet.port > 0 and meet.url == f"tcp://127.0.0.1:{meet.port}"


def test_topology_matches_the_launch():
    """Hosts, local and cross ranks against what the launch made: one machine, or the cluster's hosts x ppn."""
    topo = Topology.of(WORLD)
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    if LAYOUT is not None and size == LAYOUT[0] * LAYOUT[1]:
        ppn = LAYOUT[1]
        expected = tuple(r // ppn for r in range(size))  # cluster.py places ranks host by host
    else:
        expected = (0,) * size  # one machine: every rank shares its memory
    assert topo.host_of == expected
    assert (topo.hosts, topo.host, topo.local_rank) == (max(expected) + 1, expected[rank],
                                                       expected[:rank].count(expected[rank]))
    assert topo.ranks_per_host == (size // topo.hosts if size % topo.hosts == 0 else None)


@pytest.mark.mpi(min_size=2)
def test_topology_split_gives_the_host_and_the_cross_communicators():
    topo = Topology.of(WORLD)
    node, cross = topo.split(WORLD)
    try:
        members = node.allgather(WORLD.Get_rank())
        assert members == topo.ranks_on(topo.host)  # in rank order
        hosts = cross.allgather(topo.host)
        assert hosts == sorted(hosts) and len(set(hosts)) == len(hosts)  # one rank per host, in host order
        assert cross.allgather(topo.local_rank) == [topo.local_rank] * cross.Get_size()
        named = Topology.named(topo.names, topo.rank)  # what a replacement computes before it joins
        assert (named.local_rank, named.local_size) == (node.Get_rank(), node.Get_size())
        assert (named.cross_rank, named.cross_size) == (cross.Get_rank(), cross.Get_size())
    finally:
        node.Free()
        cross.Free()


def test_topology_of_one_rank():
    topo = Topology.of(MPI.COMM_SELF)
    assert (topo.size, topo.hosts, topo.local_rank, topo.local_size, topo.ranks_per_host) == (1, 1, 0, 1, 1)


def test_a_topology_from_names_alone_numbers_hosts_by_their_lowest_rank():
    """What a replacement reports before it joins (``hvd.local_rank()`` and the like): the same as a split."""
    names = ["b", "a", "b", "c", "a", "b"]
    seen = [Topology.named(names, r) for r in range(len(names))]
    assert seen[0].host_of == (0, 1, 0, 2, 1, 0)
    assert [t.local_rank for t in seen] == [0, 0, 1, 0, 1, 2]
    assert [t.local_size for t in seen] == [3, 2, 3, 1, 2, 3]
    # cross: the ranks of one local rank, in host order (local rank 0: hosts b, a, c; 1: b, a; 2: b)
    assert [t.cross_rank for t in seen] == [0, 1, 0, 2, 1, 0]
    assert [t.cross_size for t in seen] == [3, 3, 2, 3, 2, 1]
