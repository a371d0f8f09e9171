"""Arrays of other libraries (torch tensors, DLPack and array-interface objects) as parameters and grads.

The reducer works on numpy views of the caller's objects: results must land
in the caller's memory (same data pointer), the returned list must hold the
caller's objects, and bad input must raise on every rank before anything is
modified. torch is optional: without it on every rank, its tests skip on
every rank alike.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks, everywhere, expected_mean, rank_value
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core import interop


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def torch():
    """torch, when every rank has it; else the test skips on every rank."""
    if not everywhere(_has_torch()):
        pytest.skip("needs torch on every rank")
    import torch as th

    return th


@pytest.fixture(scope="module")
def ml_dtypes():
    try:
        import ml_dtypes as md
    except ImportError:
        md = None
    if not everywhere(md is not None):
        pytest.skip("needs ml_dtypes on every rank")
    return md


class DLPackOnly:
    """Exposes a numpy array through ``__dlpack__``/``__dlpack_device__`` only."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class InterfaceOnly:
    """Exposes a numpy array through ``__array_interface__`` only."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array  # keeps the memory alive
        self.__array_interface__ = array.__array_interface__


def _data_ptr(t) -> int:
    return t.data_ptr()


# -- single process: the views themselves --------------------------------------------------


def test_view_of_numpy_is_itself():
    a = np.zeros(3)
    assert interop.view(a) is a


def test_view_of_torch_tensors_shares_their_memory(torch):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (base, base.t(), base[:, 1::2], base[1:3], torch.zeros((), dtype=torch.float64)):
        v = interop.view(t)
        assert isinstance(v, np.ndarray) and v.shape == tuple(t.shape)
        assert v.__array_interface__["data"][0] == _data_ptr(t)
        assert v.strides == tuple(s * t.element_size() for s in t.stride())
        v[...] = 7
        assert bool((t == 7).all())


def test_view_of_bfloat16_tensor_is_bit_exact_and_keeps_the_producer_alive(torch, ml_dtypes):
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).t()
    bits = t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()
    v = interop.view(t)
    assert v.dtype == np.dtype(ml_dtypes.bfloat16) and v.shape == (3, 5)
    assert v.__array_interface__["data"][0] == _data_ptr(t)
    np.testing.assert_array_equal(v.view(np.uint16), bits)
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is not None  # the view holds the export
    np.testing.assert_array_equal(v.view(np.uint16), bits)
    del v
    gc.collect()
    assert alive() is None  # the deleter released it


def test_view_of_protocol_only_objects(ml_dtypes):
    a = np.arange(6.0).reshape(2, 3)[:, ::2]
    for obj in (DLPackOnly(a), InterfaceOnly(a)):
        v = interop.view(obj)
        assert v.shape == a.shape and np.shares_memory(v, a) and v.flags.writeable
    ro = np.zeros(3)
    ro.setflags(write=False)
    assert not interop.view(InterfaceOnly(ro)).flags.writeable
    assert not interop.view(DLPackOnly(ro)).flags.writeable


def test_objects_that_are_not_arrays_have_no_view_and_are_explained():
    for obj in (None, [1.0, 2.0], "abc", object()):
        assert interop.view(obj) is None
        assert "exposes none of __array_interface__" in interop.explain(obj)


def test_a_copying_array_method_is_refused():
    class Copies:
        def __array__(self, dtype=None, copy=None):
            return np.zeros(3)

    assert interop.view(Copies()) is None
    assert "returns a copy" in interop.explain(Copies())


def test_parameters_that_require_grad_are_described_not_viewed(torch):
    p = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    assert interop.view(p) is None
    assert interop.describe(p) == ((3, 2), np.dtype(np.float64), "cpu")
    assert "requires grad" in interop.explain(p) and ".detach()" in interop.explain(p)


# -- collective ------------------------------------------------------------------------------


def _torch_grads(torch, comm, k=1.0):
    """Contiguous, transposed, sliced, float16 and 0-d tensors, rank r holding r + k."""
    value = rank_value(comm, k)
    wide = torch.full((6, 8), value, dtype=torch.float32)
    return [
        torch.full((3, 4), value, dtype=torch.float32),
        torch.full((5, 3), value, dtype=torch.float64).t(),  # transposed: (3, 5)
        wide[1:5, ::2],  # sliced and strided: (4, 4)
        torch.full((7,), value, dtype=torch.float16),
        torch.full((), value, dtype=torch.float32),
        torch.full((300, 300), value, dtype=torch.float32),  # large: reduced where it lies
    ]


@pytest.mark.mpi(min_size=1)
def test_torch_grads_are_averaged_in_their_own_memory(torch):
    comm = WORLD
    with DistributedGradReducer(_torch_grads(torch, comm), group=comm) as reducer:
        for k in (1.0, 2.0):  # called twice
            grads = _torch_grads(torch, comm, k)
            ptrs = [_data_ptr(g) for g in grads]
            objects = list(grads)
            out = reducer(grads)
            assert out is grads and all(a is b for a, b in zip(out, objects, strict=True))
            assert [_data_ptr(g) for g in grads] == ptrs
            for g in grads:
                np.testing.assert_allclose(g.double().numpy(), expected_mean(comm, k), rtol=1e-3)
            assert_same_on_all_ranks(comm, [g.numpy() for g in grads])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_tensors_match_numpy_bit_for_bit(torch, ml_dtypes, dtype):
    """float16 and bfloat16 tensors are summed in float32 like numpy arrays: the same bits."""
    comm = WORLD
    rng = np.random.default_rng(comm.Get_rank())
    values = [rng.standard_normal(s).astype(np.float32) for s in ((17,), (4, 9), (600, 300))]
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    tensors = [torch.from_numpy(v).to(getattr(torch, dtype)) for v in values]
    tensors[1] = tensors[1].t().contiguous().t()  # non-contiguous
    arrays = [v.astype(np_dtype) for v in values]
    ptrs = [_data_ptr(t) for t in tensors]
    with DistributedGradReducer(tensors, group=comm) as reducer:
        reducer(tensors)
    with DistributedGradReducer(arrays, group=comm) as reducer:
        reducer(arrays)
    assert [_data_ptr(t) for t in tensors] == ptrs
    for t, a in zip(tensors, arrays, strict=True):
        bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(bits, a.view(np.uint16))


@pytest.mark.mpi(min_size=1)
def test_module_parameters_at_construction_and_their_grads(torch):
    comm = WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    with DistributedGradReducer(model.parameters(), group=comm) as reducer:  # a generator
        x = torch.full((2, 5), rank_value(comm, 1.0))
        model(x).sum().backward()
        local = [p.grad.clone() for p in model.parameters()]
        grads = [p.grad for p in model.parameters()]
        ptrs = [_data_ptr(g) for g in grads]
        reducer(grads)
        assert [_data_ptr(p.grad) for p in model.parameters()] == ptrs
        total = [torch.from_numpy(np.ascontiguousarray(g.numpy())) for g in local]
        for t in total:
            comm.Allreduce(MPI.IN_PLACE, t.numpy())
        for p, t in zip(model.parameters(), total, strict=True):
            np.testing.assert_allclose(p.grad.numpy(), t.numpy() / comm.Get_size(), rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=1)
def test_a_generator_of_grads_is_taken_and_the_callers_objects_returned(torch):
    comm = WORLD
    grads = _torch_grads(torch, comm)
    with DistributedGradReducer(grads, group=comm) as reducer:
        out = reducer(g for g in grads)
        assert isinstance(out, list) and all(a is b for a, b in zip(out, grads, strict=True))
        np.testing.assert_allclose(grads[0].numpy(), expected_mean(comm, 1.0))
        step = reducer.begin(iter(grads))
        for i in reversed(range(len(grads))):
            step.ready(i)
        out = step.wait()
        assert all(a is b for a, b in zip(out, grads, strict=True))
        np.testing.assert_allclose(grads[0].numpy(), expected_mean(comm, 1.0))


@pytest.mark.mpi(min_size=1)
def test_begin_on_torch_grads_returns_the_callers_list(torch):
    comm = WORLD
    with DistributedGradReducer(_torch_grads(torch, comm), group=comm) as reducer:
        grads = _torch_grads(torch, comm, 3.0)
        step = reducer.begin(grads)
        for i in range(len(grads)):
            step.ready(i)
        assert step.wait() is grads
        for g in grads:
            np.testing.assert_allclose(g.double().numpy(), expected_mean(comm, 3.0), rtol=1e-3)


@pytest.mark.mpi(min_size=1)
def test_protocol_only_and_mixed_lists(torch):
    comm = WORLD
    value = rank_value(comm, 1.0)
    under = [np.full((3, 2), value), np.full((5,), value, np.float32), np.full((2, 3), value)]
    objects = [
        DLPackOnly(under[0]),
        InterfaceOnly(under[1]),
        under[2],  # plain numpy
        torch.full((4,), value, dtype=torch.float64),
    ]
    with DistributedGradReducer(objects, group=comm) as reducer:
        out = reducer(objects)
        assert out is objects
    for a in under:
        np.testing.assert_allclose(a, expected_mean(comm, 1.0))
    np.testing.assert_allclose(objects[3].numpy(), expected_mean(comm, 1.0))


def _spoil(torch, kind, grads):
    """Make one of ``_torch_grads``'s gradients bad, in the named way."""
    if kind == "shape":
        grads[0] = torch.zeros(4, 3)
    elif kind == "dtype":
        grads[0] = torch.zeros(3, 4, dtype=torch.float64)
    elif kind == "requires_grad":
        grads[2] = torch.zeros(4, 4, requires_grad=True)
    elif kind == "readonly":
        ro = np.zeros((7,), np.float16)
        ro.setflags(write=False)
        grads[3] = InterfaceOnly(ro)
    elif kind == "object":
        grads[1] = "not an array"
    elif kind == "overlap":
        base = torch.zeros(6, 8)
        grads[2], grads[0] = base[:4, :4], base[1:4, :4]
    return grads


