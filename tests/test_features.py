"""Row-sparse gradients, skip, wire compression and non-finite detection, through the reducer."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks, everywhere, rank_value
from mpi_gradreducer import DistributedGradReducer, RowSparse

pytestmark = pytest.mark.mpi

VOCAB, DIM = 50, 8


def _gather_f64(comm, a):
    a = np.ascontiguousarray(a, dtype=np.float64)
    out = np.empty((comm.Get_size(),) + a.shape)
    comm.Allgather(a, out)
    return out


def _rows(rank, seed):
    rng = np.random.default_rng(seed + 97 * rank)
    n = int(rng.integers(0, 6))  # row counts differ between ranks, zero included
    return rng.integers(0, VOCAB, n), rng.standard_normal((n, DIM)).astype(np.float32)


@pytest.mark.parametrize("mean, degree", [(True, None), (False, None), (True, 3)])
@pytest.mark.parametrize("coalesce", [False, True])
def test_row_sparse_and_dense_gradients_together(mean, degree, coalesce):
    params = [np.zeros((4, 3), np.float32), np.zeros((VOCAB, DIM), np.float32), np.zeros(6, np.float64)]
    factor = (1.0 / (degree or WORLD.Get_size())) if mean else 1.0
    with DistributedGradReducer(params, mean=mean, degree=degree, coalesce=coalesce) as reducer:
        for seed in range(2):
            idx, val = _rows(WORLD.Get_rank(), seed)
            rs = RowSparse(idx, val, (VOCAB, DIM))
            dense_in = rs.to_dense()
            grads = [np.full((4, 3), rank_value(WORLD, 1.0), np.float32), rs,
                     np.full(6, rank_value(WORLD, 2.0))]
            out = reducer(grads)
            assert out is grads and isinstance(grads[1], RowSparse) and grads[1] is not rs
            expected = _gather_f64(WORLD, dense_in).sum(axis=0) * factor
            np.testing.assert_allclose(grads[1].to_dense(), expected, rtol=1e-5, atol=1e-6)
            if coalesce:
                assert np.all(np.diff(grads[1].indices) > 0)
            total = WORLD.Get_size() * (WORLD.Get_size() - 1) / 2
            np.testing.assert_allclose(grads[0], (total + WORLD.Get_size()) * factor, rtol=1e-6)
            np.testing.assert_allclose(grads[2], (total + 2 * WORLD.Get_size()) * factor, rtol=1e-12)
            assert_same_on_all_ranks(WORLD, [grads[0], grads[2], grads[1].indices, grads[1].values])


def test_sparse_member_of_a_fused_bucket_and_skip():
    params = [np.zeros(5, np.float32), np.zeros((VOCAB, DIM), np.float32), np.zeros(7, np.float32),
              np.zeros(3, np.float32)]
    with DistributedGradReducer(params, skip=[False, False, False, True]) as reducer:
        assert any(1 in b.indices and len(b.indices) > 1 for b in reducer.buckets)
        idx, val = _rows(WORLD.Get_rank(), 5)
        grads = [np.full(5, rank_value(WORLD), np.float32), RowSparse(idx, val, (VOCAB, DIM)),
                 np.full(7, rank_value(WORLD), np.float32), np.full(3, rank_value(WORLD), np.float32)]
        reducer(grads)
        mean = (WORLD.Get_size() - 1) / 2
        np.testing.assert_allclose(grads[0], mean)
        np.testing.assert_allclose(grads[2], mean)
        np.testing.assert_array_equal(grads[3], rank_value(WORLD))  # skipped: untouched
        # The same reducer also takes a dense gradient at that position.
        grads[1] = np.full((VOCAB, DIM), rank_value(WORLD), np.float32)
        reducer(grads)
        np.testing.assert_allclose(grads[1], mean)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("mean", [True, False])
def test_compressed_reduction_matches_the_reference_within_wire_precision(name, mean):
    if not everywhere(importlib.util.find_spec("ml_dtypes") is not None):
        pytest.skip("needs ml_dtypes on every rank")  # decided by every rank alike: collectives follow
    shapes = [(300, 1024), (17,), (64, 64), (5,)]
    params = [np.zeros(s, np.float32) for s in shapes] + [np.zeros(4, np.complex64), np.zeros(3, np.float16)]
    with DistributedGradReducer(params, mean=mean, compression=name) as reducer:
        rng = np.random.default_rng(WORLD.Get_rank())
        for call in range(2):
            grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            grads += [np.full(4, rank_value(WORLD) + 1j, np.complex64), np.full(3, rank_value(WORLD), np.float16)]
            inputs = [_gather_f64(WORLD, g) for g in grads[:4]]
            reducer(grads)
            # float32 as 16 bits (in the buckets, or in two levels only across hosts); the rest as it is
            assert reducer.stats.bytes == (call + 1) * (2 * sum(int(np.prod(s)) for s in shapes) + 4 * 8 + 3 * 2)
            factor = 1.0 / WORLD.Get_size() if mean else 1.0
            eps = 2.0 ** -10 if name == "fp16" else 2.0 ** -7
            for g, x in zip(grads[:4], inputs, strict=True):
                ref = x.sum(axis=0) * factor
                scale = np.abs(x).sum(axis=0) * factor + 1e-6
                assert np.all(np.abs(g - ref) <= 4 * eps * scale), f"error beyond {name}'s precision"
            mean_rank = (WORLD.Get_size() - 1) / 2
            total = mean_rank if mean else mean_rank * WORLD.Get_size()
            np.testing.assert_allclose(grads[4], total + (1j if mean else WORLD.Get_size() * 1j), rtol=1e-6)
            np.testing.assert_allclose(grads[5].astype(np.float32), total, rtol=1e-3)
            assert_same_on_all_ranks(WORLD, grads)


def test_fp16_predivide_keeps_large_sums_finite():
    params = [np.zeros(1000, np.float32)]
    with DistributedGradReducer(params, mean=True, compression="fp16", check_finite=True) as reducer:
        grads = [np.full(1000, 40000.0, np.float32)]  # a sum of several such overflows float16
        reducer(grads)
        assert not reducer.nonfinite
        np.testing.assert_allclose(grads[0], 40000.0, rtol=2 ** -10)
    if WORLD.Get_size() >= 2:
        with DistributedGradReducer(params, mean=False, compression="fp16", predivide=1.0, check_finite=True) as r:
            grads = [np.full(1000, 40000.0, np.float32)]
            r(grads)
            assert r.nonfinite and np.isinf(grads[0]).all()


@pytest.mark.parametrize("where", ["dense", "sparse", "compressed"])
def test_nonfinite_on_one_rank_is_seen_by_every_rank(where):
    last = WORLD.Get_size() - 1
    params = [np.zeros(10, np.float32), np.zeros((VOCAB, DIM), np.float32)]
    kwargs = {"compression": "fp16"} if where == "compressed" else {}
    with DistributedGradReducer(params, check_finite=True, **kwargs) as reducer:
        for poisoned in (False, True):
            dense = np.ones(10, np.float32)
            rs = RowSparse(np.array([1, 2]), np.ones((2, DIM), np.float32), (VOCAB, DIM))
            if poisoned and WORLD.Get_rank() == last:
                if where == "sparse":
                    rs.values[1, 3] = np.nan
                else:
                    dense[4] = np.inf
            reducer([dense, rs])
            flag = np.array([int(reducer.nonfinite)], dtype=np.int64)
            flags = np.zeros(WORLD.Get_size(), dtype=np.int64)
            WORLD.Allgather(flag, flags)
            assert flags.tolist() == [int(poisoned)] * WORLD.Get_size()


def test_bad_row_sparse_on_one_rank_raises_everywhere_untouched():
    last = WORLD.Get_size() - 1
    params = [np.zeros(4, np.float32), np.zeros((VOCAB, DIM), np.float32)]
    with DistributedGradReducer(params) as reducer:
        for bad, pattern, cls in [
            (RowSparse(np.array([VOCAB]), np.ones((1, DIM), np.float32), (VOCAB, DIM), validate=False),
             r"grads\[1\]: indices: expected row numbers in \[0, 50\)", ValueError),
            (RowSparse(np.array([1.0]), np.ones((1, DIM), np.float32), (VOCAB, DIM), validate=False),
             r"grads\[1\]: indices: expected an integer", TypeError),
            (RowSparse(np.array([1]), np.ones((1, DIM), np.float32), (VOCAB + 1, DIM)),
             r"grads\[1\]: expected a RowSparse of dense_shape \(50, 8\)", ValueError),
        ]:
            dense = np.full(4, rank_value(WORLD), np.float32)
            good = RowSparse(np.array([1]), np.ones((1, DIM), np.float32), (VOCAB, DIM))
            grads = [dense, bad if WORLD.Get_rank() == last else good]
            with pytest.raises(cls, match=pattern):
                reducer(grads)
            np.testing.assert_array_equal(dense, rank_value(WORLD))
            assert grads[1] is (bad if WORLD.Get_rank() == last else good)


@pytest.mark.mpi(min_size=2)
def test_sparse_on_one_rank_dense_on_another_is_an_error_everywhere():
    params = [np.zeros((VOCAB, DIM), np.float32)]
    with DistributedGradReducer(params) as reducer:
        g = (RowSparse(np.array([1]), np.ones((1, DIM), np.float32), (VOCAB, DIM)) if WORLD.Get_rank() == 0
             else np.zeros((VOCAB, DIM), np.float32))
        with pytest.raises(ValueError, match="differently structured"):
            reducer([g])


def test_row_sparse_needs_a_list_and_unknown_compression_is_named():
    params = [np.zeros((VOCAB, DIM), np.float32)]
    with DistributedGradReducer(params) as reducer:
        with pytest.raises(TypeError, match="grads must be a list, got tuple"):
            reducer((RowSparse(np.array([1]), np.ones((1, DIM), np.float32), (VOCAB, DIM)),))
    with pytest.raises(ValueError, match=r"compression: expected None or one of 'fp16', 'bf16', got 'fp8'"):
        DistributedGradReducer(params, compression="fp8")
    with pytest.raises(ValueError, match=r"predivide: only applies with compression"):
        DistributedGradReducer(params, predivide=2.0)
