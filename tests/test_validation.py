"""Bad input raises a clear error on every rank, before any array is modified."""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, rank_value
from mpi_gradreducer import DistributedGradReducer

pytestmark = pytest.mark.mpi

SHAPES = [(3, 2), (4,), (2, 2, 2)]


def _params():
    return [np.zeros(s, np.float32) for s in SHAPES]


def _grads(comm):
    return [np.full(s, rank_value(comm, 1.0), np.float32) for s in SHAPES]


def _spoil(kind, grads):
    if kind == "shape":
        grads[1] = np.zeros(5, np.float32)
    elif kind == "dtype":
        grads[1] = np.zeros(4, np.float64)
    elif kind == "readonly":
        grads[2].setflags(write=False)
    elif kind == "twice":
        grads[1] = grads[0].reshape(-1)[:4]
    elif kind == "count":
        grads.pop()
    elif kind == "type":
        grads[0] = [[0.0] * 2] * 3
    return grads


EXPECTED = {
    "shape": (ValueError, r"grads\[1\]: expected shape \(4,\) .*got \(5,\)"),
    "dtype": (TypeError, r"grads\[1\]: expected dtype float32 .*got float64"),
    "readonly": (ValueError, r"grads\[2\] is read-only"),
    "twice": (ValueError, r"grads\[0\] and grads\[1\] share memory"),
    "count": (ValueError, r"grads: expected 3 arrays .*got 2"),
    "type": (TypeError, r"grads\[0\]: expected a numpy or cupy array, got list"),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
@pytest.mark.parametrize("bad_rank", ["first", "last"])
def test_bad_grads_on_one_rank_raise_on_every_rank_untouched(kind, bad_rank):
    comm = WORLD
    bad = 0 if bad_rank == "first" else comm.Get_size() - 1
    with DistributedGradReducer(_params(), group=comm) as reducer:
        reducer(_grads(comm))  # a good call first: the plan's buffers exist
        grads = _grads(comm)
        if comm.Get_rank() == bad:
            grads = _spoil(kind, grads)
        before = [np.array(g, copy=True) for g in grads]
        cls, pattern = EXPECTED[kind]
        with pytest.raises(cls, match=pattern) as info:
            reducer(grads)
        assert f"rank {bad}" in str(info.value) or comm.Get_size() == 1
        for g, b in zip(grads, before, strict=True):
            np.testing.assert_array_equal(np.asarray(g), b)
        # The reducer is still usable and in step on every rank.
        grads = _grads(comm)
        reducer(grads)
        np.testing.assert_allclose(grads[0], (comm.Get_size() - 1) / 2 + 1.0)


def test_overlapping_strided_views_are_allowed_only_when_disjoint():
    base = np.zeros(12, np.float32)
    params = [np.zeros(6, np.float32), np.zeros(6, np.float32)]
    with DistributedGradReducer(params) as reducer:
        base[:] = rank_value(WORLD, 1.0)
        reducer([base[0::2], base[1::2]])  # interleaved but disjoint: fine
        np.testing.assert_allclose(base, (WORLD.Get_size() - 1) / 2 + 1.0)
        with pytest.raises(ValueError, match=r"grads\[0\] and grads\[1\] share memory"):
            reducer([base[0:6], base[5:11]])


@pytest.mark.parametrize("degree", [0, -2, 1.5, True, "4"])
def test_bad_degree_names_the_value(degree):
    with pytest.raises(ValueError, match=f"degree: expected a positive int, got {degree!r}"):
        DistributedGradReducer(_params(), degree=degree)


def test_bad_degree_on_one_rank_raises_everywhere():
    degree = 0 if WORLD.Get_rank() == WORLD.Get_size() - 1 else None
    with pytest.raises(ValueError, match="degree: expected a positive int, got 0"):
        DistributedGradReducer(_params(), degree=degree)


def test_unsupported_dtype_names_index_and_dtype():
    params = _params() + [np.zeros(3, np.int32)]
    with pytest.raises(TypeError, match=r"parameters\[3\]: dtype int32 is not supported"):
        DistributedGradReducer(params)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"fusion": [1, 2]}, r"fusion: expected 3 ids"),
        ({"fusion": [1, -1, 2]}, r"fusion\[1\]: expected an int >= 0, got -1"),
        ({"split_indices": [1, 1]}, r"split_indices\[1\]: expected an increasing index"),
        ({"split_indices": [3]}, r"split_indices\[0\]: expected an increasing index in \[0, 2\], got 3"),
        ({"bucket_bytes": 0}, r"bucket_bytes: expected a positive int or 'auto', got 0"),
        ({"skip": [True]}, r"skip: expected 3 bools"),
        ({"validate": "sometimes"}, r"validate: expected one of"),
        ({"timeout": -1}, r"timeout: expected a positive number"),
    ],
)
def test_bad_options_are_named(kwargs, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        DistributedGradReducer(_params(), **kwargs)


@pytest.mark.mpi(min_size=2)
def test_models_that_differ_raise_on_every_rank_naming_rank_and_parameter():
    params = _params()
    last = WORLD.Get_size() - 1
    if WORLD.Get_rank() == last:
        params[1] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match=rf"parameter 1 is shape \(4,\) float32 .* at rank 0 "
                                         rf"but shape \(2, 2\) float32 .* at rank {last}"):
        DistributedGradReducer(params)
    params = _params()
    if WORLD.Get_rank() == last:
        params.append(np.zeros(1, np.float32))
    with pytest.raises(ValueError, match=rf"the number of parameters is 3 at rank 0 but 4 at rank {last}"):
        DistributedGradReducer(params)


