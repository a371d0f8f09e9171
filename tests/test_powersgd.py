"""PowerSGD: every call against an independent computation from all ranks' inputs; state; composition; errors.

The oracle gathers every rank's gradients, errors and the Q that
``state_dict()`` showed before the call, and computes the six steps in
float64 with numpy's QR (not the package's Gram-Schmidt): the orthonormal
basis of P's columns is QR's Q with the signs of R's diagonal.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer import DistributedGradReducer, PowerSGD
from mpi_gradreducer._core.powersgd import draw_q, orthonormalise

SHAPES64 = [(24, 18), (18,), (3, 4), (12, 2, 3, 3)]  # compressed at rank 2: 0 and 3
SHAPES32 = [(20, 30), (30,), (8, 3, 2, 2)]  # compressed at rank 2: 0 and 2
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-3}


def _params(shapes, dtype):
    return [np.zeros(s, dtype=dtype) for s in shapes]


def _grads(rng: np.random.Generator, params):
    return [rng.standard_normal(p.shape).astype(p.dtype) for p in params]


def _gather(a: np.ndarray) -> list[np.ndarray]:
    return WORLD.allgather(np.array(a, copy=True))


def _orthonormal(p: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(p)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1
    return q * signs


def _close(got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    scale = max(float(np.abs(want).max()), 1e-300)
    return float(np.abs(got.astype(np.float64) - want).max()) <= tol * scale


def _oracle(before: dict, inputs: dict[int, list[np.ndarray]], i: int, divisor: float, feedback: bool):
    """(result, {rank: new error}, new Q) of compressed parameter ``i``, in float64.

    ``before`` and ``inputs``: the state before the call and the gradients of each contributing rank.
    """
    shape = next(iter(inputs.values()))[i].shape
    n, m = shape[0], int(np.prod(shape[1:]))
    q = next(iter(before.values()))["q"][i].astype(np.float64)
    ms = {r: (g[i].astype(np.float64) + (before[r]["error"][i] if feedback else 0)).reshape(n, m)
          for r, g in inputs.items()}
    p = _orthonormal(sum(mr @ q for mr in ms.values()))
    q_new = sum(mr.T @ p for mr in ms.values())
    approx = p @ q_new.T
    errors = {r: (mr - approx / len(ms)).reshape(shape) for r, mr in ms.items()}
    return (approx / divisor).reshape(shape), errors, q_new


class Recorder:
    """Calls a reducer and keeps, per call, the state before, the gradients in, the results out, the state after."""

    def __init__(self, reducer: DistributedGradReducer) -> None:
        self.reducer = reducer
        self.calls: dict[int, dict] = {}

    def __call__(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        before = self.reducer.state_dict()
        inputs = [np.array(g, copy=True) for g in grads]
        self.reducer(grads)
        outputs = [np.array(g, copy=True) for g in grads]
        self.calls[before["iteration"]] = dict(before=before, inputs=inputs, outputs=outputs,
                                                after=self.reducer.state_dict())
        return grads


def _verify(rec: Recorder, config: PowerSGD, *, mean: bool = True, degree: int | None = None,
            skip: tuple[int, ...] = ()) -> list[str]:
    """Every rank's every recorded call against the oracle (collective); failures, the same on every rank."""
    everyone = WORLD.allgather(rec.calls)
    failures = []
    for it in sorted({k for calls in everyone for k in calls}):
        active = {r: calls[it] for r, calls in enumerate(everyone) if it in calls}
        divisor = (degree if degree is not None else len(active)) if mean else 1
        first = next(iter(active.values()))
        compressed = set(first["before"]["q"])
        before = {r: c["before"] for r, c in active.items()}
        inputs = {r: c["inputs"] for r, c in active.items()}
        for i, g in enumerate(first["outputs"]):
            tol = TOL[g.dtype]
            if i in skip:
                failures += [f"rank {r}, call {it}: skipped grads[{i}] was modified" for r, c in active.items()
                             if not np.array_equal(c["outputs"][i], c["inputs"][i])]
                continue
            if i in compressed and it >= config.start_iter:
                want, errors, q_new = _oracle(before, inputs, i, divisor, config.error_feedback)
                for r, c in active.items():
                    if not _close(c["outputs"][i], want, tol):
                        failures.append(f"rank {r}, call {it}: grads[{i}] differs from the six steps")
                    if config.error_feedback and not _close(c["after"]["error"][i], errors[r], tol):
                        failures.append(f"rank {r}, call {it}: error[{i}] differs from M - P Q^T / size")
                    if config.warm_start and not _close(c["after"]["q"][i], q_new, tol):
                        failures.append(f"rank {r}, call {it}: q[{i}] is not the summed Q")
            else:
                want = sum(c["inputs"][i].astype(np.float64) for c in active.values()) / divisor
                for r, c in active.items():
                    if not _close(c["outputs"][i], want, tol):
                        failures.append(f"rank {r}, call {it}: grads[{i}] differs from the plain mean")
            for r, c in active.items():
                if i in compressed and it < config.start_iter and c["after"]["error"][i].any():
                    failures.append(f"rank {r}, call {it}: error[{i}] is not zero before start_iter")
                if not np.array_equal(c["outputs"][i], first["outputs"][i]):
                    failures.append(f"rank {r}, call {it}: grads[{i}] is not the same on every rank")
        for r, c in active.items():
            if c["after"]["iteration"] != it + 1:
                failures.append(f"rank {r}: iteration {c['after']['iteration']} after call {it}")
    return failures


