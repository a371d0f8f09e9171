"""The core reducer, over real MPI: values, dtypes, fusion, groups, in-place semantics."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks, expected_mean, rank_value
from mpi_gradreducer import DistributedGradReducer, broadcast_parameters, create_group
from mpi_gradreducer._core.dtypes import supported_dtypes

pytestmark = pytest.mark.mpi

SHAPES = [(3, 4), (17,), (), (0,), (2, 0, 3), (300, 400), (5, 1, 2)]


def _params(shapes, dtype=np.float32):
    return [np.zeros(s, dtype=dtype) for s in shapes]


def _fill(comm, params, k):
    return [np.full(p.shape, rank_value(comm, k), dtype=p.dtype) for p in params]


def _tol(dtype):
    return 1e-2 if np.dtype(dtype).itemsize <= 2 else 1e-6


@pytest.mark.parametrize("dtype", [d.name for d in supported_dtypes()])
def test_mean_of_rank_values_every_dtype(comm, dtype):
    dtype = np.dtype(dtype) if dtype != "bfloat16" else supported_dtypes()[-1]
    params = _params(SHAPES, dtype)
    with DistributedGradReducer(params, group=comm) as reducer:
        for k in (1.0, 5.0):  # twice: catches lazy-initialisation bugs
            grads = _fill(comm, params, k)
            out = reducer(grads)
            assert out is grads
            for g in grads:
                assert g.dtype == dtype
                np.testing.assert_allclose(g.astype(np.complex128), expected_mean(comm, k), rtol=_tol(dtype))
            assert_same_on_all_ranks(comm, grads)


def test_sum_and_degree_override(comm):
    params = _params([(4,), (1000, 300)])
    size = comm.Get_size()
    with DistributedGradReducer(params, mean=False, group=comm) as summed, \
            DistributedGradReducer(params, degree=2, group=comm) as halved:
        for _ in range(2):
            grads = _fill(comm, params, 1.0)
            summed(grads)
            for g in grads:
                np.testing.assert_allclose(g, size * expected_mean(comm, 1.0), rtol=1e-6)
            grads = _fill(comm, params, 1.0)
            halved(grads)
            for g in grads:
                np.testing.assert_allclose(g, size * expected_mean(comm, 1.0) / 2, rtol=1e-6)


def test_in_place_on_strided_transposed_and_nested_views(comm):
    base = np.zeros((6, 8), np.float64)
    params = [base[::2, 1::3], base.T, np.zeros((4, 5), np.float32)[:, ::2], np.zeros(()), np.zeros((0, 3))]
    with DistributedGradReducer(params, group=comm) as reducer:
        for k in (2.0, 3.0):
            storage = [np.full((6, 8), rank_value(comm, k)), np.full((6, 8), rank_value(comm, k)),
                       np.full((4, 5), rank_value(comm, k), np.float32)]
            grads = [storage[0][::2, 1::3], storage[1].T, storage[2][:, ::2], np.full((), rank_value(comm, k)),
                     np.zeros((0, 3))]
            untouched = [storage[0][1::2].copy(), storage[2][:, 1::2].copy()]
            reducer(grads)
            for g in grads:
                np.testing.assert_allclose(g, expected_mean(comm, k), rtol=1e-6)
            np.testing.assert_array_equal(storage[0][1::2], untouched[0])
            np.testing.assert_array_equal(storage[2][:, 1::2], untouched[1])


def test_fusion_ids_plan_and_values(comm):
    shapes = [(10,)] * 50
    params = _params(shapes)
    r_all = DistributedGradReducer(params, group=comm)
    r_none = DistributedGradReducer(params, fusion_type=0, group=comm)
    r_split = DistributedGradReducer(params, split_indices=[20, 35], group=comm)
    fusion = [i % 3 for i in range(50)]
    r_list = DistributedGradReducer(params, fusion=fusion, group=comm)
    try:
        assert len(r_all.buckets) == 1 and sorted(r_all.buckets[0].indices) == list(range(50))
        assert len(r_none.buckets) == 50 and all(len(b.indices) == 1 for b in r_none.buckets)
        assert sorted(sorted(b.indices) for b in r_split.buckets) == [list(range(21)), list(range(21, 36)),
                                                                      list(range(36, 50))]
        groups = {b.fusion_id: sorted(b.indices) for b in r_list.buckets if b.fusion_id != 0}
        assert groups == {1: list(range(1, 50, 3)), 2: list(range(2, 50, 3))}
        assert sum(1 for b in r_list.buckets if b.fusion_id == 0) == len(range(0, 50, 3))
        for r in (r_all, r_none, r_split, r_list):
            for k in (0.5, 1.5):
                grads = _fill(comm, params, k)
                r(grads)
                for g in grads:
                    np.testing.assert_allclose(g, expected_mean(comm, k), rtol=1e-6)
    finally:
        for r in (r_all, r_none, r_split, r_list):
            r.free()


def test_buckets_split_by_dtype_and_cap(comm):
    params = [np.zeros(1000, np.float32), np.zeros(1000, np.float64), np.zeros(1000, np.float32),
              np.zeros(1000, np.float64), np.zeros(1000, np.float32)]
    with DistributedGradReducer(params, bucket_bytes=8000, group=comm) as reducer:
        by = [(b.dtype.name, b.indices, b.nbytes) for b in reducer.buckets]
        # Backward order: parameters are visited from last to first, and the buckets ordered by the
        # member visited last (the one backward finishes last).
        assert by == [("float64", (3,), 8000), ("float32", (4, 2), 8000), ("float64", (1,), 8000),
                      ("float32", (0,), 4000)]
        grads = _fill(comm, params, 4.0)
        reducer(grads)
        for g in grads:
            np.testing.assert_allclose(g, expected_mean(comm, 4.0))


def test_large_arrays_travel_alone_and_in_place(comm):
    big = np.zeros((512, 1024), np.float32)  # 2 MiB: above the direct threshold
    params = [np.zeros(3, np.float32), big, np.zeros(5, np.float32)]
    with DistributedGradReducer(params, group=comm) as reducer:
        assert [b.indices for b in reducer.buckets] == [(1,), (2, 0)]  # the small ones wait for parameter 0
        grads = _fill(comm, params, 1.0)
        reducer(grads)
        for g in grads:
            np.testing.assert_allclose(g, expected_mean(comm, 1.0))
        # A non-contiguous large gradient still works (packed through the bucket buffer).
        grads = [np.full(3, rank_value(comm), np.float32), np.full((1024, 512), rank_value(comm), np.float32).T,
                 np.full(5, rank_value(comm), np.float32)]
        reducer(grads)
        for g in grads:
            np.testing.assert_allclose(g, expected_mean(comm))


def test_bucket_views_are_reduced_where_they_lie(comm):
    params = _params([(30,), (4, 5), (7,)])
    with DistributedGradReducer(params, group=comm) as reducer:
        grads = reducer.allocate_grads()
        (bucket,) = reducer.buckets
        for k in (1.0, 2.0):
            for g in grads:
                g[...] = rank_value(comm, k)
            reducer(grads)
            for g in grads:
                np.testing.assert_allclose(g, expected_mean(comm, k))
        assert all(np.shares_memory(g, grads[0].base) for g in grads)


def _levels(comm) -> list[int]:
    """The ranks of each level of the reducer's rank-order sums: per host, then hosts; or all ranks at once."""
    from mpi_gradreducer._core.hosts import Hosts
    from mpi_gradreducer._core.topology import Topology

    hosts = Hosts(comm, Topology.of(comm))
    try:
        return [hosts.ranks_per_host, hosts.count] if hosts.two_levels else [comm.Get_size()]  # type: ignore[list-item]
    finally:
        hosts.free()


