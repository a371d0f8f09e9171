"""cupy gradients: device fusion buffers, batched kernels, CUDA-aware or staged MPI."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks, expected_mean, rank_value
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer.config import cuda_aware_default as cuda_support

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]

SHAPES = [(3, 4), (17,), (), (0,), (300, 400), (5, 1, 2), (1024, 1024)]
DTYPES = ["float16", "float32", "float64", "complex64"]


def _paths():
    return [False, True] if cuda_support()[0] else [False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_gradients_are_averaged_in_place(cupy, dtype):
    for cuda_aware in _paths():
        params = [cupy.zeros(s, dtype=dtype) for s in SHAPES]
        with DistributedGradReducer(params, cuda_aware=cuda_aware, bucket_bytes=1 << 16) as reducer:
            for k in (1.0, 3.0):
                grads = [cupy.full(s, rank_value(WORLD, k), dtype=dtype) for s in SHAPES]
                grads[4] = cupy.full((400, 300), rank_value(WORLD, k), dtype=dtype).T  # strided
                reducer(grads)
                host = [cupy.asnumpy(g) for g in grads]
                for h in host:
                    np.testing.assert_allclose(h.astype(np.complex128), expected_mean(WORLD, k),
                                               rtol=1e-2 if dtype == "float16" else 1e-6)
                assert_same_on_all_ranks(WORLD, host)


def test_mixed_host_and_device_lists_and_async(cupy):
    params = [np.zeros(10, np.float32), cupy.zeros(10, cupy.float32), cupy.zeros((256, 1024), cupy.float32),
              np.zeros((2, 3), np.float64)]
    with DistributedGradReducer(params) as reducer:
        devices = {b.device for b in reducer.buckets}
        assert "cpu" in devices and any(d.startswith("cuda:") for d in devices)
        for k in (2.0, 4.0):
            grads = [np.full(10, rank_value(WORLD, k), np.float32), cupy.full(10, rank_value(WORLD, k), cupy.float32),
                     cupy.full((256, 1024), rank_value(WORLD, k), cupy.float32),
                     np.full((2, 3), rank_value(WORLD, k))]
            reducer.reduce_async(grads).wait()
            for g in grads:
                np.testing.assert_allclose(cupy.asnumpy(g) if not isinstance(g, np.ndarray) else g,
                                           expected_mean(WORLD, k), rtol=1e-6)


def test_one_kernel_launch_per_bucket_pack_and_unpack(cupy):
    params = [cupy.zeros(100 + i, cupy.float32) for i in range(50)]
    with DistributedGradReducer(params) as reducer:
        assert len(reducer.buckets) >= 1
        grads = [cupy.full(100 + i, rank_value(WORLD, 1.0), cupy.float32) for i in range(50)]
        reducer(grads)
        launches = reducer.stats.launches
        assert launches == 2 * len(reducer.buckets)
        np.testing.assert_allclose(cupy.asnumpy(grads[7]), expected_mean(WORLD, 1.0))
