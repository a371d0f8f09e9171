"""cupy gradients: device fusion buffers, batched kernels, CUDA-aware or staged MPI."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks, expected_mean, rank_value
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core.options import cuda_aware_default as cuda_support

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


def _agreed(flag: bool) -> bool:
    """True when ``flag`` holds on every rank (the same answer everywhere: no rank skips alone)."""
    from mpi4py import MPI

    value = np.array([int(bool(flag))], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
    return bool(value[0])


def _bfloat16(cupy):
    """ml_dtypes' bfloat16 when cupy makes arrays of it (cupy >= 14) on every rank, else None."""
    try:
        import ml_dtypes

        cupy.zeros(2, dtype=ml_dtypes.bfloat16).get()
        ok = True
    except Exception:  # no ml_dtypes, or a cupy without bfloat16 arrays
        ok = False
    return __import__("ml_dtypes").bfloat16 if _agreed(ok) else None


def test_bfloat16_device_gradients_are_averaged(cupy):
    bf16 = _bfloat16(cupy)
    if bf16 is None:
        pytest.skip("this cupy has no bfloat16 arrays (cupy >= 14 has)")
    shapes = [(3, 4), (17,), (300, 400)]
    params = [cupy.zeros(s, dtype=bf16) for s in shapes]
    with DistributedGradReducer(params, bucket_bytes=1 << 16) as reducer:
        for k in (1.0, 3.0):
            grads = [cupy.full(s, rank_value(WORLD, k), dtype=bf16) for s in shapes]
            reducer(grads)
            host = [g.get().astype(np.float64) for g in grads]
            for h in host:
                np.testing.assert_allclose(h, expected_mean(WORLD, k), rtol=1e-2)
            assert_same_on_all_ranks(WORLD, host)


def test_kernel_bfloat16_conversions_match_ml_dtypes(cupy):
    bf16 = _bfloat16(cupy)
    if bf16 is None:
        pytest.skip("this cupy has no bfloat16 arrays (cupy >= 14 has)")
    from mpi_gradreducer._core import backend

    bits = np.arange(1 << 16, dtype=np.uint16)
    member = cupy.asarray(bits.view(bf16))
    buf = cupy.zeros(bits.size, cupy.float32)
    backend.batched_copy([member], buf, [0], 1.0, False)
    assert np.array_equal(buf.get().view(np.uint32), bits.view(bf16).astype(np.float32).view(np.uint32))
    rng = np.random.default_rng(3)
    values = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = values[~np.isnan(values)]
    out = cupy.zeros(values.size, dtype=bf16)
    backend.batched_copy([out], cupy.asarray(values), [0], 1.0, True)
    with np.errstate(over="ignore"):
        assert np.array_equal(out.get().view(np.uint16), values.astype(bf16).view(np.uint16))


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_kernel_keeps_float32_denormals_like_the_host(cupy, scale):
    from mpi_gradreducer._core import backend

    values = np.array([1e-40, -3e-39, 1e-45, 1.1e-38, 2.5, 0.0], np.float32)
    member = cupy.asarray(values)
    buf = cupy.zeros(values.size, cupy.float32)
    backend.batched_copy([member], buf, [0], scale, False)
    want = values if scale == 1.0 else values * np.float32(scale)
    assert np.array_equal(buf.get().view(np.uint32), want.view(np.uint32))
    out = cupy.zeros_like(member)
    backend.batched_copy([out], buf, [0], scale, True)
    want = want if scale == 1.0 else want * np.float32(scale)
    assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))


def test_broadcast_parameters_copies_root_device_arrays(cupy):
    from mpi_gradreducer import broadcast_parameters

    arrays = [cupy.full((4, 5), WORLD.Get_rank(), cupy.float32), cupy.full((6, 3), WORLD.Get_rank(), cupy.float64).T,
              cupy.zeros((0,), cupy.float32)]
    root = WORLD.Get_size() - 1
    out = broadcast_parameters(arrays, root=root)
    assert out is arrays
    for a in arrays:
        assert (a.get() == root).all()


