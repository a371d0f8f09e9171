"""The parts one by one: the local checks, the call header's arithmetic, settling a call, each path.

``validation.check_grads`` and the header (``control.Local``, ``Summary``,
``carries``, ``lead``) are pure and tested in one process; ``control.settle``
and the paths of :mod:`mpi_gradreducer._core.paths`, driven directly through a
``paths.Context``, are collective.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from conftest import WORLD
from mpi_gradreducer import Options, RowSparse
from mpi_gradreducer._core import control, options as options_module, paths
from mpi_gradreducer._core.call import open_call, settle as settle_call
from mpi_gradreducer._core.compression import get_compression
from mpi_gradreducer._core.fusion import plan_for
from mpi_gradreducer._core.instrument import Instrument
from mpi_gradreducer._core.validation import check_grads


def _options(specs, **kwargs: Any) -> Options:
    asked = Options(timeout=60, progress="deferred", stall_warning=None).replace(**kwargs)
    return options_module.resolve(asked, specs, WORLD.Get_size())


def _plan(arrays: list[np.ndarray], **kwargs: Any):
    specs = options_module.param_specs(arrays)
    options = _options(specs, **kwargs)
    return plan_for(specs, options, options.cap or (4 << 20)), options


# -- validation.check_grads, one process ---------------------------------------------------

PARAMS = [np.zeros(3, np.float32), np.zeros((2, 3), np.float32), np.zeros((6, 2), np.float32)]


def _good() -> list[Any]:
    return [np.ones(p.shape, p.dtype) for p in PARAMS]


@pytest.mark.parametrize("spoil, cls, pattern", [
    (lambda g: g.pop(), ValueError, r"^grads: expected 3 arrays .*got 2$"),
    (lambda g: g.__setitem__(1, np.ones((3, 2), np.float32)), ValueError,
     r"^grads\[1\]: expected shape \(2, 3\) \(as parameter 1\), got \(3, 2\)$"),
    (lambda g: g.__setitem__(0, np.ones(3, np.float16)), TypeError,
     r"^grads\[0\]: expected dtype float32 .*got float16$"),
    (lambda g: g[2].setflags(write=False), ValueError, r"^grads\[2\] is read-only"),
    (lambda g: g.__setitem__(1, g[2].reshape(-1)[:6].reshape(2, 3)), ValueError,
     r"^grads\[1\] and grads\[2\] share memory"),
    (lambda g: g.__setitem__(0, "x"), TypeError, r"^grads\[0\]: expected a numpy or cupy array, got str"),
    (lambda g: g.__setitem__(0, np.float32(1)), TypeError, r"^grads\[0\]: expected"),
    (lambda g: g.__setitem__(2, RowSparse(np.array([9]), np.ones((1, 2), np.float32), (6, 2), validate=False)),
     ValueError, r"^grads\[2\]: indices: expected row numbers in \[0, 6\)"),
    (lambda g: g.__setitem__(2, RowSparse(np.array([1]), np.ones((1, 3), np.float32), (6, 3))),
     ValueError, r"^grads\[2\]: expected a RowSparse of dense_shape \(6, 2\)"),
])
def test_check_grads_names_every_error(spoil, cls, pattern):
    plan, _ = _plan(PARAMS)
    grads = _good()
    spoil(grads)
    checked = check_grads(grads, plan, aliasing=True)
    assert isinstance(checked.error, cls) and re.search(pattern, str(checked.error)), checked.error


@pytest.mark.parametrize("grads, message", [
    (None, r"^grads: expected a list of 3 arrays"), (5, r"^grads: expected a list of 3 arrays .*got int$"),
    ({0: 1}, r"got dict"), (iter([]), r"pass list\(\.\.\.\) of it"),
])
def test_check_grads_of_a_whole_odd_argument(grads, message):
    plan, _ = _plan(PARAMS)
    checked = check_grads(grads, plan, aliasing=True)
    assert isinstance(checked.error, TypeError) and re.search(message, str(checked.error)), checked.error


def test_check_grads_tuples_refuse_none_and_rowsparse():
    plan, _ = _plan(PARAMS)
    g = _good()
    g[1] = None
    assert "must be a list, got tuple" in str(check_grads(tuple(g), plan, True).error)
    g = _good()
    g[2] = RowSparse(np.array([0]), np.ones((1, 2), np.float32), (6, 2))
    assert "must be a list, got tuple" in str(check_grads(tuple(g), plan, True).error)


def test_check_grads_reports_sparse_and_absent_positions_and_views():
    plan, _ = _plan(PARAMS)
    g = _good()
    g[0] = None
    g[2] = RowSparse(np.array([0, 5]), np.ones((2, 2), np.float32), (6, 2))
    checked = check_grads(g, plan, True)
    assert checked.error is None and checked.sparse == (2,) and checked.absent == (0,) and not checked.views
    assert checked.arrays is g
    views = plan.allocate_grads()
    checked = check_grads(views, plan, True)
    assert checked.error is None and checked.views
    mixed = list(views)
    mixed[0] = np.ones(3, np.float32)
    assert not check_grads(mixed, plan, True).views
    none_view = list(views)
    none_view[1] = None  # a None is absent, never the view
    checked = check_grads(none_view, plan, True)
    assert checked.absent == (1,) and not checked.views


def test_check_grads_views_torch_tensors_without_copies():
    torch = pytest.importorskip("torch")
    plan, _ = _plan(PARAMS)
    tensors = [torch.ones(tuple(p.shape)) for p in PARAMS]
    tensors[1] = torch.ones(3, 2).t()  # a transposed view: strided, still viewed in place
    checked = check_grads(tensors, plan, True)
    assert checked.error is None and checked.arrays is not tensors
    for t, a in zip(tensors, checked.arrays, strict=True):
        assert type(a) is np.ndarray and a.__array_interface__["data"][0] == t.data_ptr()
    storage = torch.zeros(40)
    overlapping = [storage[:3], storage[2:8].view(2, 3), torch.zeros(6, 2)]
    assert "grads[0] and grads[1] share memory" in str(check_grads(overlapping, plan, True).error)
    shared = [storage[:3].numpy(), storage[2:8].numpy().reshape(2, 3), np.zeros((6, 2), np.float32)]
    assert "grads[0] and grads[1] share memory" in str(check_grads(shared, plan, True).error)


def test_check_grads_of_a_numpy_subclass_is_a_plain_view():
    plan, _ = _plan(PARAMS)
    g = _good()
    g[1] = np.asmatrix(np.ones((2, 3), np.float32))
    checked = check_grads(g, plan, True)
    assert checked.error is None and type(checked.arrays[1]) is np.ndarray
    assert np.shares_memory(checked.arrays[1], g[1])


# -- the header's arithmetic, one process ----------------------------------------------------


def _summed(locals_: list[control.Local]) -> control.Summary:
    return control.Summary.of(np.sum([loc.values() for loc in locals_], axis=0))


def test_summary_of_healthy_failed_joined_and_disagreeing_headers():
    size = 4
    healthy = [control.Local(7) for _ in range(size)]
    s = _summed(healthy)
    assert s.healthy(size) and s.contributors == size and s.failed == 0 and s.agree
    failed = healthy[:3] + [control.Local(7, error=ValueError("x"))]
    s = _summed(failed)
    assert s.failed == 1 and not s.healthy(size)
    joined = healthy[:2] + [control.Local(7, contributing=False)] * 2
    s = _summed(joined)
    assert s.contributors == 2 and s.agree and not s.healthy(size)
    behind = healthy[:3] + [control.Local(6)]
    assert not _summed(behind).agree
    sparse = healthy[:3] + [control.Local(7, sparse=(2,))]
    assert not _summed(sparse).agree
    absent = healthy[:3] + [control.Local(7, absent=(1,))]
    s = _summed(absent)
    assert s.attention == 1 and s.agree and not s.healthy(size)
    views = [control.Local(7, views=True)] * size
    assert _summed(views).views == size and _summed(views).healthy(size)


def test_header_fits_and_float32_sums_stay_exact_up_to_the_bound():
    assert control.lead(np.float32) == control.SLOTS and control.lead(np.complex64) == -(-control.SLOTS // 2)
    for dtype in (np.float16, np.int32):
        assert not control.carries(np.dtype(dtype), 2)
    assert control.carries(np.dtype(np.float64), 10**6) and control.carries(np.dtype(np.complex128), 10**6)
    bound = (1 << 24) // (255 * 255)
    assert control.carries(np.dtype(np.float32), bound) and not control.carries(np.dtype(np.float32), bound + 1)
    assert control.carries(np.dtype(np.complex64), bound) and not control.carries(np.dtype(np.complex64), bound + 1)
    # At the bound, the largest sums of squared digests are exact in float32, and agreement is read right.
    worst = control.Local(1)
    values = np.array(worst.values(), dtype=np.float64)
    values[-6:-3], values[-3:] = 255, 255 * 255  # the three digests and their squares end the header
    total = (values * bound).astype(np.float32)
    assert np.array_equal(total.astype(np.float64), values * bound)
    assert control.Summary.of(total).agree
    off = total.copy()
    off[-6] -= 1  # one rank's digest one less: the squares no longer match
    off[-3] -= 2 * 255 - 1
    assert not control.Summary.of(off).agree


def test_write_puts_the_header_first_and_zeros_the_rest():
    slots = np.full(control.SLOTS + 3, 9.0, np.float32)
    control.Local(3, views=True).write(slots)
    assert list(slots[: control.SLOTS]) == control.Local(3, views=True).values() and not slots[control.SLOTS:].any()


# -- control.settle, collective --------------------------------------------------------------


def _settle(local: control.Local, count: int) -> control.CallInfo:
    return control.settle(WORLD, local, control.exchange(WORLD, local), count)


@pytest.mark.mpi
def test_settle_healthy_none_and_all_none():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    info = _settle(control.Local(1), 4)
    assert info.contributors == size and info.absent == () and info.sparse == ()
    absent = (1, 3) if r == 0 else (3,)
    info = _settle(control.Local(2, absent=absent), 4)
    assert info.absent == ((3,) if size > 1 else (1, 3))  # absent only where every rank has None
    info = _settle(control.Local(3, sparse=(2,), absent=(0,)), 4)
    assert info.sparse == (2,) and info.absent == (0,)


@pytest.mark.mpi(min_size=2)
def test_settle_names_ranks_at_different_calls_and_different_structures():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    with pytest.raises(ValueError, match=rf"rank 0 at call 5, rank {size - 1} at call 6"):
        _settle(control.Local(6 if r == size - 1 else 5), 3)
    with pytest.raises(ValueError, match=r"differently structured"):
        _settle(control.Local(5, sparse=(1,) if r == 1 else ()), 3)
    with pytest.raises(TypeError, match=r"^rank 1: bad"):
        _settle(control.Local(5, error=TypeError("bad") if r == 1 else None), 3)
    info = _settle(control.Local(5, contributing=r != 0), 3)
    assert info.contributors == size - 1


# -- the paths, collective -------------------------------------------------------------------


def _context(arrays: list[np.ndarray], **kwargs: Any) -> tuple[paths.Context, list[Any]]:
    plan, options = _plan(arrays, **kwargs)
    instrument = Instrument(WORLD, options)
    ctx = paths.Context(WORLD, plan, options, instrument, get_compression(options.wire_format))
    return ctx, paths.assign(ctx)


def _call(ctx: paths.Context, grads: list[Any], number: int = 1):
    """A validated, opened call whose header will ride on the carrier (or is read now)."""
    checked = check_grads(grads, ctx.plan, True)
    assert checked.error is None
    call = open_call(number, grads, ctx.plan, checked, check_finite=False)
    call.settle = lambda summary: settle_call(call, WORLD, ctx.options, ctx.plan, summary)
    if ctx.carrier is None:
        call.settle(control.exchange(WORLD, call.local))
        call.head = "ahead"
    return call


def _close(ctx: paths.Context) -> None:
    ctx.instrument.close()


@pytest.mark.mpi
def test_host_path_in_place_and_packed():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    params = [np.zeros(5, np.float64), np.zeros((300, 1000), np.float64), np.zeros((2, 2), np.float64)]
    ctx, assigned = _context(params)
    try:
        assert all(type(p) is paths.HostPath for p in assigned)
        grads = [np.full(p.shape, r + 1.0) for p in params]
        grads[2] = np.full((2, 2), r + 1.0).T  # strided: packed
        large = grads[1]
        call = _call(ctx, grads)
        paths.run(assigned, range(len(assigned)), call)
        for g in grads:
            np.testing.assert_allclose(g, (size + 1) / 2)
        assert grads[1] is large  # in place
        assert call.head == "sent" and call.info is not None and call.info.contributors == size
        assert ctx.instrument.stats.messages >= len(ctx.plan.buffers)
    finally:
        _close(ctx)


@pytest.mark.mpi
def test_host_path_joins_consecutive_own_view_buckets_into_one_run():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    params = [np.zeros(64, np.float64) for _ in range(6)]
    ctx, assigned = _context(params, bucket_bytes=1024)  # 2 gradients of 512 bytes per bucket
    try:
        assert len(ctx.plan.buffers) == 3
        views = ctx.plan.allocate_grads()
        for v in views:
            v[...] = r + 1.0
        call = _call(ctx, views)
        paths.run(assigned, range(3), call)
        for v in views:
            np.testing.assert_allclose(v, (size + 1) / 2)
        # The header with bucket 0 (all of it fits in the head), then buckets 1 and 2 as one run.
        assert ctx.instrument.stats.messages == 2
        assert call.info.runs
        ordinary = [np.full(64, r + 1.0) for _ in range(6)]
        before = ctx.instrument.stats.messages
        call = _call(ctx, ordinary, 2)
        paths.run(assigned, range(3), call)
        for g in ordinary:
            np.testing.assert_allclose(g, (size + 1) / 2)
        assert ctx.instrument.stats.messages - before == 3  # the header with bucket 0, then 1 and 2 apart
    finally:
        _close(ctx)


@pytest.mark.mpi
def test_half_path_sends_16_bits_and_sums_in_float32():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    params = [np.zeros(8, np.float16), np.zeros(4, np.float16)]
    ctx, assigned = _context(params, mean=False)
    try:
        assert type(assigned[0]) is paths.HalfPath and ctx.plan.buffers[0].bucket.wire_dtype == np.float16
        assert ctx.carrier is None  # 16-bit sums are not exact enough to carry the header: it goes alone
        # 1024 + 0.5 is not a float16: partial sums in float16 would stay at 1024.
        grads = [np.full(8, 1024.0 if r == 0 else 0.5, np.float16), np.full(4, r + 1.0, np.float16)]
        call = _call(ctx, grads)
        paths.run(assigned, range(len(assigned)), call)
        want = np.float16(1024.0 + 0.5 * (size - 1))  # summed in float32, rounded once
        np.testing.assert_array_equal(grads[0], np.full(8, want, np.float16))
        np.testing.assert_array_equal(grads[1], np.full(4, size * (size + 1) / 2, np.float16))
        # one bucket, one slice-by-slice sum: Alltoallv and Allgatherv (nothing at size 1)
        assert ctx.instrument.stats.messages == (2 if size > 1 else 0) and call.info.contributors == size
    finally:
        _close(ctx)


@pytest.mark.mpi
def test_compressed_path_sends_16_bits_and_returns_the_mean():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    params = [np.zeros(1000, np.float32), np.zeros(7, np.float32)]
    ctx, assigned = _context(params, compression="fp16")
    try:
        assert all(type(p) is paths.CompressedPath for p in assigned) and ctx.carrier is None
        grads = [np.full(p.shape, r + 1.0, np.float32) for p in params]
        call = _call(ctx, grads)
        paths.run(assigned, range(len(assigned)), call)
        for g in grads:
            np.testing.assert_allclose(g, (size + 1) / 2, rtol=1e-3)
        assert ctx.instrument.stats.messages >= (len(ctx.plan.buffers) if size > 1 else 0)
    finally:
        _close(ctx)


@pytest.mark.mpi
def test_sparse_path_gathers_every_ranks_rows():
    r, size = WORLD.Get_rank(), WORLD.Get_size()
    params = [np.zeros((5, 2), np.float32), np.zeros(3, np.float32)]
    ctx, assigned = _context(params)
    try:
        sparse = paths.SparsePath(ctx)
        grads: list[Any] = [RowSparse(np.array([r % 5, 4]), np.full((2, 2), r + 1.0, np.float32), (5, 2)),
                            np.full(3, r + 1.0, np.float32)]
        call = _call(ctx, grads)
        paths.run(assigned, range(len(assigned)), call)
        before = ctx.instrument.stats.messages
        sparse.reduce(call)
        assert ctx.instrument.stats.messages - before == 3
        result = call.grads[0]
        assert isinstance(result, RowSparse) and result.nnz == 2 * size
        dense = np.zeros((5, 2))
        for q in range(size):
            dense[q % 5] += (q + 1) / size
            dense[4] += (q + 1) / size
        np.testing.assert_allclose(result.to_dense(), dense, rtol=1e-6)
        np.testing.assert_allclose(grads[1], (size + 1) / 2)
    finally:
        _close(ctx)