def _who(rank: int) -> str:
    """How an error raised on every rank names the failing rank (not at all on one rank)."""
    return f"rank {rank}: " if WORLD.Get_size() > 1 else ""


def _agree(failures: list[str]) -> None:
    assert not failures, "\n".join(failures[:10])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_every_call_matches_the_six_steps(dtype):
    """float16 gradients are compressed in float32 (P, Q and the error), the result rounded back."""
    shapes = SHAPES64 if dtype == np.float64 else SHAPES32
    config = PowerSGD(rank=2, start_iter=2, seed=3)
    params = _params(shapes, dtype)
    rng = np.random.default_rng(100 + WORLD.Get_rank())
    with DistributedGradReducer(params, compression=config) as reducer:
        assert set(reducer.state_dict()["q"]) == {0, len(shapes) - 1}
        rec = Recorder(reducer)
        for _ in range(6):
            rec(_grads(rng, params))
    _agree(_verify(rec, config))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kwargs", [dict(mean=False), dict(degree=7)])
def test_sum_and_degree_and_fresh_q(kwargs):
    config = PowerSGD(rank=1, start_iter=0, warm_start=False, seed=5)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(7 + WORLD.Get_rank())
    failures = []
    with DistributedGradReducer(params, compression=config, **kwargs) as reducer:
        rec = Recorder(reducer)
        for k in range(3):
            if not np.array_equal(reducer.state_dict()["q"][0], draw_q(5, 0, k, 18, 1)):
                failures.append(f"call {k}: Q is not the fresh draw for this call")
            rec(_grads(rng, params))
    _agree(failures + _verify(rec, config, mean=kwargs.get("mean", True), degree=kwargs.get("degree")))


@pytest.mark.mpi(min_size=1)
def test_no_error_feedback():
    config = PowerSGD(rank=2, start_iter=0, error_feedback=False)
    params = _params(SHAPES32, np.float32)
    rng = np.random.default_rng(11 + WORLD.Get_rank())
    with DistributedGradReducer(params, compression=config) as reducer:
        rec = Recorder(reducer)
        for _ in range(3):
            rec(_grads(rng, params))
        kept = any(e.any() for e in reducer.state_dict()["error"].values())
    _agree((["errors kept without error feedback"] if kept else []) + _verify(rec, config))


@pytest.mark.mpi(min_size=2)
def test_a_joined_rank_contributes_nothing_and_keeps_its_error():
    config = PowerSGD(rank=2, start_iter=1)
    params = _params(SHAPES64, np.float64)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rng = np.random.default_rng(21 + rank)
    last = rank == size - 1
    failures = []
    with DistributedGradReducer(params, compression=config) as reducer:
        rec = Recorder(reducer)
        for _ in range(3 if last else 6):  # the last rank runs out of data after 3 calls
            rec(_grads(rng, params))
        kept = reducer.state_dict()
        reducer.join()  # the last rank takes part in calls 3 to 5 with nothing
        after = reducer.state_dict()
        if last and not all(np.array_equal(after["error"][i], kept["error"][i]) for i in kept["error"]):
            failures.append("the joined rank's error changed")
        if after["iteration"] != 6:
            failures.append(f"rank {rank}: iteration {after['iteration']} after the join")
        assert_same_on_all_ranks(WORLD, [after["q"][i] for i in sorted(after["q"])])
    failures = [f for fs in WORLD.allgather(failures) for f in fs]
    _agree(failures + _verify(rec, config))


