"""16-bit wire compression: names, casts, the float32-summing op, and the collective sums.

References are independent of the code under test: every rank rebuilds every
rank's input from its seed and sums in float64.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks, everywhere
from mpi_gradreducer._core.halves import SliceSum, compressed_allreduce
from mpi_gradreducer._core.wire import COMPRESSIONS, Compression, get_compression, pack, unpack

pytestmark = pytest.mark.mpi

METHODS = ["alltoall", "allreduce"]
#: Unit roundoff of each wire format.
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}


@pytest.fixture(params=COMPRESSIONS)
def comp(request: pytest.FixtureRequest):
    c = get_compression(request.param)
    yield c
    c.free()


def _inputs(comm: MPI.Comm, n: int, seed: int, dtype=np.float32) -> list[np.ndarray]:
    """Every rank's input (rank r's is element r), rebuilt on each rank."""
    return [np.random.default_rng([seed, r]).standard_normal(n).astype(dtype) for r in range(comm.Get_size())]


# -- choosing a compression ---------------------------------------------------------------


def test_names():
    assert get_compression(None) is None
    fp16, bf16 = get_compression("fp16"), get_compression("bf16")
    assert isinstance(fp16, Compression) and fp16.name == "fp16" and fp16.wire_dtype == np.float16
    assert bf16.name == "bf16" and bf16.wire_dtype.name == "bfloat16" and bf16.wire_dtype.itemsize == 2
    assert get_compression("fp16") is not fp16  # no shared state between instances
    assert "fp16" in repr(fp16)


@pytest.mark.parametrize("name", ["fp32", "FP16", "float16", "", 16])
def test_unknown_name(name):
    with pytest.raises(ValueError, match=r"compression: expected None or one of 'fp16', 'bf16', got"):
        get_compression(name)


def test_bf16_without_ml_dtypes(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes "import ml_dtypes" fail
    with pytest.raises(ImportError, match=r"compression='bf16' needs the ml_dtypes package"):
        get_compression("bf16")
    assert get_compression("fp16").wire_dtype == np.float16


def test_applies_to(comp):
    assert comp.applies_to(np.float32) and comp.applies_to(np.dtype("float64"))
    for other in (np.float16, comp.wire_dtype, np.complex64, np.complex128, np.int32, np.bool_, "not a dtype"):
        assert not comp.applies_to(other)


def test_scales(comp):
    f = 4.0 if comp.name == "fp16" else 1.0
    assert comp.default_predivide(4) == f
    assert comp.scales(4, 4, mean=True) == (1 / f, f / 4)
    assert comp.scales(4, 2, mean=False) == (1 / f, f)
    assert comp.scales(4, 8, mean=True, predivide=2) == (0.5, 0.25)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="predivide: expected a positive finite number"):
            comp.scales(4, 4, predivide=bad)


def test_op_lifecycle():
    c = get_compression("fp16")
    op = c.op()
    assert c.op() is op and op != MPI.OP_NULL
    c.free()
    c.free()  # idempotent
    assert op == MPI.OP_NULL
    # mpi4py allows a few dozen live user-defined ops: freeing makes room again.
    for _ in range(80):
        c = get_compression("bf16")
        c.op()
        c.free()
    assert c.mpi_datatype().Get_size() == 2


# -- local casts and the op -------------------------------------------------------------------


@pytest.mark.parametrize("src_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("prescale", [1.0, 0.25, 1 / 3])
def test_pack_unpack_match_numpy(comp, src_dtype, prescale):
    x = np.random.default_rng(1).standard_normal((6, 10)).astype(src_dtype) * 100
    src = x[:, ::2]  # strided
    wire = np.empty(src.size, comp.wire_dtype)
    pack(src, wire, prescale)
    expected = (src * src_dtype(prescale)).astype(comp.wire_dtype)
    np.testing.assert_array_equal(wire.view(np.uint16), expected.reshape(-1).view(np.uint16))
    dst = np.zeros((6, 10), src_dtype)[:, 1::2]
    unpack(wire, dst, 3.0)
    np.testing.assert_array_equal(dst, expected.astype(src_dtype) * src_dtype(3.0))
    shaped = np.empty(src.shape, comp.wire_dtype)  # a wire view of the source's shape works too
    pack(src, shaped, prescale)
    np.testing.assert_array_equal(shaped.view(np.uint16), expected.view(np.uint16))


def test_pack_overflow_is_inf_without_warning():
    c = get_compression("fp16")
    wire = np.empty(3, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack(np.array([1e5, -1e6, 1.0], np.float32), wire)
        assert np.isposinf(wire[0]) and np.isneginf(wire[1]) and wire[2] == 1
        pack(np.array([1e5, -1e6, 1.0], np.float32), wire, 0.25)  # 25000 fits, -250000 does not
        assert wire[0] == 25000 and np.isneginf(wire[1])
    c.free()


def test_op_adds_in_float32_and_rounds_once(comp):
    rng = np.random.default_rng(2)
    a = np.concatenate([rng.uniform(-3000, 3000, 4000), [2048, 60000, -65504, 1.5, 0.0]]).astype(comp.wire_dtype)
    b = np.concatenate([rng.uniform(-3000, 3000, 4000), [1, 10000, -65504, 2.0**-20, -0.0]]).astype(comp.wire_dtype)
    with np.errstate(over="ignore"):
        expected = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float32).astype(comp.wire_dtype)
    out = b.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp.op().Reduce_local([a, comp.mpi_datatype()], [out, comp.mpi_datatype()])
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
    swapped = a.copy()
    comp.op().Reduce_local([b, comp.mpi_datatype()], [swapped, comp.mpi_datatype()])
    np.testing.assert_array_equal(swapped.view(np.uint16), out.view(np.uint16))  # commutative, bit for bit
    if comp.name == "fp16":
        assert np.isposinf(out[-4]) and np.isneginf(out[-3])  # beyond 65504: inf, as float16 arithmetic gives


# -- across ranks -----------------------------------------------------------------------------


def test_alltoall_sum_is_the_correctly_rounded_sum(comm):
    """Every element is float16(exact sum): better than float16 accumulation, whatever the order."""
    size, rank = comm.Get_size(), comm.Get_rank()
    comp = get_compression("fp16")
    n = 3001
    # Values on a 1/1024 grid in [1, 2048): any sum of a few of them is exact in float32.
    everyone = [
        (np.random.default_rng([5, r]).integers(1024, 2048 * 1024, n) / 1024).astype(np.float16)
        for r in range(size)
    ]
    everyone[0][:3] = [2048, 2047, 1024]
    for r in range(1, size):
        everyone[r][:3] = [1, 1, 0.5]
    exact = np.sum([e.astype(np.float64) for e in everyone], axis=0)
    expected = exact.astype(np.float16)
    naive = everyone[0].copy()
    for e in everyone[1:]:
        naive = naive + e  # float16 arithmetic, rounding after every addition
    for chunk_bytes, m in ((1 << 20, n), (998, n), (6, 50)):  # also chunks with fewer elements than ranks
        wire = everyone[rank][:m].copy()
        compressed_allreduce(comm, wire, comp, chunk_bytes)
        np.testing.assert_array_equal(wire.view(np.uint16), expected[:m].view(np.uint16))
        assert_same_on_all_ranks(comm, [wire])
    if size >= 3:  # with two ranks, float16 accumulation rounds only once too
        assert wire[0] == np.float16(2048 + size - 1) != 2048 == naive[0]
        assert np.count_nonzero(naive != expected) > n // 10  # the test has teeth
    comp.free()


def test_alltoall_sum_is_the_rank_order_float32_sum_scaled_and_rounded_once(comm, comp):
    """Random data, bit for bit: ``wire(((g0 + g1) + g2 ...) * scale)`` in float32, whatever the chunking.

    Chunks of equal slices, with a remainder of fewer elements than ranks, and shorter than the ranks.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    n, scale = 3001, 1.0 / (size + 1)
    everyone = [e.astype(comp.wire_dtype) for e in _inputs(comm, n, seed=23)]
    total = everyone[0].astype(np.float32)
    for e in everyone[1:]:
        total = total + e.astype(np.float32)  # float32, rank order
    expected = (total * np.float32(scale)).astype(comp.wire_dtype)
    for chunk_bytes in (1 << 20, 998, max(2, 2 * size - 2)):
        wire = everyone[rank].copy()
        compressed_allreduce(comm, wire, comp, chunk_bytes, scale=scale)
        np.testing.assert_array_equal(wire.view(np.uint16), expected.view(np.uint16), err_msg=f"{chunk_bytes}")
        assert_same_on_all_ranks(comm, [wire])


