"""The chunked in-place transport: sums, and means by reduce-scatter + allgather."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer._core import backend, summers, transport

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
    calls = summers.allreduce(WORLD, buf, scale, chunk_bytes=1 << 20, after=lambda c: seen.append(c.shape[0]))
    assert sum(seen) == count and calls >= len(seen)
    tol = 1e-6 if np.dtype(dtype).itemsize <= 8 and dtype != "float64" else 1e-12
    np.testing.assert_allclose(buf.astype(np.complex128), expected, rtol=tol, atol=tol)
    assert_same_on_all_ranks(WORLD, [buf])


def test_large_means_take_the_reduce_scatter_path():
    buf = np.ones(WORLD.Get_size() * (summers.SPLIT_MEAN_BYTES // 4), np.float32)  # divisible by size
    calls = summers.allreduce(WORLD, buf, 0.5, chunk_bytes=buf.nbytes)
    assert calls == (2 if WORLD.Get_size() > 1 else 1)
    np.testing.assert_array_equal(buf, WORLD.Get_size() * 0.5)


@pytest.fixture
def local():
    comm = MPI.COMM_SELF.Dup()
    yield comm
    comm.Free()


def _members(rng, count, dtype="float64"):
    return [rng.standard_normal(int(rng.integers(0, 40))).astype(dtype).reshape(-1) for _ in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex128"])
def test_gather_copies_members_both_ways_and_rebuilds_when_they_change(local, dtype):
    rng = np.random.default_rng(7)
    g = transport.Gather(local, tag=3)
    for epoch in (None, 1, 2):  # new arrays each round: the datatype is rebuilt
        members = _members(rng, 50, dtype)
        buf = np.empty(sum(m.size for m in members), dtype)
        for just_packed in (False, True):  # the same arrays again: reused within an epoch, else rebuilt
            assert g.pack(members, buf, epoch)
            np.testing.assert_array_equal(buf, np.concatenate(members))
            expected = rng.standard_normal(buf.shape[0]).astype(dtype)
            buf[...] = expected
            assert g.unpack(buf, members, just_packed)
            np.testing.assert_array_equal(np.concatenate(members), expected)
        kept = g._type
        assert g.pack(members, buf, epoch)  # once more: the datatype is kept (the same epoch, or the same memory)
        assert g._type is kept
        np.testing.assert_array_equal(buf, np.concatenate(members))
    g.free()
    g.free()  # idempotent


def test_gather_without_an_epoch_keeps_its_datatype_for_the_same_memory_only(local):
    """No epoch: other objects over the same memory reuse the datatype; a member that moves or changes size, or
    another buffer, rebuilds it; the data is right every time (random floats, compared bit for bit)."""
    rng = np.random.default_rng(9)
    g = transport.Gather(local, tag=1)
    store = rng.standard_normal(300)
    cuts = [0, 10, 45, 46, 120, 300]
    buf = np.empty(300)

    def views(base):
        return [base[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]  # new view objects each time

    assert g.pack(views(store), buf)
    kept = g._type
    for _ in range(3):
        store[...] = rng.standard_normal(300)
        assert g.pack(views(store), buf)
        assert g._type is kept
        np.testing.assert_array_equal(buf, store)
        buf[...] = rng.standard_normal(300)
        assert g.unpack(buf, views(store))
        np.testing.assert_array_equal(store, buf)
    moved = views(store)
    moved[2] = rng.standard_normal(1)  # same size, elsewhere
    assert g.pack(moved, buf)
    assert g._type is not kept
    np.testing.assert_array_equal(buf, np.concatenate(moved))
    kept = g._type
    other = np.empty(300)
    assert g.pack(moved, other)  # the same members into another buffer
    assert g._type is not kept
    np.testing.assert_array_equal(other, np.concatenate(moved))
    g.free()


def test_gather_declines_what_it_cannot_address(local):
    rng = np.random.default_rng(8)
    g = transport.Gather(local, tag=0)
    members = _members(rng, 10)
    buf = np.empty(sum(m.size for m in members))
    assert g.pack(members, buf)
    before = buf.copy()
    strided = np.zeros(2 * members[4].size)[::2]
    for other in (members[:4] + [strided] + members[5:],  # not C-contiguous
                  members[:-1],  # does not fill the buffer
                  members[:-1] + [buf[-members[-1].size:]],  # lies in the buffer itself
                  members[:-1] + [list(members[-1])]):  # not an array
        assert not g.pack(other, buf)
        assert not g.unpack(buf, other)
        np.testing.assert_array_equal(buf, before)  # nothing was copied
    assert g.pack(members, buf)  # and it recovers
    others = [np.zeros_like(m) for m in members]  # an unpack into other arrays than the pack's
    assert g.unpack(buf, others)
    np.testing.assert_array_equal(np.concatenate(others), buf)
    assert g.pack(members, buf)
    size = members[3].size
    del members[3]  # a member that dies is not mistaken for a new one at its address
    members.insert(3, np.full(size, 5.0))
    assert g.pack(members, buf)
    np.testing.assert_array_equal(buf, np.concatenate(members))
    g.free()


def _vm_flags(a: np.ndarray) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``a`` (Linux ``/proc/self/smaps``)."""
    address, inside = a.ctypes.data, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.parametrize("dtype", ["float32", "complex128", "uint16"])