@pytest.mark.mpi(min_size=2)
def test_options_that_differ_raise_on_every_rank():
    mean = WORLD.Get_rank() != 1
    with pytest.raises(ValueError, match=r"the ranks disagree: option mean is True at rank 0 but False at rank 1"):
        DistributedGradReducer(_params(), mean=mean)


def test_skipped_gradients_are_untouched():
    params = _params()
    with DistributedGradReducer(params, skip=[False, True, False]) as reducer:
        grads = _grads(WORLD)
        reducer(grads)
        np.testing.assert_array_equal(grads[1], rank_value(WORLD, 1.0))
        np.testing.assert_allclose(grads[0], (WORLD.Get_size() - 1) / 2 + 1.0)
        grads[1] = None  # anything may stand in a skipped slot
        reducer(grads)


def test_validate_first_checks_only_the_first_call():
    with DistributedGradReducer(_params(), validate="first") as reducer:
        reducer(_grads(WORLD))
        g = _grads(WORLD)
        reducer(g)
        np.testing.assert_allclose(g[0], (WORLD.Get_size() - 1) / 2 + 1.0)
        g = _grads(WORLD)
        g[1] = np.zeros(5, np.float32)  # on every rank: raises locally everywhere, no hang
        with pytest.raises(ValueError, match=r"grads\[1\]: expected shape"):
            reducer(g)


def test_reducer_uses_its_own_communicator():
    with DistributedGradReducer(_params()) as reducer:
        assert reducer.comm != WORLD
        assert MPI.Comm.Compare(reducer.comm, WORLD) == MPI.CONGRUENT


def test_a_bucket_view_listed_twice_is_caught():
    with DistributedGradReducer([np.zeros(4, np.float32), np.zeros(4, np.float32)]) as reducer:
        grads = reducer.allocate_grads()
        reducer(grads)
        with pytest.raises(ValueError, match=r"grads\[0\] and grads\[1\] share memory"):
            reducer([grads[0], grads[0]])
        with pytest.raises(ValueError, match=r"grads\[0\] and grads\[1\] share memory"):
            reducer([grads[1], grads[1]])


def test_arrays_over_foreign_buffers_are_accepted():
    raw = [bytearray(4 * 6), bytearray(4 * 4), bytearray(4 * 8)]
    grads = [np.frombuffer(b, np.float32).reshape(s) for b, s in zip(raw, SHAPES, strict=True)]
    for g in grads:
        g[...] = rank_value(WORLD, 1.0)
    with DistributedGradReducer(_params()) as reducer:
        reducer(grads)
        np.testing.assert_allclose(grads[2], (WORLD.Get_size() - 1) / 2 + 1.0)


@pytest.mark.parametrize("kind", [ValueError, TypeError, RuntimeError, NotImplementedError, OverflowError, KeyError])
def test_an_error_on_one_rank_reaches_every_rank_as_its_own_type(kind):
    """The core's agreement: the last rank's error, of each kind that travels as itself (a ``KeyError``
    arrives as a ``RuntimeError``), with its message and rank, on every rank."""
    from mpi_gradreducer._core import agreement

    last = WORLD.Get_size() - 1
    expected = kind if kind in agreement.KINDS else RuntimeError
    assert type(agreement.exception_of(kind.__name__, "m")) is expected
    error = kind("bad input here") if WORLD.Get_rank() == last else None
    with pytest.raises(Exception) as caught:
        agreement.raise_if_any(WORLD, error)
    if WORLD.Get_size() == 1:  # alone: the error itself
        assert caught.value is error
        return
    assert type(caught.value) is expected and re.search(rf"rank {last}: .*bad input here", str(caught.value))
