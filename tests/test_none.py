"""``None`` gradients: a rank without a gradient for a parameter contributes zeros.

Where every rank passed ``None``, the entry stays ``None``; elsewhere the
returned list holds a new array with the average (the divisor is still the
number of ranks: a ``None`` is a zero, not an absence of the rank). The
other entries are reduced in place as usual. Run at 4 and 3 ranks (and 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks, everywhere
from mpi_gradreducer import DistributedGradReducer, RowSparse

pytestmark = pytest.mark.mpi

#: fused (3,), fused (2, 3), large alone (>= 1 MiB), RowSparse slot (6, 3), float64 (4,)
SHAPES = [(3,), (2, 3), (512, 513), (6, 3), (4,)]
DTYPES = [np.float32, np.float32, np.float32, np.float32, np.float64]



def _reducer(**kwargs: Any) -> DistributedGradReducer:
    params = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES, strict=True)]
    return DistributedGradReducer(params, timeout=120, stall_warning=None, **kwargs)


def _grads(none_at: dict[int, Callable[[int], bool]], sparse: bool = False) -> list[Any]:
    """Rank r writes r + 1; ``none_at[i](r)``: rank r passes None for parameter i."""
    r = WORLD.Get_rank()
    grads: list[Any] = []
    for i, (s, d) in enumerate(zip(SHAPES, DTYPES, strict=True)):
        if i in none_at and none_at[i](r):
            grads.append(None)
        elif sparse and i == 3:
            grads.append(RowSparse(np.array([r % s[0]]), np.full((1, *s[1:]), r + 1, d), s))
        else:
            grads.append(np.full(s, r + 1, d))
    return grads


def _mean(i: int, none_at: dict[int, Callable[[int], bool]]) -> float | None:
    """The expected average of parameter ``i`` (None where every rank passed None)."""
    size = WORLD.Get_size()
    giving = [r for r in range(size) if not (i in none_at and none_at[i](r))]
    return None if not giving else sum(r + 1 for r in giving) / size


def _check(result: list[Any], grads_in: list[Any], none_at: dict[int, Callable[[int], bool]],
           sparse: bool = False) -> None:
    """Every entry of ``result`` is as documented (and bitwise equal on every rank)."""
    assert isinstance(result, list)
    for i, g in enumerate(result):
        want = _mean(i, none_at)
        if want is None:
            assert g is None, f"grads[{i}]: None on every rank must stay None, got {type(g)}"
        elif sparse and i == 3:
            assert isinstance(g, RowSparse)
        else:
            assert type(g) is np.ndarray and g.shape == SHAPES[i] and g.dtype == DTYPES[i], f"grads[{i}]: {g!r:.80}"
            np.testing.assert_allclose(g, want, rtol=1e-6, err_msg=f"grads[{i}]")
            if grads_in[i] is not None:
                assert g is grads_in[i], f"grads[{i}]: a dense gradient must be reduced in place"
    assert_same_on_all_ranks(WORLD, [g for i, g in enumerate(result) if g is not None and not (sparse and i == 3)])


LAST = lambda r: r == WORLD.Get_size() - 1  # noqa: E731
FIRST = lambda r: r == 0  # noqa: E731
ODD = lambda r: r % 2 == 1  # noqa: E731
ALL = lambda r: True  # noqa: E731

PATTERNS = {
    "fused-at-one-rank": {0: LAST},
    "fused-at-odd-ranks": {1: ODD},
    "large-at-first-rank": {2: FIRST},
    "large-at-all-ranks": {2: ALL},
    "fused-at-all-ranks": {0: ALL, 1: ALL},
    "float64-at-all-ranks-and-fused-at-one": {4: ALL, 1: FIRST},
    "everything-at-all-ranks": {i: ALL for i in range(len(SHAPES))},
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_none_contributes_zeros_and_stays_none_only_where_all_ranks_pass_it(pattern):
    none_at = PATTERNS[pattern]
    with _reducer() as reducer:
        for _ in range(2):  # the stand-ins are made afresh, and the plan's buffers reused
            grads = _grads(none_at)
            kept = list(grads)
            result = reducer(grads)
            assert result is grads
            _check(result, kept, none_at)


@pytest.mark.parametrize("pattern", ["fused-at-one-rank", "large-at-first-rank", "fused-at-all-ranks"])
def test_none_with_rowsparse(pattern):
    none_at = PATTERNS[pattern]
    with _reducer() as reducer:
        grads = _grads(none_at, sparse=True)
        kept = list(grads)
        result = reducer(grads)
        _check(result, kept, none_at, sparse=True)
        dense = np.zeros(SHAPES[3])
        for r in range(WORLD.Get_size()):
            dense[r % SHAPES[3][0]] += (r + 1) / WORLD.Get_size()
        np.testing.assert_allclose(result[3].to_dense(), dense)


def test_none_in_the_rowsparse_slot_on_some_ranks_is_a_structural_disagreement_or_zero():
    """A None where the others pass a RowSparse: every rank ends the same way (raise or reduce)."""
    size = WORLD.Get_size()
    with _reducer() as reducer:
        grads = _grads({3: FIRST}, sparse=True)
        outcome = 0
        try:
            reducer(grads)
        except (ValueError, TypeError) as exc:
            outcome = 1
            assert "rank" in str(exc) or size == 1
        codes = np.zeros(size, dtype=np.int64)
        WORLD.Allgather(np.array([outcome], dtype=np.int64), codes)
        assert len(set(codes.tolist())) == 1, f"ranks ended differently: {codes.tolist()}"
        good = _grads({})
        reducer(good)
        np.testing.assert_allclose(good[0], (size + 1) / 2)


@pytest.mark.parametrize("how", ["reduce_async", "begin"])
@pytest.mark.parametrize("pattern", ["fused-at-odd-ranks", "large-at-first-rank", "everything-at-all-ranks"])
def test_none_with_asynchronous_calls(how, pattern):
    none_at = PATTERNS[pattern]
    with _reducer() as reducer:
        grads = _grads(none_at)
        kept = list(grads)
        if how == "reduce_async":
            result = reducer.reduce_async(grads).wait()
        else:
            step = reducer.begin(grads)
            for i in reversed(range(len(SHAPES))):
                step.ready(i)
            result = step.wait()
        _check(result, kept, none_at)


def test_a_tuple_with_none_raises_on_every_rank():
    with _reducer() as reducer:
        grads = _grads({1: LAST})
        if WORLD.Get_rank() == WORLD.Get_size() - 1:
            grads = tuple(grads)
        before = [None if g is None else g.copy() for g in grads]
        with pytest.raises(TypeError, match=r"grads\[1\].*must be a list"):
            reducer(grads)
        for g, b in zip(grads, before, strict=True):
            assert (g is None) == (b is None) and (g is None or np.array_equal(g, b))


@pytest.fixture(scope="module")
def torch():
    """torch on every rank, else skipped on every rank."""
    try:
        import torch as th
    except ImportError:
        th = None
    if not everywhere(th is not None):
        pytest.skip("needs torch on every rank")
    return th


@pytest.mark.parametrize("pattern", ["fused-at-one-rank", "large-at-all-ranks", "fused-at-odd-ranks"])
def test_none_among_torch_tensors(torch, pattern):
    """Host torch parameters: a None entry's average comes back as a numpy array; tensors in place."""
    none_at = PATTERNS[pattern]
    r = WORLD.Get_rank()
    params = [torch.zeros(s, dtype=torch.float64 if d is np.float64 else torch.float32)
              for s, d in zip(SHAPES, DTYPES, strict=True)]
    with DistributedGradReducer(params, timeout=120, stall_warning=None) as reducer:
        grads = [None if i in none_at and none_at[i](r) else torch.full_like(p, r + 1.0) for i, p in enumerate(params)]
        kept = list(grads)
        result = reducer(grads)
        for i, g in enumerate(result):
            want = _mean(i, none_at)
            if want is None:
                assert g is None
            elif kept[i] is None:
                assert type(g) is np.ndarray and g.shape == SHAPES[i] and g.dtype == DTYPES[i]
                np.testing.assert_allclose(g, want, rtol=1e-6)
            else:
                assert g is kept[i]
                np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)