@pytest.mark.parametrize("nbytes", [40, backend.HUGE_FROM, 3 * backend.HUGE_PAGE + 8])
def test_host_buffers_from_1_mib_are_advised_huge_pages(dtype, nbytes):
    count = max(1, nbytes // np.dtype(dtype).itemsize)
    a = backend.empty(count, np.dtype(dtype), "cpu")
    assert a.shape == (count,) and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
    a[...] = 3
    assert (a == 3).all()
    if a.nbytes >= backend.HUGE_FROM and hasattr(mmap, "MADV_HUGEPAGE"):
        assert a.ctypes.data % backend.HUGE_PAGE == 0
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # a kernel with huge pages
            assert "hg" in _vm_flags(a)  # madvise(MADV_HUGEPAGE) took


@pytest.mark.parametrize("compute", [None, np.complex64, np.complex128])
def test_scaled_copy_scales_complex_values_component_wise(compute):
    from mpi_gradreducer._core.dtypes import scaled_copy

    src = np.array([np.inf + 0j, 1 + 1j * np.inf, 2 - 4j], np.complex64)
    for scale in (0.5, 4.0):  # without and with the overflow guard
        dst = np.empty_like(src)
        scaled_copy(src, dst, scale, compute)
        np.testing.assert_array_equal(dst.real, src.real * np.float32(scale))
        np.testing.assert_array_equal(dst.imag, src.imag * np.float32(scale))


@pytest.mark.parametrize("computing", [False, True], ids=["training-waits", "training-computes"])
@pytest.mark.parametrize("count", [3, 1000, 300_003])
def test_polled_summers_move_the_same_bytes_as_blocking_ones(computing, count):
    """An ordered sum whose ``Alltoall``/``Allgather`` are nonblocking and completed by :class:`Polling`
    (the communication thread's way) gives the blocking summer's bits, on random float data."""
    from mpi_gradreducer._core.polling import Polling

    rng = np.random.default_rng([21, WORLD.Get_rank()])
    mine = (rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(np.float32)
    polling = Polling()
    polling.computing(computing)
    blocking, polled = mine.copy(), mine.copy()
    summers.OrderedSum(WORLD, np.float32, 1 << 20)(blocking, 0.25)
    summers.OrderedSum(WORLD, np.float32, 1 << 20, wait=polling.wait)(polled, 0.25)
    np.testing.assert_array_equal(polled.view(np.uint32), blocking.view(np.uint32))
    assert_same_on_all_ranks(WORLD, [polled])


def test_polling_naps_only_while_the_training_thread_computes():
    """A request is tested every nap while the training thread computes; once it waits, MPI's own wait
    finishes it (a loop of tests without naps would take the cores of ranks that share them)."""
    from mpi_gradreducer._core.polling import Polling

    class Late:
        """Completes on the 20th test, or when waited for."""

        def __init__(self) -> None:
            self.tests = self.waits = 0

        def Test(self) -> bool:
            self.tests += 1
            return self.tests >= 20

        def Wait(self) -> None:
            self.waits += 1

    polling = Polling(nap=0.005)
    polling.computing(True)
    request = Late()
    t0 = time.perf_counter()
    polling.wait(request)  # type: ignore[arg-type]
    assert request.tests == 20 and time.perf_counter() - t0 >= 19 * 0.005
    polling.computing(False)
    request = Late()
    t0 = time.perf_counter()
    polling.wait(request)  # type: ignore[arg-type]
    assert (request.tests, request.waits) == (1, 1) and time.perf_counter() - t0 < 0.05
