"""Validation is total: whatever one rank passes, every rank raises the same error, and nothing moves.

A property test gives one rank an odd object, in one slot of the gradient
list or as the whole list, while the others pass good gradients: strings,
containers, scalars, arrays of the wrong kind, shape or dtype, read-only or
aliasing arrays, torch tensors that cannot be exported, malformed
``RowSparse`` objects, and objects whose protocols raise. The slot is any of
the plan's kinds of position: the first (carrier) bucket, a large tensor
reduced alone, a fused bucket, a skipped slot (where anything goes) and a
``RowSparse`` slot. Each example requires:

- every rank raises the same exception type, its message starting with
  ``rank R:`` for the bad rank R (at more than one rank) and naming the slot;
- no caller array on any rank was modified;
- the reducer is usable afterwards: a good call gives the mean on every rank.

Some odd objects are valid (non-contiguous views, ``np.matrix``, torch
tensors, anything in a skipped slot): their call must then succeed with the
mean written into their memory.

Every rank draws the same examples (derandomized Hypothesis, no database);
each example's verdict is agreed by all ranks before it passes or fails, so
that they pass, fail and shrink in step.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, strategies as st
from mpi4py import MPI

from conftest import WORLD, agree_on_failures, everywhere, lockstep_settings
from mpi_gradreducer import DistributedGradReducer, RowSparse

pytestmark = pytest.mark.mpi

#: The parameters, by role; ``large`` is reduced alone (>= 1 MiB), ``skipped`` is never looked at.
ROLES = ("small", "matrix", "skipped", "sparse", "scalar", "large")
SHAPES = {"small": (3,), "matrix": (2, 3), "skipped": (4, 2), "sparse": (6, 3), "scalar": (), "large": (512, 513)}
#: ``large-last``: the large tensor is the first bucket (and carries the call header);
#: ``large-first``: the fused small bucket does, and the large tensor follows.
LAYOUTS = ("large-last", "large-first")

IN_STEP = lockstep_settings(25)



def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        torch = None
    return torch if everywhere(torch is not None) else None


TORCH = _import_torch()


# -- odd objects ---------------------------------------------------------------------------


class RaisingLen:
    """An object whose ``__len__`` raises."""

    def __len__(self) -> int:
        raise RuntimeError("__len__ refuses")


class RaisingGetitem:
    """A sequence-like object whose ``__getitem__`` raises (and so does iterating it)."""

    def __len__(self) -> int:
        return len(ROLES)

    def __getitem__(self, i: int) -> Any:
        raise TypeError("__getitem__ refuses")


class RaisingArray:
    """An object whose ``__array__`` raises."""

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise RuntimeError("__array__ refuses")


class RaisingDLPack:
    """An object whose ``__dlpack__`` and ``__dlpack_device__`` raise."""

    shape = (3,)
    dtype = np.float32

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("__dlpack__ refuses")

    def __dlpack_device__(self) -> tuple[int, int]:
        raise RuntimeError("__dlpack_device__ refuses")


class RaisingInterface:
    """An object whose ``__array_interface__`` property raises something other than AttributeError."""

    @property
    def __array_interface__(self) -> dict:
        raise RuntimeError("__array_interface__ refuses")


class CopyingArray:
    """An object whose ``__array__`` returns a fresh copy: results could not land in it."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.zeros(self.shape, np.float32)