def test_allreduce_method_error_bound(comm, comp):
    """With the op, each level of MPI's reduction tree rounds: error within (size - 1) roundings."""
    size, rank = comm.Get_size(), comm.Get_rank()
    everyone = [x.astype(comp.wire_dtype) for x in _inputs(comm, 5000, seed=3)]
    exact = np.sum([e.astype(np.float64) for e in everyone], axis=0)
    magnitude = np.sum([np.abs(e.astype(np.float64)) for e in everyone], axis=0)
    wire = everyone[rank].copy()
    compressed_allreduce(comm, wire, comp, 4000, method="allreduce")
    bound = size * UNIT[comp.name] * magnitude
    assert np.all(np.abs(wire.astype(np.float64) - exact) <= bound)
    assert_same_on_all_ranks(comm, [wire])


def pack_sum_unpack(comm, grad, comp, prescale=1.0, postscale=1.0, chunk_bytes=1 << 20, *, method="alltoall"):
    """What the reducer's compressed path does to one gradient: pack, compressed sum, unpack."""
    wire = np.empty(grad.size, comp.wire_dtype)
    pack(grad, wire, prescale)
    compressed_allreduce(comm, wire, comp, chunk_bytes, method=method)
    unpack(wire, grad, postscale)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("src_dtype", [np.float32, np.float64])