#: A model small enough to travel whole in the call's first message, with the header.
SMALL = [(3,), (2, 3), (4,)]


@pytest.mark.parametrize("who", ["last", "odd"])
def test_none_in_a_model_that_travels_whole_with_the_header(who):
    """Some ranks pass None while the others replay the same arrays (the one-message path of small models)."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    gives_none = (lambda q: q == size - 1) if who == "last" else (lambda q: q % 2 == 1)
    with DistributedGradReducer([np.zeros(s, np.float32) for s in SMALL], timeout=120, stall_warning=None) as reducer:
        assert reducer._ctx.first.whole
        mine = [np.zeros(s, np.float32) for s in SMALL]
        for step in range(5):
            late = step >= 3  # after the arrays were replayed
            grads: list[Any] = [None if late and i == 1 and gives_none(rank) else g for i, g in enumerate(mine)]
            for g in grads:
                if g is not None:
                    g[...] = rank + 1 + step
            result = reducer(grads)
            for i, g in enumerate(result):
                giving = [q for q in range(size) if not (late and i == 1 and gives_none(q))]
                if not giving:
                    assert g is None
                    continue
                assert g is not None and g.shape == SMALL[i], f"step {step}, grads[{i}]: {g!r}"
                np.testing.assert_allclose(g, sum(q + 1 + step for q in giving) / size, rtol=1e-6,
                                           err_msg=f"step {step}, grads[{i}]")
            assert_same_on_all_ranks(WORLD, [g for g in result if g is not None])