def _snapshot(g):
    """A copy of what ``g`` holds (a tensor that requires grad seen through ``detach``), or None."""
    v = interop.view(g.detach() if hasattr(g, "detach") else g)
    return None if v is None else np.array(v, copy=True)


ERRORS = {
    "shape": (ValueError, r"grads\[0\]: expected shape \(3, 4\) .*got \(4, 3\) \(torch\.Tensor\)"),
    "dtype": (TypeError, r"grads\[0\]: expected dtype float32 .*got float64 \(torch\.Tensor\)"),
    "requires_grad": (TypeError,
                      r"grads\[2\]: expected a numpy or cupy array, got torch\.Tensor .*requires grad.*\.detach\(\)"),
    "readonly": (ValueError, r"grads\[3\] \(.*InterfaceOnly\) is read-only"),
    "object": (TypeError, r"grads\[1\]: expected a numpy or cupy array, got str, which exposes none"),
    "overlap": (ValueError, r"grads\[0\] and grads\[2\] share memory"),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_bad_tensors_on_one_rank_raise_on_every_rank_untouched(torch, kind):
    comm = WORLD
    bad = comm.Get_size() - 1
    with DistributedGradReducer(_torch_grads(torch, comm), group=comm) as reducer:
        grads = _torch_grads(torch, comm)
        if comm.Get_rank() == bad:
            grads = _spoil(torch, kind, grads)
        before = [_snapshot(g) for g in grads]
        cls, pattern = ERRORS[kind]
        with pytest.raises(cls, match=pattern) as info:
            reducer(grads)
        assert comm.Get_size() == 1 or str(info.value).startswith(f"rank {bad}: ")
        for g, b in zip(grads, before, strict=True):
            np.testing.assert_array_equal(_snapshot(g), b)
        grads = _torch_grads(torch, comm, 2.0)  # still in step on every rank
        reducer(grads)
        np.testing.assert_allclose(grads[0].numpy(), expected_mean(comm, 2.0))


@pytest.mark.mpi(min_size=1)
def test_unsupported_parameters_are_named(torch):
    with pytest.raises(TypeError, match=r"parameters\[1\]: expected a numpy or cupy array, got str"):
        DistributedGradReducer([torch.zeros(2), "x"], group=WORLD)
    with pytest.raises(TypeError, match=r"parameters\[0\]: dtype int64 is not supported"):
        DistributedGradReducer([torch.zeros(2, dtype=torch.int64)], group=WORLD)