@pytest.mark.mpi(min_size=1)
def test_state_saved_at_call_15_reproduces_calls_16_to_30_bit_for_bit():
    config = PowerSGD(rank=2, start_iter=10, seed=1)
    params = _params(SHAPES64, np.float64)  # (fewer messages per call than with float32 ones too: 45 calls)
    rng = np.random.default_rng(31 + WORLD.Get_rank())
    batches = [_grads(rng, params) for _ in range(30)]
    with DistributedGradReducer(params, compression=config) as first:
        for k in range(15):
            first([g.copy() for g in batches[k]])
        saved = pickle.dumps(first.state_dict())
        straight = [first([g.copy() for g in batches[k]]) for k in range(15, 30)]
        end = first.state_dict()
    with DistributedGradReducer(params, compression=config) as fresh:
        state = pickle.loads(saved)
        assert state["iteration"] == 15 and all(type(v) is np.ndarray for v in state["q"].values())
        fresh.load_state_dict(state)
        resumed = [fresh([g.copy() for g in batches[k]]) for k in range(15, 30)]
        again = fresh.state_dict()
    failures = [f"call {16 + k}: grads[{i}] differs" for k in range(15) for i in range(len(params))
                if straight[k][i].tobytes() != resumed[k][i].tobytes()]
    failures += [f"{part}[{i}] differs at the end" for part in ("q", "error") for i in end[part]
                 if end[part][i].tobytes() != again[part][i].tobytes()]
    failures = [f for fs in WORLD.allgather(failures) for f in fs]
    _agree(failures)


@pytest.mark.mpi(min_size=1)
def test_skipped_none_and_non_contiguous_gradients():
    config = PowerSGD(rank=1, start_iter=0)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(41 + WORLD.Get_rank())
    failures = []
    with DistributedGradReducer(params, compression=config, skip=[False, False, False, True]) as reducer:
        assert set(reducer.state_dict()["q"]) == {0}  # parameter 3 is skipped: not compressed
        rec = Recorder(reducer)
        for _ in range(2):
            grads = _grads(rng, params)
            untouched = grads[3].copy()
            rec(grads)
            if not np.array_equal(grads[3], untouched):
                failures.append("a skipped gradient was modified")
        # a transposed (not C-contiguous) gradient is compressed like a contiguous one
        grads = _grads(rng, params)
        grads[0] = np.asfortranarray(grads[0])
        rec(grads)
        # None on every rank: left out (state unchanged), the entry stays None
        before = reducer.state_dict()
        grads = _grads(rng, params)
        grads[0] = None
        reducer(grads)
        after = reducer.state_dict()
        if grads[0] is not None or not np.array_equal(before["error"][0], after["error"][0]):
            failures.append("a gradient that is None everywhere was not left out")
    failures = [f for fs in WORLD.allgather(failures) for f in fs]
    _agree(failures + _verify(rec, config, skip=(3,)))


@pytest.mark.mpi(min_size=1)
def test_zero_gradients_give_zeros_and_later_calls_recover():
    config = PowerSGD(rank=2, start_iter=0)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(51 + WORLD.Get_rank())
    failures = []
    with DistributedGradReducer(params, compression=config) as reducer:
        zeros = [np.zeros_like(p) for p in params]
        reducer(zeros)
        if any(np.isnan(z).any() or z.any() for z in zeros):
            failures.append("zero gradients did not give zeros")
        q = reducer.state_dict()["q"]
        if any(not np.all(q[i].any(axis=0)) for i in q):
            failures.append("a zero column of Q was kept for the next call")
        rec = Recorder(reducer)
        for _ in range(2):
            rec(_grads(rng, params))
        if any(np.abs(g).max() == 0 for g in rec.calls[2]["outputs"]):
            failures.append("compression stayed at zero after a zero gradient")
    failures = [f for fs in WORLD.allgather(failures) for f in fs]
    _agree(failures + _verify(rec, config))


