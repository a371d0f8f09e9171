"""Results that do not depend on how a call is made, and ``deterministic=True``.

Random float data (integer-valued data would sum exactly in any order and could not show a difference).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer import DistributedGradReducer

#: A large first tensor (its head rides with the call header, the rest is a mean of large chunks),
#: small ones that are fused, and a second large one.
SHAPES = [(300, 300), (1000,), (64, 64), (5,), (17, 3), (128, 512), (33,)]


def _data(comm: MPI.Comm, dtype, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1000 * comm.Get_rank())
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def _fill(reducer: DistributedGradReducer, data: list[np.ndarray], views: bool) -> list[np.ndarray]:
    grads = reducer.allocate_grads() if views else [np.empty_like(d) for d in data]
    for g, d in zip(grads, data, strict=True):
        g[...] = d
    return grads


def _every_way(reducer: DistributedGradReducer, comm: MPI.Comm, data: list[np.ndarray], views: bool):
    """The results of a blocking call, reduce_async, and begin with a different order of ready on every rank."""
    grads = _fill(reducer, data, views)
    yield "blocking", reducer(grads)
    grads = _fill(reducer, data, views)
    yield "reduce_async", reducer.reduce_async(grads).wait()
    for trial in range(2):
        grads = _fill(reducer, data, views)
        step = reducer.begin(grads)
        for i in np.random.default_rng(trial + 10 * comm.Get_rank()).permutation(len(SHAPES)):
            step.ready(int(i))
        yield f"begin (order {trial})", step.wait()


def _assert_bitwise(expected, got, what: str) -> None:
    bad = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e.tobytes() != g.tobytes()]
    assert not bad, f"{what}: grads{bad} differ (largest difference " \
                    f"{max(float(np.abs(expected[i] - got[i]).max()) for i in bad):.3g})"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("views", [False, True], ids=["arrays", "views"])
@pytest.mark.parametrize("bucket_bytes", [64 << 10, 25 << 20])
def test_every_way_of_calling_gives_the_same_bits(views, bucket_bytes, compression):
    data = _data(WORLD, np.float32)
    expected = None
    for progress in ("thread", "deferred"):
        with DistributedGradReducer([np.zeros(s, np.float32) for s in SHAPES], bucket_bytes=bucket_bytes,
                                    progress=progress, compression=compression) as reducer:
            for how, got in _every_way(reducer, WORLD, data, views):
                got = [g.copy() for g in got]
                if expected is None:
                    expected = got
                    assert_same_on_all_ranks(WORLD, got)
                _assert_bitwise(expected, got, f"{how}, progress={progress!r}")


def _rank_order_mean(comm: MPI.Comm, data: list[np.ndarray]) -> list[np.ndarray]:
    every = comm.allgather(data)
    out = []
    for i in range(len(data)):
        acc = every[0][i] + every[1][i] if comm.Get_size() > 1 else every[0][i].copy()
        for r in range(2, comm.Get_size()):
            acc = acc + every[r][i]
        out.append(acc * (1.0 / comm.Get_size()))
    return out


#: Configurations that change buckets, chunks and fusion, and so (by default) the order of the sums.
CONFIGS = [
    dict(bucket_bytes=16 << 10),
    dict(bucket_bytes=1 << 20),
    dict(bucket_bytes="auto"),
    dict(fusion=[1, 2, 1, 2, 1, 0, 2]),
    dict(split_indices=[2, 4]),
]


@pytest.fixture(params=["world", "pairs"])
def group(request):
    """The world, and the world cut into pairs of neighbours (with an odd size, the last rank alone).

    Every rank is in a group, so every rank runs every case: no rank skips what the others run.
    """
    if request.param == "world":
        yield WORLD
        return
    pair = WORLD.Split(WORLD.Get_rank() // 2, WORLD.Get_rank())
    yield pair
    pair.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_deterministic_is_the_rank_order_sum_whatever_the_configuration(group, dtype):
    dtype = np.dtype(dtype)
    data = _data(group, dtype, seed=3)
    expected = _rank_order_mean(group, data)
    for config in CONFIGS:
        with DistributedGradReducer([np.zeros(s, dtype) for s in SHAPES], group=group, deterministic=True,
                                    progress="thread", **config) as reducer:
            for views in (False, True):
                for how, got in _every_way(reducer, group, data, views):
                    _assert_bitwise(expected, got, f"{config}, {'views' if views else 'arrays'}, {how}")


@pytest.mark.mpi(min_size=2)
def test_deterministic_half_precision_sums_in_float32_in_rank_order():
    data = [d.astype(np.float16) for d in _data(WORLD, np.float32, seed=5)]
    every = WORLD.allgather(data)
    expected = []
    for i in range(len(SHAPES)):
        acc = every[0][i].astype(np.float32)
        for r in range(1, WORLD.Get_size()):
            acc = acc + every[r][i].astype(np.float32)
        expected.append((acc * np.float32(1.0 / WORLD.Get_size())).astype(np.float16))
    for bucket_bytes in (16 << 10, 25 << 20):
        with DistributedGradReducer([np.zeros(s, np.float16) for s in SHAPES], bucket_bytes=bucket_bytes,
                                    deterministic=True) as reducer:
            for views in (False, True):
                _assert_bitwise(expected, reducer(_fill(reducer, data, views)), f"bucket_bytes={bucket_bytes}")


def test_deterministic_is_checked():
    with pytest.raises(TypeError, match=r"deterministic: expected a bool, got str 'yes'"):
        DistributedGradReducer([np.zeros(3, np.float32)], group=MPI.COMM_SELF, deterministic="yes")
