"""Bucket hooks: the seam between the buckets and the wire (PyTorch DDP's comm hooks), and fp16 as one."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer import DistributedGradReducer, GradBucket
from mpi_gradreducer._core.hooks import Cast
from mpi_gradreducer._core.wire import get_compression

pytestmark = pytest.mark.mpi

SHAPES = [(300, 1024), (7,), (64, 33), (5,), (900, 17)]


def _data(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, WORLD.Get_rank()])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _params() -> list[np.ndarray]:
    return [np.zeros(s, np.float32) for s in SHAPES]


def test_a_hook_sees_every_bucket_once_and_its_sums_are_the_reducers():
    """A hook that calls the reducer's own sum gives the reducer's bits (random data, arrays and views)."""
    seen: list[tuple[int, tuple[int, ...], int]] = []

    def passthrough(bucket: GradBucket) -> None:
        assert isinstance(bucket, GradBucket) and bucket.buffer.ndim == 1 and bucket.dtype == np.float32
        seen.append((bucket.index, tuple(bucket.indices), bucket.buffer.shape[0]))
        bucket.reduce()

    data = _data(1)
    with DistributedGradReducer(_params(), bucket_bytes=64 << 10, deterministic=True) as plain, \
            DistributedGradReducer(_params(), bucket_bytes=64 << 10, deterministic=True,
                                   hook=passthrough) as hooked:
        want = plain([d.copy() for d in data])
        for views in (False, True):
            grads = hooked.allocate_grads() if views else [np.empty_like(d) for d in data]
            for g, d in zip(grads, data, strict=True):
                g[...] = d
            seen.clear()
            got = hooked(grads)
            buckets = hooked.buckets
            assert sorted(seen) == [(k, tuple(b.indices), b.nbytes // 4) for k, b in enumerate(buckets)]
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(w, g)
        assert_same_on_all_ranks(WORLD, list(got))


def test_a_hook_sums_in_another_dtype():
    def float64_sums(bucket: GradBucket) -> None:
        wide = bucket.buffer.astype(np.float64)
        bucket.reduce(wide)
        bucket.buffer[...] = wide

    data = _data(2)
    every = [np.empty((WORLD.Get_size(), *d.shape), np.float32) for d in data]
    for e, d in zip(every, data, strict=True):
        WORLD.Allgather(d, e)
    with DistributedGradReducer(_params(), hook=float64_sums) as reducer:
        got = reducer([d.copy() for d in data])
    for e, g in zip(every, got, strict=True):
        np.testing.assert_array_equal(g, e.astype(np.float64).mean(axis=0).astype(np.float32))


def test_fp16_compression_is_the_cast_hook():
    data = _data(3)
    with DistributedGradReducer(_params(), compression="fp16") as a, \
            DistributedGradReducer(_params(), hook=Cast(get_compression("fp16"))) as b:
        x, y = a([d.copy() for d in data]), b([d.copy() for d in data])
    for u, v in zip(x, y, strict=True):
        np.testing.assert_array_equal(u, v)


def test_bad_hooks_raise_on_every_rank():
    with pytest.raises(TypeError, match=r"hook: expected a callable hook\(bucket\) or None, got int 3"):
        DistributedGradReducer(_params(), hook=3)
    with pytest.raises(ValueError, match=r"hook: not with compression='fp16'"):
        DistributedGradReducer(_params(), hook=lambda bucket: bucket.reduce(), compression="fp16")


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_hooks_fail_at_construction():
    def one(bucket: GradBucket) -> None:
        bucket.reduce()

    def other(bucket: GradBucket) -> None:
        bucket.reduce()

    hook = other if WORLD.Get_rank() == WORLD.Get_size() - 1 else one
    with pytest.raises(ValueError, match=r"option hook is .*one' at rank 0 but .*other' at rank"):
        DistributedGradReducer(_params(), hook=hook)