def test_device_streams_are_separate_and_events_order_them(cupy):
    from mpi_gradreducer._core import backend

    ops = backend.ops_for(f"cuda:{cupy.cuda.Device().id}")
    streams = {ops._d2h.ptr, ops._h2d.ptr, ops._work.ptr}
    assert len(streams) == 3 and cupy.cuda.get_current_stream().ptr not in streams
    caller = cupy.cuda.Stream(non_blocking=True)
    with caller:
        src = cupy.arange(1 << 20, dtype=cupy.float32)
        launched = ops.record()  # what the training thread records at launch
        with ops.own_stream():  # what the communication thread does
            assert cupy.cuda.get_current_stream().ptr == ops._work.ptr
            ops.wait_event(launched)
            ops.begin_call()
            dst = src * 2  # a "pack" on the work stream, after the caller's work
            host = ops.pinned(dst.size, np.float32)
            ops.wait(ops.to_host(dst, host))
            np.testing.assert_array_equal(host, np.arange(1 << 20, dtype=np.float32) * 2)
            host *= 2
            ops.to_device(host, dst)
            dst += 1  # an "unpack", after the upload
            done = ops.end_call()
        ops.wait_event(done)  # what wait() does on the training thread
        np.testing.assert_array_equal(dst.get(), np.arange(1 << 20, dtype=np.float32) * 4 + 1)


@pytest.mark.parametrize("progress", ["thread", "deferred"])
def test_overlapped_device_reduction_on_a_non_default_stream(cupy, progress):
    from mpi4py import MPI

    if progress == "thread" and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("needs MPI_THREAD_MULTIPLE")
    params = [cupy.zeros((256, 1024), cupy.float32), cupy.zeros(100, cupy.float32), cupy.zeros(7, cupy.float32)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with DistributedGradReducer(params, cuda_aware=False, progress=progress) as reducer, stream:
        for k in (1.0, 5.0):
            grads = [cupy.full(p.shape, rank_value(WORLD, k), cupy.float32) for p in params]
            step = reducer.begin(grads)
            for i in reversed(range(len(grads))):
                step.ready(i)
            step.wait()
            grads = [g + 0 for g in grads]  # read on the caller's stream right after wait()
            for g in grads:
                np.testing.assert_allclose(g.get(), expected_mean(WORLD, k))


def test_switching_streams_between_calls(cupy):
    params = [cupy.zeros(1000 + i, cupy.float32) for i in range(20)] + [cupy.zeros((512, 1024), cupy.float32)]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    with DistributedGradReducer(params, cuda_aware=False, bucket_bytes=1 << 14) as reducer:
        grads = [cupy.zeros_like(p) for p in params]
        for call in range(6):
            with streams[call % 3]:
                for g in grads:
                    g.fill(rank_value(WORLD, call))
                reducer(grads)
                total = float(sum(g.sum() for g in grads).get())
            assert total == pytest.approx(expected_mean(WORLD, call) * sum(p.size for p in params), rel=1e-5)


def test_cuda_aware_branches_smoke(cupy):
    """Allreduce on a device buffer and the reducer's scaling through cupy, where the MPI reads device memory."""
    from mpi4py import MPI

    aware, source = cuda_support()
    if not _agreed(bool(aware)):
        pytest.skip(f"the MPI library is not CUDA-aware on every rank (here: {aware}, from {source})")
    buf = cupy.full(1000, rank_value(WORLD, 1.0), cupy.float64)
    cupy.cuda.get_current_stream().synchronize()
    WORLD.Allreduce(MPI.IN_PLACE, buf)
    np.testing.assert_allclose(buf.get(), expected_mean(WORLD, 1.0) * WORLD.Get_size())
    params = [cupy.zeros((300, 1024), cupy.float32), cupy.zeros(10, cupy.complex64), cupy.zeros(5, cupy.float16)]
    with DistributedGradReducer(params, cuda_aware=True) as reducer:
        assert reducer.cuda_aware
        grads = [cupy.full(p.shape, rank_value(WORLD, 2.0), p.dtype) for p in params]
        reducer(grads)
        for g in grads:
            np.testing.assert_allclose(g.get().astype(np.complex128), expected_mean(WORLD, 2.0), rtol=1e-3)
