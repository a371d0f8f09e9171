"""Sums in two levels across hosts: each host's ranks in rank order, then the hosts in order, whatever the chunks.

Under ``scripts/cluster.py run --hosts 2 --ppn 2`` (the suite's stage across
hosts) the reducer's communicator spans hosts with several ranks on each, and
the summers of :class:`~mpi_gradreducer._core.hosts.Hosts` have two levels; on one
host they are flat, in rank order. Either way each test computes, from every
rank's random float data, the exact bits the order must give, and the
summers must give them for every chunk size.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core.compression import get_compression
from mpi_gradreducer._core.hosts import Hosts
from mpi_gradreducer._core.topology import Topology

pytestmark = pytest.mark.mpi(min_size=2)

#: Element counts: shorter than the ranks, a gathered chunk, sliced chunks with and without a tail.
COUNTS = (3, 1000, 40_003, 300_000)


@pytest.fixture
def hosts():
    made = Hosts(WORLD, Topology.of(WORLD))
    yield made
    made.free()


def _groups(hosts: Hosts) -> list[list[int]]:
    """The world ranks to sum first, group by group, in the order the groups are then summed."""
    size = WORLD.Get_size()
    if not hosts.two_levels:
        return [list(range(size))]
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.Get_rank())
    try:
        mine = node.allgather(WORLD.Get_rank())
    finally:
        node.Free()
    every = WORLD.allgather(tuple(mine))
    return [list(g) for g in sorted(set(every))]


def _rows(n: int, dtype: type, seed: int) -> np.ndarray:
    """Every rank's random data, as a (ranks, n) array on every rank."""
    rng = np.random.default_rng([seed, WORLD.Get_rank()])
    mine = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(dtype)
    rows = np.empty((WORLD.Get_size(), n), dtype)
    WORLD.Allgather(mine, rows)
    return rows


def _in_order(values: list[np.ndarray]) -> np.ndarray:
    out = values[0].copy()
    for v in values[1:]:
        out = out + v
    return out


@pytest.mark.parametrize("n", COUNTS)
def test_ordered_sum_gives_the_bits_of_its_order(hosts: Hosts, n: int):
    rows = _rows(n, np.float32, n)
    groups = _groups(hosts)
    assert len(groups) == (hosts.count if hosts.two_levels else 1)
    scale = np.float32(0.25)
    expected = _in_order([_in_order([rows[r] for r in g]) for g in groups]) * scale
    for chunk_bytes in (64 << 10, 1 << 20):  # the bits do not depend on where the chunks begin
        summer = hosts.ordered_sum(np.float32, chunk_bytes)
        data = rows[WORLD.Get_rank()].copy()
        step = chunk_bytes // 4
        for start in range(0, n, step):
            summer(data[start : start + step], float(scale))
        np.testing.assert_array_equal(data, expected)


@pytest.mark.parametrize("n", COUNTS)
def test_slice_sum_gives_the_bits_of_its_order(hosts: Hosts, n: int):
    fp16 = get_compression("fp16")
    rows = _rows(n, np.float16, 7 + n)
    groups = _groups(hosts)
    half = np.float32(0.5)

    def level(parts: list[np.ndarray], scale: float = 1.0) -> np.ndarray:
        return (_in_order([p.astype(np.float32) for p in parts]) * np.float32(scale)).astype(np.float16)

    if len(groups) == 1:
        expected = level([rows[r] for r in groups[0]], half)
    else:
        expected = level([level([rows[r] for r in g]) for g in groups], half)
    summer = hosts.slice_sum(fp16, 256 << 10)
    data = rows[WORLD.Get_rank()].copy()
    summer.reduce(data, float(half))
    np.testing.assert_array_equal(data.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("n", COUNTS)
def test_compressed_sum_crosses_hosts_as_16_bits_in_its_order(hosts: Hosts, n: int):
    """With fp16 across hosts: each host's float32 sum, divided by the ranks and rounded to float16, summed
    across hosts in float32 and rounded again, then scaled back; on one host the plain rank-order sum."""
    rows = _rows(n, np.float32, 11 + n)
    size, scale = WORLD.Get_size(), 0.25
    groups = _groups(hosts) if hosts.two_levels or not hosts.casts_across else [[r] for r in range(size)]
    if not hosts.casts_across:
        expected = _in_order([rows[r] for r in groups[0]]) * np.float32(scale)
    else:
        wires = [(_in_order([rows[r] for r in g]) * np.float32(1.0 / size)).astype(np.float16) for g in groups]
        summed = _in_order([w.astype(np.float32) for w in wires]).astype(np.float16)
        expected = summed.astype(np.float32) * np.float32(size * scale)
    for chunk_bytes in (64 << 10, 1 << 20):  # the bits do not depend on where the chunks begin
        summer = hosts.ordered_sum(np.float32, chunk_bytes, compression=get_compression("fp16"))
        data = rows[WORLD.Get_rank()].copy()
        step = chunk_bytes // 4
        for start in range(0, n, step):
            summer(data[start : start + step], scale)
        np.testing.assert_array_equal(data, expected)


@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("views", [False, True], ids=["arrays", "views"])
def test_reducer_means_are_the_same_bits_however_called(views: bool, compression: str | None):
    """Blocking, and ``begin``/``ready``/``wait`` in reverse order: one result, on every rank (arrays or views)."""
    shapes = [(300, 1024), (7,), (900, 1024), (33, 5)]
    rng = np.random.default_rng([3, WORLD.Get_rank()])
    data = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    results = []
    with DistributedGradReducer([np.zeros(s, np.float32) for s in shapes], timeout=60,
                                compression=compression) as reducer:
        for asynchronous in (False, True):
            grads = reducer.allocate_grads() if views else [np.empty_like(d) for d in data]
            for g, d in zip(grads, data, strict=True):
                g[...] = d
            if asynchronous:
                step = reducer.begin(grads)
                for i in reversed(range(len(grads))):
                    step.ready(i)
                step.wait()
            else:
                reducer(grads)
            results.append(np.concatenate([g.ravel() for g in grads]))
    np.testing.assert_array_equal(results[0], results[1])
    assert all(np.array_equal(results[0], r) for r in WORLD.allgather(results[0])), "the ranks disagree"


@pytest.mark.parametrize("members", ["all", "first three", "even ranks"])
def test_two_levels_only_where_every_host_holds_the_same_several_ranks(members: str):
    """Decided from the processor names of the communicator's ranks: the same answer on every rank."""
    from mpi_gradreducer import create_group
    from mpi_gradreducer._core.topology import processor_names

    size = WORLD.Get_size()
    ranks = {"all": range(size), "first three": range(min(3, size)), "even ranks": range(0, size, 2)}[members]
    comm = create_group(list(ranks), WORLD)
    if comm is None:
        return  # not a member; the members' check below needs nothing of this rank
    try:
        names = processor_names(comm)
        per_host = {n: names.count(n) for n in names}
        expected = len(set(per_host.values())) == 1 and 1 < names.count(names[0]) < comm.Get_size()
        hosts = Hosts(comm, Topology.of(comm))
        assert (hosts.two_levels, hosts.count) == (expected, len(per_host))
        assert hosts.ranks_per_host == (names.count(names[0]) if len(set(per_host.values())) == 1 else None)
        hosts.free()
    finally:
        comm.Free()