def test_compressed_reduction_against_float64(comm, comp, method, mean, src_dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    degree = 3
    everyone = _inputs(comm, 20001, seed=11, dtype=src_dtype)
    exact = np.sum([e.astype(np.float64) for e in everyone], axis=0) / (degree if mean else 1)
    magnitude = np.sum([np.abs(e.astype(np.float64)) for e in everyone], axis=0) / (degree if mean else 1)
    pre, post = comp.scales(size, degree, mean)
    for chunk_bytes in (1 << 20, 3000):  # twice: catches lazy-initialisation bugs
        grad = everyone[rank].copy()
        pack_sum_unpack(comm, grad, comp, pre, post, chunk_bytes, method=method)
        assert grad.dtype == src_dtype
        # Each input rounds once; the sum rounds once (alltoall) or per tree level (allreduce).
        roundings = 2 if method == "alltoall" else size + 1
        bound = roundings * UNIT[comp.name] * magnitude + size * 2.0**-24
        assert np.all(np.abs(grad - exact) <= bound)
        assert_same_on_all_ranks(comm, [grad])


@pytest.mark.parametrize("method", METHODS)
def test_predivision_prevents_overflow(comm, method):
    size, rank = comm.Get_size(), comm.Get_rank()
    comp = get_compression("fp16")
    x = np.full(1000, 40000.0, np.float32)  # fits float16; any two of them do not
    x[1::2] = -40000.0 + rank
    exact = np.where(np.arange(1000) % 2 == 0, 40000.0 * size, -40000.0 * size + size * (size - 1) / 2)
    grad = x.copy()
    pre, post = comp.scales(size, size, mean=False)  # default predivide: the number of ranks
    pack_sum_unpack(comm, grad, comp, pre, post, method=method)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, exact, rtol=size * UNIT["fp16"])
    naive = x.copy()
    pack_sum_unpack(comm, naive, comp, *comp.scales(size, size, mean=False, predivide=1.0), method=method)
    if size >= 2:
        assert np.all(np.isinf(naive))
    comp.free()


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_values_propagate(comm, comp, method):
    rank = comm.Get_rank()
    grad = np.ones(10, np.float32)
    if rank == 0:
        grad[0], grad[1], grad[2] = np.nan, np.inf, -np.inf
    pack_sum_unpack(comm, grad, comp, method=method)
    assert np.isnan(grad[0]) and np.isposinf(grad[1]) and np.isneginf(grad[2])
    np.testing.assert_array_equal(grad[3:], comm.Get_size())