@pytest.mark.mpi(min_size=1)
def test_begin_and_reduce_async_match_the_blocking_call_bitwise():
    config = PowerSGD(rank=2, start_iter=1)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(61 + WORLD.Get_rank())
    with DistributedGradReducer(params, compression=config) as blocking, \
            DistributedGradReducer(params, compression=config, progress="deferred") as overlapped:
        for k in range(3):
            grads = _grads(rng, params)
            a, b = [g.copy() for g in grads], [g.copy() for g in grads]
            blocking(a)
            if k == 1:
                step = overlapped.begin(b)
                for i in reversed(range(len(b))):
                    step.ready(i)
                step.wait()
            else:
                overlapped.reduce_async(b).wait()
            assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))
        s, t = blocking.state_dict(), overlapped.state_dict()
        assert all(s[p][i].tobytes() == t[p][i].tobytes() for p in ("q", "error") for i in s[p])


@pytest.mark.mpi(min_size=1)
def test_check_finite_flags_nan_everywhere_and_keeps_the_state():
    config = PowerSGD(rank=1, start_iter=0)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(71 + WORLD.Get_rank())
    with DistributedGradReducer(params, compression=config, check_finite=True) as reducer:
        reducer(_grads(rng, params))
        assert not reducer.nonfinite
        before = reducer.state_dict()
        grads = _grads(rng, params)
        if WORLD.Get_rank() == WORLD.Get_size() - 1:
            grads[0][1, 2] = np.nan
        reducer(grads)
        assert reducer.nonfinite  # on every rank
        after = reducer.state_dict()
        assert np.array_equal(after["q"][0], before["q"][0])
        assert np.array_equal(after["error"][0], before["error"][0])
        assert not np.isnan(after["error"][3]).any()  # the other matrices went on
        assert not np.array_equal(after["error"][3], before["error"][3])
        reducer(_grads(rng, params))
        assert not reducer.nonfinite


# -- bad input: raises on every rank, before anything is modified ---------------------------


@pytest.mark.mpi(min_size=1)
def test_a_bad_gradient_on_one_rank_raises_everywhere_before_anything_changes():
    config = PowerSGD(rank=1, start_iter=0)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(81 + WORLD.Get_rank())
    bad = WORLD.Get_size() - 1
    with DistributedGradReducer(params, compression=config) as reducer:
        reducer(_grads(rng, params))
        before = reducer.state_dict()
        grads = _grads(rng, params)
        if WORLD.Get_rank() == bad:
            grads[1] = np.zeros(5)
        kept = [g.copy() for g in grads]
        with pytest.raises(ValueError, match=rf"{_who(bad)}grads\[1\]: expected shape \(18,\)"):
            reducer(grads)
        assert all(np.array_equal(g, k) for g, k in zip(grads, kept, strict=True))
        after = reducer.state_dict()
        assert after["iteration"] == before["iteration"]
        assert all(np.array_equal(after[p][i], before[p][i]) for p in ("q", "error") for i in before[p])


@pytest.mark.mpi(min_size=1)
def test_a_bad_state_on_one_rank_raises_everywhere_before_anything_changes():
    config = PowerSGD(rank=1, start_iter=0)
    params = _params(SHAPES64, np.float64)
    rng = np.random.default_rng(91 + WORLD.Get_rank())
    bad = WORLD.Get_size() - 1
    with DistributedGradReducer(params, compression=config) as reducer:
        reducer(_grads(rng, params))
        good = reducer.state_dict()
        reducer(_grads(rng, params))
        now = reducer.state_dict()
        cases = [
            (lambda s: s["q"].pop(3), r"state\['q'\]: expected the parameter indices \[0, 3\]"),
            (lambda s: s["error"].__setitem__(0, np.zeros((24, 18), np.float32)),
             r"state\['error'\]\[0\]: expected a numpy array of float64 \(24, 18\), got float32"),
            (lambda s: s.__setitem__("iteration", -1), r"state\['iteration'\]: expected an int >= 0"),
            (lambda s: s["q"][0].__setitem__((0, 0), np.inf), r"state\['q'\]\[0\]: holds NaN or Inf"),
        ]
        for spoil, message in cases:
            state = pickle.loads(pickle.dumps(good))
            if WORLD.Get_rank() == bad:
                spoil(state)
            with pytest.raises((ValueError, TypeError), match=rf"{_who(bad)}load_state_dict: {message}"):
                reducer.load_state_dict(state)
            after = reducer.state_dict()
            assert after["iteration"] == now["iteration"]
            assert all(np.array_equal(after[p][i], now[p][i]) for p in ("q", "error") for i in now[p])
        if WORLD.Get_size() > 1:  # ranks that load different iterations
            state = pickle.loads(pickle.dumps(good))
            if WORLD.Get_rank() == bad:
                state["iteration"] += 1
            with pytest.raises(ValueError, match=rf"iteration'\] is 1 at rank 0 but 2 at rank {bad}"):
                reducer.load_state_dict(state)


