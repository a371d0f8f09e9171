"""Property tests: for any plan, views and dtypes, the reducer agrees with an independent reference.

Hypothesis draws lists of parameters (0-d, zero-size, strided, transposed and
reversed views, every supported dtype, now and then one large enough to be
reduced in place or in several chunks), how the gradients are stored, the
fusion settings, the bucket cap, ``mean``/``degree``, ``skip``, the group and
``check_finite``. Rank r writes small multiples of a quarter times ``r + 1``
(sums of such values are exact in every dtype's summation type). The
reference gathers every rank's input as complex128 with a buffer-based
``Allgather``, sums, scales and casts to the dtype. The results must match it
(exactly when nothing is scaled, else within a few ulps), be bitwise the same
on every rank of the group, leave skipped gradients and the memory around the
views untouched, and report non-finite input on every rank.

Every rank must run the same examples in the same order, yet Hypothesis runs
independently in each process. So it runs derandomized, with no database and
no time-dependent behaviour (no deadline, no health checks, no search for
further bugs after the first), and each example starts by checking that all
ranks drew the same one: if not, the job aborts with both examples. Every
check ends in a verdict agreed by all ranks, so that they pass or fail each
example together and shrink in step; a timer aborts the job if an example
hangs.

Run with ``mpiexec -n 4 python -m pytest --only-mpi tests/test_properties.py``
(and at size 1 with ``--with-mpi``).
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import event, example, given, strategies as st
from mpi4py import MPI

from conftest import WORLD, agree_on_failures, lockstep_settings
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core.dtypes import supported_dtypes

pytestmark = pytest.mark.mpi

DTYPES = supported_dtypes()
LAYOUTS = ("contiguous", "transposed", "strided", "reversed")
STORAGES = ("separate", "shared", "bucket-order", "allocated")
GROUPS = ("world", "dup", "split", "self")
#: An example that takes longer than this on any rank aborts the job.
EXAMPLE_SECONDS = 60.0

IN_STEP = lockstep_settings(60)


@dataclass(frozen=True)
class Param:
    """One parameter, and how its gradient is laid out in memory."""

    shape: tuple[int, ...]
    dtype: np.dtype
    layout: str


@dataclass(frozen=True)
class Case:
    """One example: a model, the reducer's options, and where the gradients live."""

    params: tuple[Param, ...]
    storage: str
    fusion: tuple
    bucket_bytes: int
    mean: bool
    degree: int | None
    skip: tuple[bool, ...] | None
    group: str
    check_finite: bool
    poison: tuple[int, int, int] | None  # (world rank, parameter, element) set to inf on the first call
    seed: int


small_params = st.builds(
    Param,
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.sampled_from(LAYOUTS),
)
large_params = st.builds(  # beyond the reducer's 256 KiB direct threshold; 1.2 MB and more: several chunks
    Param,
    st.sampled_from([(70_000,), (300, 1000)]),
    st.sampled_from(DTYPES),
    st.sampled_from(LAYOUTS),
)


