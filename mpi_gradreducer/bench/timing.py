"""Timed cases: interleaved repetitions, medians, and verdicts every rank shares.

A :class:`Case` is one method under test: how to prepare its inputs (not
timed), the timed work, and how to check its result. :func:`time_cases` runs
several interleaved; :func:`summary` turns one case's times into medians and
bandwidths; :func:`agree` and :func:`keep_working` let a method that fails on
some rank be reported instead of ending (or hanging) the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from .output import one_line

__all__ = [
    "Case",
    "Meter",
    "agree",
    "all_close",
    "expected_sum",
    "fill_value",
    "filler",
    "keep_working",
    "summary",
    "time_cases",
]


@dataclass
class Case:
    """One timed method.

    Attributes:
        name: the method's name.
        prepare: writes fresh values into the method's arrays (not timed).
        run: the timed work (what it returns is ignored).
        check: after a run, True when the results are right (not timed).
    """

    name: str
    prepare: Callable[[], object]
    run: Callable[[], object]
    check: Callable[[], bool] | None = None


class Meter(Protocol):
    """Something measured around each timed call, outside the timed region (e.g. a :class:`~.network.NicMeter`)."""

    def before(self, index: int) -> None:
        """Called on every rank after case ``index``'s ``prepare()``, before the barrier that starts its run."""

    def after(self, index: int) -> None:
        """Called on every rank right after case ``index``'s timed run, before its result is checked."""


def time_cases(comm: MPI.Intracomm, cases: Sequence[Case], reps: int, warmup: int,
               meter: Meter | None = None) -> dict[str, list[float]]:
    """Time ``cases`` interleaved; every rank gets the same answer.

    Each repetition runs every case once, starting from case ``rep % len``.
    Before each run: ``prepare()``, then a barrier; the run's time is the
    maximum over the ranks. Each case's result is checked after its first
    run, and a wrong result raises on every rank.

    Args:
        comm: the communicator the cases use.
        cases: the methods.
        reps: timed repetitions.
        warmup: untimed repetitions before them.
        meter: called around each timed (not warm-up) run, by the case's
            index in ``cases``: ``before`` after ``prepare()`` and before the
            barrier, ``after`` right after the run (it may hold collectives:
            every rank calls it at the same point).

    Returns:
        For each case, its ``reps`` times in seconds.

    Raises:
        RuntimeError: when a case's result was wrong on some rank.
    """
    k = len(cases)
    times = np.zeros((max(reps, 0), k), dtype=np.float64)
    wrong = np.zeros(k, dtype=np.int64)
    checked = [c.check is None for c in cases]
    for rep in range(-warmup, reps):
        for step in range(k):
            j = (rep + step) % k
            case = cases[j]
            case.prepare()
            if meter is not None and rep >= 0:
                meter.before(j)
            comm.Barrier()
            t0 = time.perf_counter()
            case.run()
            elapsed = time.perf_counter() - t0
            if meter is not None and rep >= 0:
                meter.after(j)
            if rep >= 0:
                times[rep, j] = elapsed
            if not checked[j] and case.check is not None:
                checked[j] = True
                wrong[j] = 0 if case.check() else 1
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    comm.Allreduce(MPI.IN_PLACE, wrong, op=MPI.MAX)
    bad = [cases[j].name for j in range(k) if wrong[j]]
    if bad:
        raise RuntimeError(f"wrong results from: {', '.join(bad)}")
    return {c.name: [float(t) for t in times[:, j]] for j, c in enumerate(cases)}


def summary(seconds: Sequence[float], nbytes: int, ranks: int) -> dict[str, Any]:
    """Median, minimum and bandwidths of one case's times.

    Bandwidths follow the nccl-tests convention: ``algbw = bytes / time`` and
    ``busbw = algbw * 2 (n - 1) / n``.

    Args:
        seconds: the case's times.
        nbytes: the bytes one run reduces.
        ranks: the number of ranks.

    Returns:
        ``median_ms``, ``min_ms``, ``times_ms``, ``algbw_GBps`` and ``busbw_GBps``.
    """
    median = statistics.median(seconds)
    algbw = nbytes / median / 1e9 if median > 0 else float("inf")
    return {
        "median_ms": median * 1e3,
        "min_ms": min(seconds) * 1e3,
        "times_ms": [t * 1e3 for t in seconds],
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (ranks - 1) / ranks,
    }


def fill_value(comm: MPI.Comm) -> float:
    """What rank r writes into its gradients: 1 + r, exact in float16, no overflow, no denormals."""
    return 1.0 + comm.Get_rank()


def expected_sum(comm: MPI.Comm) -> float:
    """The sum of :func:`fill_value` over the ranks of ``comm``."""
    n = comm.Get_size()
    return n + n * (n - 1) / 2


def filler(arrays: Sequence[Any], value: float, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A ``prepare`` that writes ``value`` into every array, then calls ``then`` (e.g. a device sync)."""

    def fill() -> None:
        for a in arrays:
            a.fill(value)
        if then is not None:
            then()

    return fill


def all_close(arrays: Sequence[Any], value: float, rtol: float = 1e-3,
              to_host: Callable[[Any], np.ndarray] = np.asarray) -> bool:
    """A cheap check: a strided sample and the last element of every array equal ``value``.

    Args:
        arrays: numpy arrays, or device arrays with ``to_host`` to copy a slice to numpy.
        value: the expected value of every element.
        rtol: the relative tolerance.
        to_host: turns a slice of one of ``arrays`` into a numpy array.
    """
    for a in arrays:
        flat = a.reshape(-1)
        if flat.size == 0:
            continue
        sample = np.concatenate([to_host(flat[::97]), to_host(flat[-1:])]).astype(np.float64)
        if not np.allclose(sample, value, rtol=rtol, atol=0.0):
            return False
    return True


def agree(comm: MPI.Intracomm, fn: Callable[[], Any]) -> str | None:
    """Run ``fn()`` on every rank; the same verdict on every rank (collective).

    Returns:
        None when it succeeded everywhere, else the first failing rank's
        error as ``"rank R: Type: message"``.
    """
    error = ""
    try:
        fn()
    except Exception as exc:  # reported, and the caller leaves the method out on every rank
        error = one_line(f"{type(exc).__name__}: {exc}")
    errors = comm.allgather(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def keep_working(comm: MPI.Intracomm, cases: Sequence[Case]) -> tuple[list[Case], dict[str, str]]:
    """Run each case once, untimed; keep those that work on every rank (collective).

    Returns:
        The cases that ran and gave right results everywhere, and for each
        other case, why not (see :func:`agree`).
    """
    kept: list[Case] = []
    failed: dict[str, str] = {}
    for case in cases:
        def once(case: Case = case) -> None:
            case.prepare()
            case.run()
            if case.check is not None and not case.check():
                raise RuntimeError("wrong result")

        why = agree(comm, once)
        if why is None:
            kept.append(case)
        else:
            failed[case.name] = why
    return kept, failed