@pytest.mark.mpi(min_size=1)
def test_reduce_scatter_is_refused_on_every_rank():
    params = _params(SHAPES64, np.float64)
    with DistributedGradReducer(params, compression=PowerSGD(rank=1, start_iter=0)) as reducer:
        grads = _grads(np.random.default_rng(0), params)
        kept = [g.copy() for g in grads]
        with pytest.raises(ValueError, match=r"reduce_scatter: not supported with compression=PowerSGD"):
            reducer.reduce_scatter(grads)
        assert all(np.array_equal(g, k) for g, k in zip(grads, kept, strict=True))
        reducer(grads)  # still usable


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression, error, message", [
    (("bf16", PowerSGD()), ValueError, r"compression: PowerSGD cannot be combined with another compression"),
    (PowerSGD, TypeError, r"compression: expected a PowerSGD instance, got the class"),
])
def test_construction_refuses_combinations(compression, error, message):
    with pytest.raises(error, match=message):
        DistributedGradReducer(_params(SHAPES64, np.float64), compression=compression)


@pytest.mark.mpi(min_size=1)
def test_predivide_and_state_without_powersgd_are_refused():
    params = _params(SHAPES64, np.float64)
    with pytest.raises(ValueError, match=r"predivide: only applies with compression='fp16' or 'bf16'"):
        DistributedGradReducer(params, compression=PowerSGD(), predivide=2.0)
    with DistributedGradReducer(params) as plain, pytest.raises(ValueError, match=r"state_dict: .* without"):
        plain.state_dict()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_powersgd_options_fail_at_construction():
    rank = 2 if WORLD.Get_rank() == WORLD.Get_size() - 1 else 1
    with pytest.raises(ValueError, match=r"the ranks disagree: option compression is PowerSGD\(rank=1.* but "
                                         r"PowerSGD\(rank=2"):
        DistributedGradReducer(_params(SHAPES64, np.float64), compression=PowerSGD(rank=rank))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(rank=0), ValueError, r"PowerSGD: rank: expected an int >= 1, got 0"),
    (dict(rank=1.5), TypeError, r"PowerSGD: rank: expected an int, got float"),
    (dict(start_iter=-1), ValueError, r"start_iter: expected an int >= 0"),
    (dict(min_compression_rate=0), ValueError, r"min_compression_rate: expected a positive finite number"),
    (dict(error_feedback=1), TypeError, r"error_feedback: expected a bool"),
    (dict(seed=-3), ValueError, r"seed: expected an int >= 0"),
])
def test_powersgd_checks_its_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        PowerSGD(**kwargs)


def test_which_gradients_are_compressed():
    from mpi_gradreducer._core.planning import ParamSpec

    config = PowerSGD(rank=2, min_compression_rate=2.0)
    f32 = np.dtype(np.float32)
    # n*m >= 2 * 2 * (n + m): (8, 8) is 64 >= 64, (7, 8) is 56 < 60
    assert config.compresses(ParamSpec((8, 8), f32)) and not config.compresses(ParamSpec((7, 8), f32))
    assert config.compresses(ParamSpec((8, 2, 2, 2), f32))  # n=8, m=8
    assert not config.compresses(ParamSpec((1000,), f32))  # vectors never
    assert config.compresses(ParamSpec((64, 64), np.dtype(np.float16)))  # in float32
    assert not config.compresses(ParamSpec((64, 64), np.dtype(np.complex64)))  # other dtypes never
    assert not config.compresses(ParamSpec((0, 64), f32))


def test_orthonormalise_keeps_zero_columns_and_matches_qr():
    rng = np.random.default_rng(0)
    p = rng.standard_normal((50, 3))
    want = _orthonormal(p)
    orthonormalise(p)
    assert np.allclose(p, want, rtol=0, atol=1e-12)
    z = np.zeros((10, 2))
    orthonormalise(z)
    assert not z.any()
    tiny = rng.standard_normal((10, 2)) * 1e-300  # no underflow to zero, no overflow to inf
    orthonormalise(tiny)
    assert np.allclose(tiny.T @ tiny, np.eye(2))