@st.composite
def cases(draw: Callable) -> Case:
    params = draw(st.lists(small_params, min_size=1, max_size=8))
    if draw(st.integers(0, 4)) == 4:
        params.insert(draw(st.integers(0, len(params))), draw(large_params))
    n = len(params)
    fusion = draw(st.one_of(
        st.tuples(st.just("type"), st.integers(0, 2)),
        st.tuples(st.just("list"), st.lists(st.integers(0, 3), min_size=n, max_size=n).map(tuple)),
        st.tuples(st.just("split"), st.sets(st.integers(0, n - 1)).map(lambda s: tuple(sorted(s)))),
    ))
    check_finite = draw(st.booleans())
    return Case(
        params=tuple(params),
        storage=draw(st.sampled_from(STORAGES)),
        fusion=fusion,
        bucket_bytes=draw(st.sampled_from([4 << 20, 1, 24, 100, 4096])),
        mean=draw(st.booleans()),
        degree=draw(st.sampled_from([None, 1, 3, 8])),
        skip=draw(st.none() | st.lists(st.booleans(), min_size=n, max_size=n).map(tuple)),
        group=draw(st.sampled_from(GROUPS)),
        check_finite=check_finite,
        poison=draw(st.none() | st.tuples(st.integers(0, 7), st.integers(0, n - 1), st.integers(0, 10**6)))
        if check_finite else None,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _p(shape: tuple[int, ...], dtype: str, layout: str = "contiguous") -> Param:
    return Param(shape, np.dtype(dtype), layout)


def _every_group_mean_and_degree(test: Callable[..., None]) -> Callable[..., None]:
    """An example for each group, mean and degree: a divisor taken from the wrong communicator shows."""
    for group in GROUPS:
        for mean in (True, False):
            for degree in (None, 3):
                test = example(case=Case(
                    params=(_p((3,), "float32"), _p((2, 2), "float64")), storage="separate", fusion=("type", 1),
                    bucket_bytes=4 << 20, mean=mean, degree=degree, skip=None, group=group, check_finite=False,
                    poison=None, seed=10,
                ))(test)
    return test


@IN_STEP
@given(case=cases())
@_every_group_mean_and_degree
@example(case=Case(  # a large gradient reduced in place, poisoned on rank 1
    params=(_p((3,), "float32"), _p((70_000,), "float32"), _p((2, 3), "float32", "strided")),
    storage="separate", fusion=("type", 1), bucket_bytes=4 << 20, mean=True, degree=None, skip=None,
    group="world", check_finite=True, poison=(1, 1, 12_345), seed=1,
))
@example(case=Case(  # a large transposed gradient packed and reduced in several chunks, half precision
    params=(_p((300, 1000), "float64", "transposed"), _p((3, 4), "float16"), _p((0,), "float16"),
            _p((), "complex64"), _p((2, 2), "float16", "reversed")),
    storage="shared", fusion=("split", (0, 2)), bucket_bytes=24, mean=True, degree=3,
    skip=(False, False, False, True, False), group="split", check_finite=False, poison=None, seed=2,
))
@example(case=Case(  # gradients that are views into the fusion buffers
    params=(_p((300, 1000), "complex64"), _p((5,), "float32"), _p((7, 2), "float32"), _p((4,), "float16"),
            _p((2, 1, 3), "float32")),
    storage="allocated", fusion=("list", (0, 1, 1, 1, 2)), bucket_bytes=4096, mean=False, degree=None,
    skip=None, group="self", check_finite=True, poison=(3, 4, 2), seed=3,
))
@example(case=Case(  # fused gradients lying back to back in one array: reduced where they lie
    params=(_p((3,), "float32"), _p((2, 2), "float64"), _p((2, 2), "float32"), _p((), "float64"),
            _p((5,), "float32")),
    storage="bucket-order", fusion=("type", 1), bucket_bytes=4 << 20, mean=True, degree=None, skip=None,
    group="world", check_finite=False, poison=None, seed=4,
))
def test_reduction_equals_the_reference_on_every_rank(case: Case):
    event(f"storage: {case.storage}, group: {case.group}, fusion: {case.fusion[0]}")
    event(f"large parameter: {any(np.prod(p.shape) >= 70_000 for p in case.params)}")
    _in_step(case, _check)


# -- keeping the ranks in step -----------------------------------------------------------


def _in_step(case: Case, body: Callable[[Case], list[str]]) -> None:
    """Run ``body`` on every rank; raise the same AssertionError on every rank if any failed."""
    timer = threading.Timer(EXAMPLE_SECONDS, _abort, args=(f"the example did not finish within "
                                                           f"{EXAMPLE_SECONDS:g} s", case))
    timer.daemon = True
    timer.start()
    try:
        _same_example_everywhere(case)
        try:
            failures = body(case)
        except Exception as exc:  # noqa: BLE001 - recorded, then agreed on by every rank
            failures = [f"{type(exc).__name__}: {exc}"]
        agree_on_failures(failures)
    finally:
        timer.cancel()


def _same_example_everywhere(case: Case) -> None:
    mine = np.frombuffer(hashlib.sha256(repr(case).encode()).digest(), dtype=np.uint8).copy()
    root = mine.copy()
    WORLD.Bcast(root, root=0)
    same = np.array([int(np.array_equal(root, mine))], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, same, op=MPI.MIN)
    if not same[0]:
        _abort("the ranks drew different examples (Hypothesis is out of step)", case)


def _abort(why: str, case: Case) -> None:
    sys.stderr.write(f"\n=== rank {WORLD.Get_rank()}: {why}; aborting the job. This rank's example: {case!r}\n")
    sys.stderr.flush()
    WORLD.Abort(1)


# -- one example -------------------------------------------------------------------------


def _check(case: Case) -> list[str]:
    rank = WORLD.Get_rank()
    if case.group == "world":
        comm = WORLD
    elif case.group == "dup":
        comm = WORLD.Dup()
    elif case.group == "split":
        comm = WORLD.Split(rank % 2, rank)
    else:
        comm = MPI.COMM_SELF
    try:
        return _reduce_and_compare(case, comm)
    finally:
        if case.group in ("dup", "split"):
            comm.Free()


def _reduce_and_compare(case: Case, comm: MPI.Intracomm) -> list[str]:
    params = [np.zeros(p.shape, p.dtype) for p in case.params]
    options = dict(mean=case.mean, degree=case.degree, group=comm, bucket_bytes=case.bucket_bytes,
                   skip=case.skip, check_finite=case.check_finite, timeout=EXAMPLE_SECONDS)
    kind, value = case.fusion
    if kind == "type":
        options["fusion_type"] = value
    elif kind == "list":
        options["fusion"] = list(value)
    else:
        options["split_indices"] = list(value)
    skipped = case.skip or (False,) * len(params)
    degree = case.degree or comm.Get_size()
    scale = 1.0 / degree if case.mean else 1.0
    failures: list[str] = []
    with DistributedGradReducer(params, **options) as reducer:
        failures += _plan_failures(case, reducer)
        if case.storage == "allocated":
            grads = reducer.allocate_grads()
            storage: list[tuple[np.ndarray, np.ndarray]] = []
        else:
            order = list(range(len(params)))
            if case.storage == "bucket-order":
                order = [i for b in reducer.buckets for i in b.indices]
                order += [i for i in range(len(params)) if i not in order]
            grads, storage = _gradients(case, order)
        for call in (0, 1):
            _fill(case, grads, call)
            before = [g.copy() for g in grads]
            around = [s[~m].tobytes() for s, m in storage]
            reducer(grads)
            expected, any_nonfinite = _reference(comm, before, skipped, scale)
            for i, (g, b, e) in enumerate(zip(grads, before, expected, strict=True)):
                if e is None:
                    if g.tobytes() != b.tobytes():
                        failures.append(f"call {call}: skipped grads[{i}] was modified")
                else:
                    failures += _value_failures(f"call {call}: grads[{i}]", g, e, exact=scale == 1.0)
            if any(s[~m].tobytes() != a for (s, m), a in zip(storage, around, strict=True)):
                failures.append(f"call {call}: memory around the gradient views was modified")
            if case.check_finite and reducer.nonfinite != any_nonfinite:
                failures.append(f"call {call}: nonfinite is {reducer.nonfinite}, expected {any_nonfinite}")
            if not _same_bytes_in_group(comm, [g for g, s in zip(grads, skipped, strict=True) if not s]):
                failures.append(f"call {call}: the results differ between the ranks of the group")
    return failures


def _gradients(case: Case, order: list[int]) -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Gradient views, and (storage, mask of the elements the views cover) for each storage array.

    ``separate``: each gradient is a view (see LAYOUTS) of an array of its own.
    Otherwise the gradients of each dtype lie back to back in one array, in
    ``order`` (parameter order, or the plan's bucket order).
    """
    if case.storage == "separate":
        grads, storage = [], []
        for p in case.params:
            outer, view = _layout(p.shape, p.layout)
            s = np.full(outer, 1234.5, dtype=p.dtype)
            mask = np.zeros(outer, dtype=bool)
            view(mask)[...] = True
            grads.append(view(s))
            storage.append((s, mask))
        return grads, storage
    grads = [None] * len(case.params)
    storage = []
    for dtype in dict.fromkeys(p.dtype for p in case.params):
        members = [i for i in order if case.params[i].dtype == dtype]
        sizes = [int(np.prod(case.params[i].shape, dtype=np.int64)) for i in members]
        s = np.full(sum(sizes) + 2, 1234.5, dtype=dtype)
        mask = np.ones(s.shape, dtype=bool)
        mask[[0, -1]] = False
        offset = 1
        for i, n in zip(members, sizes, strict=True):
            grads[i] = s[offset: offset + n].reshape(case.params[i].shape)
            offset += n
        storage.append((s, mask))
    return grads, storage


def _layout(shape: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], Callable[[np.ndarray], np.ndarray]]:
    """The shape of the array to allocate, and the view of it that has ``shape``."""
    if layout == "transposed" and len(shape) >= 2:
        return shape[::-1], lambda a: a.T
    if layout == "strided" and len(shape) >= 1:
        return shape[:-1] + (2 * shape[-1] + 1,), lambda a: a[..., 1::2]
    if layout == "reversed" and len(shape) >= 1:
        return shape, lambda a: a[::-1]
    return shape, lambda a: a


def _fill(case: Case, grads: list[np.ndarray], call: int) -> None:
    """Rank r writes quarters in [-8, 8] times r + 1; one inf where the example poisons."""
    rank = WORLD.Get_rank()
    for i, g in enumerate(grads):
        rng = np.random.default_rng([case.seed, call, rank, i])
        values = rng.integers(-32, 33, size=g.shape) / 4 * (rank + 1)
        if g.dtype.kind == "c":
            values = values + 1j * rng.integers(-32, 33, size=g.shape) / 4 * (rank + 1)
        g[...] = values.astype(g.dtype)
    if case.poison is not None and call == 0:
        who, i, element = case.poison
        if rank == who % WORLD.Get_size() and grads[i].size:
            grads[i][np.unravel_index(element % grads[i].size, grads[i].shape)] = np.inf


def _reference(comm: MPI.Intracomm, inputs: list[np.ndarray], skipped, scale: float):
    """Each gradient's expected result (None when skipped), and whether any rank's input was non-finite."""
    mine = [_c128(a).reshape(-1) for a, s in zip(inputs, skipped, strict=True) if not s]
    mine = np.concatenate(mine) if mine else np.zeros(0, np.complex128)
    gathered = np.empty((comm.Get_size(), mine.size), dtype=np.complex128)
    comm.Allgather(mine, gathered)
    with np.errstate(invalid="ignore"):  # inf * (scale + 0j) has a NaN part: non-finite either way
        total = gathered.sum(axis=0) * scale
    expected, offset = [], 0
    for a, s in zip(inputs, skipped, strict=True):
        if s:
            expected.append(None)
            continue
        part = total[offset: offset + a.size].reshape(a.shape)
        offset += a.size
        expected.append(part.astype(a.dtype) if a.dtype.kind == "c" else part.real.astype(a.dtype))
    return expected, not bool(np.isfinite(gathered).all())


def _c128(a: np.ndarray) -> np.ndarray:
    return a.astype(np.complex128) if a.dtype.kind == "c" else a.astype(np.float64).astype(np.complex128)


def _eps(dtype: np.dtype) -> float:
    if dtype.name == "bfloat16":
        return 2.0**-7  # 8 significant bits
    return float(np.finfo(dtype).eps)


def _value_failures(name: str, got: np.ndarray, want: np.ndarray, exact: bool) -> list[str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{name}: got {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"]
    g, w = _c128(got), _c128(want)
    finite = np.isfinite(w)
    if np.isfinite(g[~finite]).any():
        return [f"{name}: a result is finite where some rank's input was not"]
    if exact:
        bad = g[finite] != w[finite]
    else:
        bad = np.abs(g[finite] - w[finite]) > 4 * _eps(got.dtype) * np.abs(w[finite])
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        return [f"{name} ({got.dtype}, {'exact' if exact else 'scaled'}): {int(bad.sum())} of {bad.size} "
                f"elements differ from the reference, e.g. {g[finite][k]} instead of {w[finite][k]}"]
    return []


def _same_bytes_in_group(comm: MPI.Intracomm, arrays: list[np.ndarray]) -> bool:
    mine = np.frombuffer(b"".join(a.tobytes() for a in arrays), dtype=np.uint8).copy()
    root = mine.copy()
    comm.Bcast(root, root=0)
    same = np.array([int(np.array_equal(root, mine))], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, same, op=MPI.MIN)
    return bool(same[0])


def _plan_failures(case: Case, reducer: DistributedGradReducer) -> list[str]:
    """The plan, checked against the documented rules, with fusion ids resolved independently."""
    n = len(case.params)
    kind, value = case.fusion
    if kind == "type":
        ids = [value] * n
    elif kind == "list":
        ids = list(value)
    else:
        ids = [1 + sum(end < i for end in value) for i in range(n)]
    skipped = case.skip or (False,) * n
    failures = []
    placed = [i for b in reducer.buckets for i in b.indices]
    wanted = [i for i, p in enumerate(case.params) if not skipped[i] and int(np.prod(p.shape)) > 0]
    if sorted(placed) != wanted:
        failures.append(f"plan: buckets hold parameters {placed}, expected each of {wanted} once")
    for b in reducer.buckets:
        members = [case.params[i] for i in b.indices if i < n]
        if {p.dtype for p in members} != {b.dtype} or {ids[i] for i in b.indices if i < n} != {b.fusion_id}:
            failures.append(f"plan: {b!r} mixes dtypes or fusion ids")
        if b.wire_dtype != b.dtype:  # host halves travel as 16 bits too (summed slice by slice in float32)
            failures.append(f"plan: {b!r} travels as {b.wire_dtype}")
        if len(b.indices) > 1 and (b.fusion_id == 0 or b.nbytes > case.bucket_bytes):
            failures.append(f"plan: {b!r} fuses parameters with fusion id 0 or beyond the cap")
    return failures