def _gen(shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    yield np.zeros(shape, np.float32)


#: Kinds of odd object for one slot: name -> whether it is valid there (None: depends on the slot).
ELEMENT_KINDS = (
    "str", "bytes", "dict", "list", "nested-list", "tuple", "int", "float", "complex", "numpy-scalar",
    "zero-d", "object-array", "structured-array", "int-array", "bool-array", "wrong-ndim", "wrong-shape",
    "wrong-dtype", "read-only", "alias", "generator", "set", "torch-requires-grad", "torch-float64",
    "torch-meta", "rowsparse-bad-index", "rowsparse-bad-shape", "rowsparse-bad-dtype", "rowsparse-not-arrays",
    "raising-len", "raising-getitem", "raising-array", "raising-dlpack", "raising-interface", "copying-array",
    "frozen-buffer",
    # valid where a dense gradient goes:
    "strided-view", "numpy-matrix", "masked-array", "torch-float32",
)
VALID_DENSE = {"strided-view", "numpy-matrix", "masked-array", "torch-float32"}
#: Kinds that replace the whole ``grads`` argument.
WHOLE_KINDS = ("int", "float", "dict", "str", "bytes", "set", "short-list", "long-list", "tuple-with-none",
               "tuple-with-rowsparse", "generator-short", "raising-len-list", "raising-getitem", "array")


@dataclass(frozen=True)
class Case:
    """One example: where the odd object goes, what it is, and on which rank."""

    layout: str
    whole: bool
    role: str
    kind: str
    bad: int  # taken modulo the number of ranks
    seed: int


def _element(kind: str, role: str, grads: list[Any], slot: dict[str, int], rng: np.random.Generator) -> Any:
    """The odd object ``kind`` for the slot of ``role`` (it may rewrite other slots of ``grads``)."""
    shape = SHAPES[role]
    size = int(np.prod(shape, dtype=np.int64))
    values = rng.standard_normal(shape).astype(np.float32)
    if kind in VALID_DENSE:  # a good gradient in an odd form: rank r writes r + 1, as the others
        values[...] = WORLD.Get_rank() + 1.0
    if kind == "str":
        return "gradient"
    if kind == "bytes":
        return bytes(4 * size)
    if kind == "dict":
        return {"grad": values}
    if kind == "list":
        return [0.5] * size
    if kind == "nested-list":
        return values.tolist()
    if kind == "tuple":
        return tuple(values.reshape(-1).tolist())
    if kind == "int":
        return 3
    if kind == "float":
        return 0.25
    if kind == "complex":
        return 1 + 2j
    if kind == "numpy-scalar":
        return np.float32(0.5)
    if kind == "zero-d":
        return np.zeros((1,) if shape == () else (), np.float32)
    if kind == "object-array":
        return np.empty(shape, dtype=object)
    if kind == "structured-array":
        return np.zeros(shape, dtype=[("a", np.float32)])
    if kind == "int-array":
        return np.zeros(shape, np.int32)
    if kind == "bool-array":
        return np.zeros(shape, bool)
    if kind == "wrong-ndim":
        return np.zeros(shape + (1,), np.float32)
    if kind == "wrong-shape":
        return np.zeros((size + 1,), np.float32)
    if kind == "wrong-dtype":
        return values.astype(np.float64)
    if kind == "read-only":
        values.setflags(write=False)
        return values
    if kind == "alias":  # a view over the memory of another gradient of the list
        if role == "large":
            grads[slot["small"]] = grads[slot["large"]].reshape(-1)[:3]
            return grads[slot["large"]]
        return grads[slot["large"]].reshape(-1)[:size].reshape(shape)
    if kind == "generator":
        return _gen(shape)
    if kind == "set":
        return {1.0, 2.0}
    if kind.startswith("torch-") and TORCH is None:
        return "torch is not installed"  # the same fallback on every rank
    if kind == "torch-requires-grad":
        return TORCH.zeros(shape, requires_grad=True)
    if kind == "torch-float64":
        return TORCH.zeros(shape, dtype=TORCH.float64)
    if kind == "torch-meta":
        return TORCH.empty(shape, device="meta")
    if kind == "torch-float32":
        return TORCH.from_numpy(values)
    if kind == "rowsparse-bad-index":
        rows = (SHAPES["sparse"][0], *SHAPES["sparse"][1:])
        return RowSparse(np.array([0, rows[0]]), np.zeros((2, *rows[1:]), np.float32), rows, validate=False)
    if kind == "rowsparse-bad-shape":
        return RowSparse(np.array([0]), np.zeros((1, 7), np.float32), (6, 7))
    if kind == "rowsparse-bad-dtype":
        return RowSparse(np.array([0]), np.zeros((1, 3), np.float64), (6, 3))
    if kind == "rowsparse-not-arrays":
        return RowSparse([0, 1], [[0.0] * 3] * 2, (6, 3), validate=False)
    if kind == "raising-len":
        return RaisingLen()
    if kind == "raising-getitem":
        return RaisingGetitem()
    if kind == "raising-array":
        return RaisingArray()
    if kind == "raising-dlpack":
        return RaisingDLPack()
    if kind == "raising-interface":
        return RaisingInterface()
    if kind == "copying-array":
        return CopyingArray(shape)
    if kind == "frozen-buffer":  # over immutable bytes: not writeable
        return np.frombuffer(values.tobytes(), np.float32).reshape(shape)
    if kind == "strided-view":
        outer = np.zeros(shape + (2,), np.float32)
        view = outer[..., 1]
        view[...] = values
        return view
    if kind == "numpy-matrix":
        return np.asmatrix(values) if len(shape) == 2 else values[...]
    if kind == "masked-array":
        return np.ma.masked_array(values)
    raise AssertionError(f"unknown kind {kind}")


def _whole(kind: str, grads: list[Any]) -> Any:
    """The odd object ``kind`` standing for the whole ``grads`` argument."""
    if kind == "int":
        return 7
    if kind == "float":
        return 1.5
    if kind == "dict":
        return dict(enumerate(grads))
    if kind == "str":
        return "x" * len(grads)
    if kind == "bytes":
        return bytes(len(grads))
    if kind == "set":
        return {1, 2, 3, 4, 5, 6}
    if kind == "short-list":
        return grads[:-1]
    if kind == "long-list":
        return grads + [np.zeros(3, np.float32)]
    if kind == "tuple-with-none":
        return tuple(None if i == 0 else g for i, g in enumerate(grads))
    if kind == "tuple-with-rowsparse":
        return tuple(grads)
    if kind == "generator-short":
        return (g for g in grads[:-2])
    if kind == "raising-len-list":
        class Listish(list):
            def __len__(self) -> int:
                raise RuntimeError("__len__ refuses")
        return Listish(grads)
    if kind == "raising-getitem":
        return RaisingGetitem()
    if kind == "array":
        return np.zeros((len(grads), 3), np.float32)
    raise AssertionError(f"unknown kind {kind}")


@st.composite
def cases(draw: Callable) -> Case:
    whole = draw(st.integers(0, 4)) == 0
    return Case(
        layout=draw(st.sampled_from(LAYOUTS)),
        whole=whole,
        role=draw(st.sampled_from(ROLES)),
        kind=draw(st.sampled_from(WHOLE_KINDS if whole else ELEMENT_KINDS)),
        bad=draw(st.integers(0, 7)),
        seed=draw(st.integers(0, 2**16)),
    )


# -- the reducers, built once --------------------------------------------------------------


@pytest.fixture(scope="module")
def reducers() -> Iterator[dict[str, tuple[DistributedGradReducer, dict[str, int]]]]:
    """One reducer per layout, with the slot of each role."""
    built = {}
    for layout in LAYOUTS:
        roles = ROLES if layout == "large-last" else ROLES[::-1]
        slot = {role: i for i, role in enumerate(roles)}
        params = [np.zeros(SHAPES[r], np.float32) for r in roles]
        reducer = DistributedGradReducer(params, skip=[r == "skipped" for r in roles], timeout=120,
                                         stall_warning=None)
        built[layout] = (reducer, slot)
    yield built
    for reducer, _ in built.values():
        reducer.free()


def _good(slot: dict[str, int], k: float) -> list[Any]:
    """Good gradients: rank r writes r + k, and one row r % 6 of r + k in the RowSparse slot."""
    r = WORLD.Get_rank()
    grads: list[Any] = [None] * len(slot)
    for role, i in slot.items():
        if role == "sparse":
            shape = SHAPES[role]
            grads[i] = RowSparse(np.array([r % shape[0]]), np.full((1, *shape[1:]), r + k, np.float32), shape)
        else:
            grads[i] = np.full(SHAPES[role], r + k, np.float32)
    return grads


def _expected_sparse(k: float) -> np.ndarray:
    """The mean of every rank's RowSparse contribution, densified."""
    size = WORLD.Get_size()
    dense = np.zeros(SHAPES["sparse"], np.float64)
    for r in range(size):
        dense[r % SHAPES["sparse"][0]] += r + k
    return dense / size


def _snapshot(obj: Any) -> list[tuple[Any, bytes]]:
    """The bytes of every array reachable in ``obj`` (a list, tuple, RowSparse, array or tensor)."""
    if isinstance(obj, (list, tuple)):
        return [s for item in obj for s in _snapshot(item)]
    if isinstance(obj, RowSparse):
        return _snapshot(obj.indices) + _snapshot(obj.values)
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        return [(obj, np.ascontiguousarray(obj).tobytes())]
    if TORCH is not None and isinstance(obj, TORCH.Tensor) and obj.device.type == "cpu":
        return [(obj, obj.detach().contiguous().numpy().tobytes())]
    return []


def _changed(snapshot: list[tuple[Any, bytes]]) -> bool:
    for obj, data in snapshot:
        now = _snapshot(obj)[0][1]
        if now != data:
            return True
    return False


# -- the property ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@IN_STEP
@given(case=cases())
@example(case=Case("large-last", False, "large", "raising-interface", 1, 0))  # the carrier, by protocol
@example(case=Case("large-last", False, "large", "numpy-matrix", 1, 0))  # a matrix as the carrier, in place
@example(case=Case("large-first", False, "small", "alias", 3, 0))
@example(case=Case("large-last", False, "matrix", "torch-requires-grad", 2, 0))
@example(case=Case("large-last", False, "sparse", "rowsparse-bad-index", 1, 0))
@example(case=Case("large-first", False, "skipped", "raising-len", 0, 0))
@example(case=Case("large-last", False, "scalar", "numpy-scalar", 1, 0))
@example(case=Case("large-first", True, "small", "tuple-with-none", 1, 0))
@example(case=Case("large-last", True, "small", "raising-len-list", 2, 0))
def test_odd_input_on_one_rank_raises_everywhere_and_moves_nothing(
        reducers: dict[str, tuple[DistributedGradReducer, dict[str, int]]], case: Case) -> None:
    _in_step(case, lambda: _check(case, *reducers[case.layout]))


def _check(case: Case, reducer: DistributedGradReducer, slot: dict[str, int]) -> list[str]:
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    bad = case.bad % size
    rng = np.random.default_rng(case.seed)  # the same object on every rank
    grads: Any = _good(slot, 1.0)
    target = slot[case.role]
    valid = False
    if rank == bad:
        if case.whole:
            grads = _whole(case.kind, grads)
        else:
            grads[target] = _element(case.kind, case.role, grads, slot, rng)
            valid = case.role == "skipped" or (case.kind in VALID_DENSE and case.role != "sparse")
    expect_valid = not everywhere(not valid)  # what the bad rank knows, on every rank
    kept = grads[target] if (rank == bad and not case.whole) else None
    before = _snapshot(grads)
    failures: list[str] = []
    outcome: BaseException | None = None
    try:
        result = reducer(grads)
    except (ValueError, TypeError, RuntimeError) as exc:
        outcome = exc
    code = -1 if outcome is None else (ValueError, TypeError, RuntimeError).index(type(outcome))
    codes = np.zeros(size, dtype=np.int64)
    WORLD.Allgather(np.array([code], dtype=np.int64), codes)
    if len(set(codes.tolist())) != 1:
        failures.append(f"the ranks ended differently: {codes.tolist()} (-1: no error; else "
                        f"ValueError, TypeError, RuntimeError); here: {outcome!r}")
    elif expect_valid:
        if outcome is not None:
            failures.append(f"a valid call raised {outcome!r}")
        else:
            failures += _result_failures(result, slot, 1.0, skipped_as=kept if case.role == "skipped" else None)
            if rank == bad and case.role != "skipped":
                mine = np.asarray(kept.numpy() if TORCH is not None and isinstance(kept, TORCH.Tensor) else kept)
                if not np.allclose(mine, (size - 1) / 2 + 1.0):
                    failures.append(f"the mean did not land in the caller's {case.kind} object")
    else:
        if outcome is None:
            failures.append("an odd object was accepted")
        else:
            text = str(outcome)
            if size > 1 and not text.startswith(f"rank {bad}: "):
                failures.append(f"the message does not start with 'rank {bad}: ': {text!r}")
            if not case.whole and f"grads[{target}]" not in text:
                failures.append(f"the message does not name grads[{target}]: {text!r}")
            if case.whole and "grads" not in text:
                failures.append(f"the message does not name grads: {text!r}")
            if _changed(before):
                failures.append("a caller's array was modified by a call that raised")
    # The reducer is usable afterwards, in step on every rank.
    good = _good(slot, 2.0)
    try:
        failures += _result_failures(reducer(good), slot, 2.0)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        failures.append(f"the good call after it raised {exc!r}")
    return failures


def _result_failures(result: list[Any], slot: dict[str, int], k: float, skipped_as: Any = None) -> list[str]:
    """What is wrong with the result of a good call whose ranks wrote r + k."""
    want = (WORLD.Get_size() - 1) / 2 + k
    failures = []
    for role, i in slot.items():
        g = result[i]
        if role == "skipped":
            if skipped_as is None and not np.all(g == WORLD.Get_rank() + k):
                failures.append("the skipped gradient was modified")
        elif role == "sparse":
            if not isinstance(g, RowSparse) or not np.allclose(g.to_dense(), _expected_sparse(k)):
                failures.append(f"grads[{i}] (RowSparse) is not the mean")
        elif not np.allclose(np.asarray(g), want):
            failures.append(f"grads[{i}] ({role}) is not the mean {want}")
    return failures


# -- keeping the ranks in step (as in test_properties) ------------------------------------


def _in_step(case: Case, body: Callable[[], list[str]]) -> None:
    """Run ``body`` on every rank; raise the same AssertionError on every rank if any failed."""
    digest = np.frombuffer(hashlib.sha256(repr(case).encode()).digest(), dtype=np.uint8).copy()
    root = digest.copy()
    WORLD.Bcast(root, root=0)
    if not everywhere(bool(np.array_equal(root, digest))):
        sys.stderr.write(f"\n=== rank {WORLD.Get_rank()}: the ranks drew different examples: {case!r}\n")
        WORLD.Abort(1)
    try:
        failures = body()
    except Exception as exc:  # noqa: BLE001 - recorded, then agreed on by every rank
        failures = [f"{type(exc).__name__}: {exc}"]
    agree_on_failures(failures)


# -- known gaps outside validation (over COMM_SELF: a local raise cannot strand other ranks) --


def _self_reducer() -> DistributedGradReducer:
    return DistributedGradReducer([np.zeros(3, np.float32), np.zeros(2, np.float32)], group=MPI.COMM_SELF)


def test_whole_grads_none_raises():
    with _self_reducer() as reducer:
        with pytest.raises(TypeError, match=r"grads"):
            reducer(None)


def _raising_generator() -> Iterator[np.ndarray]:
    yield np.zeros(3, np.float32)
    raise RuntimeError("the producer failed")


class RaisingItems:
    """A sequence-like object whose items raise ``ValueError`` (iterating it too)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        raise ValueError("no items")


@pytest.mark.parametrize("make", [_raising_generator, RaisingItems], ids=["generator", "getitem"])
def test_iterable_grads_that_raise_are_reported_through_the_agreement(make):
    with _self_reducer() as reducer:
        with pytest.raises(TypeError, match=r"grads"):
            reducer(make())