def test_resnet50_bytes_per_compressed_call_at_rank_4():
    """``stats.bytes`` of a compressed call on ResNet-50's shapes: P and Q, plus the uncompressed rest."""
    from threadpoolctl import threadpool_limits  # (with scikit-learn) BLAS threads only slow a shared machine

    from mpi_gradreducer.bench.workloads import resnet50

    with threadpool_limits(1):
        _resnet50_bytes(resnet50().arrays())


def _resnet50_bytes(grads: list[np.ndarray]) -> None:
    config = PowerSGD(rank=4, start_iter=0, error_feedback=False)  # the same bytes, less memory
    with DistributedGradReducer(grads, group=MPI.COMM_SELF) as reducer:
        reducer(grads)
        plain = reducer.stats.bytes
    with DistributedGradReducer(grads, group=MPI.COMM_SELF, compression=config) as reducer:
        reducer(grads)
        compressed = reducer.stats.bytes
    small = [g for g in grads if not config.compresses(_spec(g))]
    low = [(g.shape[0], g.size // g.shape[0]) for g in grads if config.compresses(_spec(g))]
    assert compressed == sum(g.nbytes for g in small) + sum((n + m) * 4 * 4 for n, m in low)
    assert compressed * 50 <= plain


def _spec(g: np.ndarray):
    from mpi_gradreducer._core.planning import ParamSpec

    return ParamSpec(g.shape, g.dtype)


def test_orthonormalise_zeroes_dependent_columns():
    p = np.full((100, 4), 3.0) @ np.diag([1.0, 2.0, 3.0, 4.0])  # rank 1: one direction, the rest rounding
    orthonormalise(p)
    assert np.allclose(p[:, 0], 0.1) and not p[:, 1:].any()
    q = np.random.default_rng(1).standard_normal((50, 2)) @ np.random.default_rng(2).standard_normal((2, 4))
    orthonormalise(q)  # rank 2 of 4
    kept = q[:, np.abs(q).max(axis=0) > 0]
    assert kept.shape[1] == 2 and np.allclose(kept.T @ kept, np.eye(2))


@pytest.mark.mpi(min_size=1)
def test_gradients_of_lower_rank_than_powersgd_come_back_exactly():
    """Each rank's gradient is rank 1 (a batch of one), so the sum has rank <= 4: PowerSGD(rank=4) is exact."""
    size, dtype = WORLD.Get_size(), np.float32
    params = [np.zeros((64, 48), dtype), np.zeros((48, 8, 2), dtype)]
    rng = np.random.default_rng(5 + WORLD.Get_rank())
    with DistributedGradReducer(params, compression=PowerSGD(rank=4, start_iter=0)) as reducer:
        for _ in range(3):
            grads = [np.outer(rng.standard_normal(p.shape[0]), rng.standard_normal(p.size // p.shape[0]))
                     .reshape(p.shape).astype(dtype) for p in params]
            total = [sum(parts) for parts in zip(*WORLD.allgather([g.astype(np.float64) for g in grads]), strict=True)]
            reducer(grads)
            assert all(_close(g, t / size, 1e-4) for g, t in zip(grads, total, strict=True))


@pytest.mark.mpi(min_size=1)
def test_deterministic_sums_the_warm_up_calls_in_rank_order():
    """With ``deterministic=True`` the calls before ``start_iter`` (the compressed parameters summed as they are)
    are the rank-order sums ``((g0 + g1) + g2) + ...``, bit for bit, on random float32 data."""
    params = _params(SHAPES32, np.float32)
    rng = np.random.default_rng(101 + WORLD.Get_rank())
    with DistributedGradReducer(params, compression=PowerSGD(rank=2, start_iter=3), mean=False,
                                deterministic=True) as reducer:
        for _ in range(2):
            grads = _grads(rng, params)
            everyone = [_gather(g) for g in grads]
            reducer(grads)
            for i, (g, rows) in enumerate(zip(grads, everyone, strict=True)):
                want = rows[0].copy()
                for r in rows[1:]:
                    want = want + r
                np.testing.assert_array_equal(g.view(np.uint32), want.view(np.uint32), err_msg=f"grads[{i}]")
