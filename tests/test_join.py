"""``join()``: ranks that run out of data take part in the others' calls with nothing.

Rank ``r`` makes ``counts[r]`` calls (0 included), then joins. In call ``c``
(from 1) every contributing rank writes ChainerMN's oracle ``r + c``; the
result must be the mean over the ranks that contributed to that call
(those with ``counts[r] >= c``), and ``contributors`` their number, on every
rank. Every count pattern is a pure function of the rank and the size, so
every rank makes the same skip decisions.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks, run_job
from mpi_gradreducer import DistributedGradReducer, RowSparse

# A fused first bucket (the header's carrier), a parameter reduced in place, a float16 one.
SHAPES = [(40, 30), (30,), (300, 1024), (7,), (), (5, 0), (64, 64)]
DTYPES = [np.float32, np.float32, np.float32, np.float64, np.float32, np.float32, np.float16]


def _params() -> list[np.ndarray]:
    return [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES, strict=True)]


def _patterns(size: int) -> list[tuple[int, ...]]:
    """Batches per rank: ``r % k + j`` for k = 3 and j = 0..2, all equal, all zero, one rank alone."""
    k = 3
    patterns = [tuple(r % k + j for r in range(size)) for j in range(k)]
    patterns += [(2,) * size, (0,) * size, tuple(3 if r == size - 1 else 0 for r in range(size))]
    return patterns


PATTERNS = _patterns(WORLD.Get_size())


def _contributing(counts: tuple[int, ...], c: int) -> list[int]:
    return [r for r, n in enumerate(counts) if n >= c]


def _oracle(counts: tuple[int, ...], c: int, degree: int | None = None) -> float:
    ranks = _contributing(counts, c)
    return sum(r + c for r in ranks) / (degree if degree is not None else len(ranks))


def _grads_for(c: int, views: list[np.ndarray] | None = None) -> list[np.ndarray]:
    value = WORLD.Get_rank() + c
    if views is not None:
        for v in views:
            v[...] = value
        return views
    return [np.full(s, value, d) for s, d in zip(SHAPES, DTYPES, strict=True)]


def _check(grads, counts, c, degree=None) -> None:
    expected = _oracle(counts, c, degree)
    for i, g in enumerate(grads):
        rtol = 2e-3 if g.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(np.asarray(g, np.float64), expected, rtol=rtol, err_msg=f"grads[{i}], call {c}")


def _epoch(reducer: DistributedGradReducer, counts: tuple[int, ...], *, degree: int | None = None,
           mode: str = "blocking", views: list[np.ndarray] | None = None) -> None:
    """One epoch of ``counts``: this rank's calls, checked, then ``join()``."""
    rank = WORLD.Get_rank()
    for c in range(1, counts[rank] + 1):
        grads = _grads_for(c, views)
        if mode == "blocking":
            out = reducer(grads)
        elif mode == "async":
            out = reducer.reduce_async(grads).wait()
        else:  # ready() in an order of this rank's own
            step = reducer.begin(grads)
            for i in np.random.default_rng(rank * 31 + c).permutation(len(grads)):
                step.ready(int(i))
            out = step.wait()
        assert out is grads
        _check(grads, counts, c, degree)
        assert reducer.contributors == len(_contributing(counts, c))
    reducer.join()
    assert reducer.contributors == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("counts", PATTERNS, ids=lambda p: "-".join(map(str, p)))
def test_each_call_is_the_mean_over_its_contributors(counts):
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10) as reducer:
        assert len(reducer.buckets) > 3
        _epoch(reducer, counts)
        # The next epoch: everyone again, then all join at once.
        _epoch(reducer, (1,) * WORLD.Get_size())
        out = reducer(_grads_for(5))
        _check(out, (5,) * WORLD.Get_size(), 5)
        assert reducer.contributors == WORLD.Get_size()
        assert_same_on_all_ranks(WORLD, out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", [None, "fp16"])
def test_header_alone_and_explicit_degree(compression):
    """Compressed first bucket: the header travels alone; an explicit degree stays the divisor."""
    params = [np.zeros(s, np.float32) for s in SHAPES]
    counts = PATTERNS[0]
    with DistributedGradReducer(params, degree=7, bucket_bytes=8 << 10, compression=compression) as reducer:
        assert (reducer._ctx.first.carrier is None) == (compression is not None)
        rank = WORLD.Get_rank()
        for c in range(1, counts[rank] + 1):
            grads = [np.full(s, rank + c, np.float32) for s in SHAPES]
            reducer(grads)
            expected = _oracle(counts, c, degree=7)
            for g in grads:
                np.testing.assert_allclose(g, expected, rtol=2e-3 if compression else 1e-6)
            assert reducer.contributors == len(_contributing(counts, c))
        reducer.join()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("progress", ["deferred", "thread"])
@pytest.mark.parametrize("mode", ["async", "ready"])
def test_asynchronous_calls_with_joined_ranks(progress, mode):
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10, progress=progress) as reducer:
        assert reducer.progress == progress
        for counts in PATTERNS[:3]:
            _epoch(reducer, counts, mode=mode)
        _epoch(reducer, PATTERNS[-1], mode="blocking")  # blocking and asynchronous epochs mix


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_bucket_views_with_joined_ranks(mode):
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10, progress="deferred") as reducer:
        views = reducer.allocate_grads()
        for counts in PATTERNS:
            _epoch(reducer, counts, views=views, mode=mode)
            for i in range(len(views)):
                if reducer._plan.own_views[i] is not None:  # the stand-ins of a joined rank: zeros after join()
                    assert not views[i].any()
        reducer(_grads_for(4, views))
        _check(views, (4,) * WORLD.Get_size(), 4)
        assert_same_on_all_ranks(WORLD, views)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("degree", [None, 5])