def _chunk_bytes(comm) -> int:
    """The bytes of one collective of the reducer's sums (smaller across hosts)."""
    from mpi_gradreducer._core.hosts import Hosts
    from mpi_gradreducer._core.topology import Topology

    hosts = Hosts(comm, Topology.of(comm))
    try:
        return hosts.chunk_bytes
    finally:
        hosts.free()


def _ordered_sum_calls(n: int, levels: list[int], gathered: int) -> int:
    """The collectives an ``OrderedSum`` makes for ``n`` float32 elements, level by level (innermost first)."""
    size, outer = levels[0], levels[1:]

    def across(m: int) -> int:
        return _ordered_sum_calls(m, outer, gathered) if outer else 0

    if size == 1:
        return across(n)
    if n <= gathered or n < size:
        return 1 + across(n)
    calls = 2 + across(n // size)
    return calls + (1 + across(n % size) if n % size else 0)


def test_bucket_views_are_one_block_reduced_in_chunks_across_buckets(comm):
    from mpi_gradreducer._core.paths import HEAD_BYTES
    from mpi_gradreducer._core.transport import GATHERED_SUM_BYTES

    shapes = [(700, 1024), (3,), (300, 1024), (5, 5), (1200, 1024), (17,)]  # large and small, float32
    params = _params(shapes)
    with DistributedGradReducer(params, group=comm, mean=False) as reducer:  # a sum in rank order per chunk
        assert len(reducer.buckets) >= 4
        grads = reducer.allocate_grads()
        owners = {id(g.base) for g in grads}
        assert len(owners) == 1  # one block for the whole float32 plan
        for k in (1.0, 2.0):
            for g in grads:
                g[...] = rank_value(comm, k)
            before = reducer.stats.messages
            reducer(grads)
            total = sum(int(np.prod(s)) for s in shapes) * 4
            head = min(reducer.buckets[0].nbytes, HEAD_BYTES)  # travels with the call header
            chunk = _chunk_bytes(comm)
            rest = [min(chunk, total - head - start) for start in range(0, total - head, chunk)]
            levels = _levels(comm)
            per_chunk = [1 if comm.Get_size() == 1 else _ordered_sum_calls(n // 4, levels, GATHERED_SUM_BYTES // 4)
                         for n in rest]
            assert reducer.stats.messages - before == 1 + sum(per_chunk)
            for g in grads:
                np.testing.assert_allclose(g, comm.Get_size() * expected_mean(comm, k))


def test_even_odd_groups_average_inside_their_group():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    mine = None
    for ranks in (evens, odds):
        if ranks:
            c = create_group(ranks)
            if c is not None:
                mine = c
    assert mine is not None and mine.Get_size() == len(evens if rank % 2 == 0 else odds)
    params = _params([(5,), (2, 2)])
    with DistributedGradReducer(params, group=mine) as reducer:
        assert reducer.degree == mine.Get_size()
        for _ in range(2):
            grads = [np.full(p.shape, float(rank), np.float32) for p in params]
            reducer(grads)
            members = evens if rank % 2 == 0 else odds
            for g in grads:
                np.testing.assert_allclose(g, np.mean(members))
    mine.Free()


def test_create_group_non_members_get_none():
    c = create_group([0])
    if WORLD.Get_rank() == 0:
        assert c is not None and c.Get_size() == 1
        c.Free()
    else:
        assert c is None


def test_broadcast_parameters_copies_root_values(comm):
    root = comm.Get_size() - 1
    base = np.full((4, 6), float(comm.Get_rank()))
    arrays = [np.full((3, 3), float(comm.Get_rank()), np.float32), base[:, ::2], np.full((), float(comm.Get_rank()))]
    out = broadcast_parameters(arrays, root=root, group=comm)
    assert out is arrays
    for a in arrays:
        np.testing.assert_array_equal(a, float(root))
    np.testing.assert_array_equal(base[:, 1::2], float(comm.Get_rank()))


def test_single_process_mean_is_identity():
    params = _params([(3,), (2, 2)])
    with DistributedGradReducer(params, group=MPI.COMM_SELF) as reducer:
        grads = [np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32).reshape(2, 2)]
        reducer(grads)
        np.testing.assert_array_equal(grads[0], np.arange(3))
        np.testing.assert_array_equal(grads[1], np.arange(4).reshape(2, 2))


def test_steady_state_allocates_no_large_buffers(comm):
    import tracemalloc

    params = _params([(100,)] * 20 + [(256, 1024)])
    with DistributedGradReducer(params, group=comm) as reducer:
        grads = _fill(comm, params, 1.0)
        reducer(grads)
        reducer(grads)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        reducer(grads)
        after = tracemalloc.take_snapshot()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        assert peak < 64 << 10, f"a steady-state call allocated {peak} bytes at peak"
        assert grown < 16 << 10
