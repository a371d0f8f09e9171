"""The chunked in-place transport: sums, and means by reduce-scatter + allgather."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer import transport

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64"])
@pytest.mark.parametrize("count", [1, 7, 65536, 65536 * 3 + 5, 1 << 20])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1.0 / 3.0])
def test_chunked_sum_and_mean_match_a_reference(dtype, count, scale):
    rng = np.random.default_rng(1234 + WORLD.Get_rank())
    mine = rng.integers(-8, 8, count).astype(dtype)
    everyone = np.empty((WORLD.Get_size(), count), dtype=dtype)
    WORLD.Allgather(mine, everyone)
    expected = everyone.astype(np.complex128).sum(axis=0) * scale
    buf = mine.copy()
    seen = []
    calls = transport.allreduce(WORLD, buf, scale, chunk_bytes=1 << 20, after=lambda c: seen.append(c.shape[0]))
    assert sum(seen) == count and calls >= len(seen)
    tol = 1e-6 if np.dtype(dtype).itemsize <= 8 and dtype != "float64" else 1e-12
    np.testing.assert_allclose(buf.astype(np.complex128), expected, rtol=tol, atol=tol)
    assert_same_on_all_ranks(WORLD, [buf])


def test_large_means_take_the_reduce_scatter_path():
    buf = np.ones(WORLD.Get_size() * (transport.SPLIT_MEAN_BYTES // 4), np.float32)  # divisible by size
    calls = transport.allreduce(WORLD, buf, 0.5, chunk_bytes=buf.nbytes)
    assert calls == (2 if WORLD.Get_size() > 1 else 1)
    np.testing.assert_array_equal(buf, WORLD.Get_size() * 0.5)