def test_rowsparse_joined_ranks_contribute_no_rows(degree):
    rank = WORLD.Get_rank()
    table = np.zeros((20, 3), np.float32)
    params = [table, np.zeros((4, 4), np.float32)]
    counts = PATTERNS[1]
    with DistributedGradReducer(params, degree=degree, bucket_bytes=8 << 10) as reducer:
        for c in range(1, counts[rank] + 1):
            rows = np.array([rank, rank + 1], np.int64)
            grads = [RowSparse(rows, np.full((2, 3), rank + c, np.float32), table.shape),
                     np.full((4, 4), rank + c, np.float32)]
            out = reducer(grads)
            ranks = _contributing(counts, c)
            divisor = degree if degree is not None else len(ranks)
            assert isinstance(out[0], RowSparse) and out[0].nnz == 2 * len(ranks)
            expected = np.zeros(table.shape)
            for r in ranks:
                expected[[r, r + 1]] += (r + c) / divisor
            np.testing.assert_allclose(out[0].to_dense(), expected, rtol=1e-6)
            np.testing.assert_allclose(out[1], _oracle(counts, c, degree), rtol=1e-6)
        reducer.join()


@pytest.mark.mpi(min_size=3)  # rank 1 poisons call 3, which the last rank (that joins after one call) must not be
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_nonfinite_is_seen_by_every_contributing_rank(mode):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    counts = tuple(3 if r < size - 1 else 1 for r in range(size))  # the last rank joins after one call
    with DistributedGradReducer(_params(), check_finite=True, bucket_bytes=8 << 10,
                                progress="deferred") as reducer:
        for c in range(1, counts[rank] + 1):
            grads = _grads_for(c)
            if c == 2 and rank == 0:
                grads[3][2] = np.nan  # a member of the first bucket: after the header has gone
            if c == 3 and rank == 1:
                grads[2][5, 5] = np.inf  # the parameter reduced in place
            reducer(grads) if mode == "blocking" else reducer.reduce_async(grads).wait()
            assert reducer.nonfinite == (c >= 2), f"call {c}"
        reducer.join()


@pytest.mark.mpi(min_size=3)
def test_a_call_while_others_join_must_still_match_across_contributors():
    """Contributing ranks that start one call differently raise on every rank, joined ones included."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10, progress="deferred") as reducer:
        if rank == size - 1:
            with pytest.raises(ValueError, match="started call 1 differently"):
                reducer.join()
        elif rank == 0:
            with pytest.raises(ValueError, match="started call 1 differently"):
                reducer.reduce_async(_grads_for(1)).wait()
        else:
            with pytest.raises(ValueError, match="started call 1 differently"):
                reducer(_grads_for(1))
        # still usable: everyone calls, then everyone joins
        reducer(_grads_for(2))
        reducer.join()


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_a_contributing_rank_raises_everywhere_while_others_join():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10) as reducer:
        if rank == size - 1:
            with pytest.raises(ValueError, match=r"rank 0: grads\[0\]: expected shape \(40, 30\)"):
                reducer.join()
            reducer.join()
        else:
            grads = _grads_for(1)
            if rank == 0:
                grads[0] = np.zeros((30, 40), np.float32)
            before = [g.copy() for g in grads]
            with pytest.raises(ValueError, match=r"rank 0: grads\[0\]: expected shape \(40, 30\)"):
                reducer(grads)
            for b, g in zip(before, grads, strict=True):
                assert b.tobytes() == g.tobytes()
            reducer.join()


# -- the watchdog: whole jobs, launched from a single process -------------------------------

def _job(*args: str) -> tuple[int, str, str]:
    """``tests/jobs/join_stall.py`` on 3 ranks (``conftest.run_job``: a hard limit, nothing left behind)."""
    job = run_job("join_stall.py", *args, ranks=3)
    return job.returncode, job.stdout, job.stderr


@pytest.mark.slow
def test_a_joined_rank_waiting_for_slow_ranks_is_no_stall():
    # Each call comes 2 s after the last: longer than the timeout (1.5 s) that the joined rank would apply.
    code, out, err = _job("--pace", "2", "--steps", "3")
    assert code == 0, out + err
    assert "has waited" not in err and "Aborting" not in err, err
    assert sorted(re.findall(r"rank (\d): finished, contributors 0", out)) == ["0", "1", "2"], out
    assert out.count("contributors 2\n") == 6, out


@pytest.mark.slow
def test_a_stall_while_a_rank_has_joined_is_still_found():
    t0 = time.monotonic()
    code, out, err = _job("--stall-rank", "1", "--stall-at", "2", "--sleep", "120", "--timeout", "4",
                          "--stall-warning", "1")
    assert code != 0 and time.monotonic() - t0 < 40, out + err
    # Rank 0 waits in call 2 and names rank 1 alone: the joined rank 2 waits in the same collective.
    warned = re.search(r"mpi_gradreducer: rank 0: call 2, (.*) has waited [\d.]+ s \(stall_warning=1 s\); "
                       r"missing ranks: 1 \[rank 1: not in a collective since call 1\]; still waiting", err)
    assert warned, err
    assert re.search(r"rank 0: call 2, .* has not completed after [\d.]+ s \(timeout=4 s\); "
                     r"missing ranks: 1 \[rank 1: not in a collective since call 1\]\. Aborting the job\.", err), err
    assert "rank 2: call" not in err, err  # the joined rank never warns