def test_after_sees_every_chunk_in_order(comm, comp):
    size = comm.Get_size()
    wire = np.arange(1000).astype(comp.wire_dtype)
    expected = (wire.astype(np.float64) * size).astype(comp.wire_dtype)
    seen = []
    compressed_allreduce(comm, wire, comp, 600, after=lambda chunk: seen.append(chunk.copy()))
    assert [c.shape[0] for c in seen] == [300, 300, 300, 100]
    assert all(c.dtype == comp.wire_dtype for c in seen)
    np.testing.assert_array_equal(np.concatenate(seen).view(np.uint16), wire.view(np.uint16))
    np.testing.assert_array_equal(wire.view(np.uint16), expected.view(np.uint16))
    empty = np.zeros(0, comp.wire_dtype)
    compressed_allreduce(comm, empty, comp)  # nothing to do, on every rank


def test_bad_arguments(comp):
    wire = np.zeros(8, comp.wire_dtype)
    with pytest.raises(TypeError, match=r"wire_buf: expected dtype .* got float32"):
        compressed_allreduce(WORLD, np.zeros(8, np.float32), comp)
    with pytest.raises(ValueError, match=r"wire_buf: expected a 1-D contiguous array, got shape \(2, 4\)"):
        compressed_allreduce(WORLD, wire.reshape(2, 4), comp)
    with pytest.raises(ValueError, match=r"wire_buf: expected a 1-D contiguous array"):
        compressed_allreduce(WORLD, wire[::2], comp)
    with pytest.raises(ValueError, match=r"method: expected one of \('alltoall', 'allreduce'\), got 'ring'"):
        compressed_allreduce(WORLD, wire, comp, method="ring")
    with pytest.raises(ValueError, match=r"chunk_bytes: expected a positive int, got 0"):
        compressed_allreduce(WORLD, wire, comp, 0)



@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [0, 2, 5, 1000, 40_003])
def test_pipelined_cast_sum_gives_the_bits_of_one_piece(name, n):
    """``SliceSum.pipelined`` (cast, send and cast back in pieces that overlap) gives, for any number of pieces,
    the bits of casting the whole chunk, one ``__call__`` and casting back, on random float32 data."""
    if name == "bf16" and not everywhere(importlib.util.find_spec("ml_dtypes") is not None):
        pytest.skip("needs ml_dtypes on every rank")  # decided by every rank alike: a collective follows
    comp = get_compression(name)
    rng = np.random.default_rng([5, n, WORLD.Get_rank()])
    src = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(np.float32)
    pre, post = 1.0 / WORLD.Get_size(), WORLD.Get_size() * 0.25
    summer = SliceSum(WORLD, comp, 64 << 10, "alltoall")
    wire = np.empty(n, comp.wire_dtype)
    expected = src.copy()
    pack(expected, wire, pre)
    summer(wire)
    unpack(wire, expected, post)
    for pieces in (1, 2, 3, 4, 8):
        got = src.copy()
        summer.pipelined(got, np.empty(n, comp.wire_dtype), pre, post, pieces)
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=f"{pieces} pieces")
    assert_same_on_all_ranks(WORLD, [expected])


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_stats_bytes_count_what_is_handed_to_mpi(comm, compression):
    """16-bit compression halves the bytes handed to MPI; a hook that sums the float32 bucket as it is does not."""
    if compression == "bf16" and importlib.util.find_spec("ml_dtypes") is None:
        pytest.skip("bf16 needs ml_dtypes")  # installed or not alike on every rank
    from mpi_gradreducer import DistributedGradReducer

    shapes = [(1000, 300), (77,), (3, 5)]  # a large one reduced in place, two small ones fused
    rng = np.random.default_rng(comm.Get_rank())
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    sent = {}
    for name, kwargs in (("plain", {}), ("compressed", {"compression": compression}),
                         ("as it is", {"hook": lambda bucket: bucket.reduce()})):
        with DistributedGradReducer([np.zeros_like(g) for g in grads], group=comm, **kwargs) as reducer:
            for _ in range(2):
                reducer([g.copy() for g in grads])
            sent[name] = reducer.stats.bytes
    assert sent["plain"] == 2 * sum(g.nbytes for g in grads)
    assert sent["compressed"] * 2 == sent["plain"], sent
    assert sent["as it is"] == sent["plain"], sent
