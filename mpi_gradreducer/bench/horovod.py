"""Many small tensors through ``mpi_gradreducer.horovod`` against the package's reducer on the same tensors.

Run under MPI; only rank 0 prints::

    mpiexec -n 2 python -m mpi_gradreducer.bench horovod --count 400 --bytes 4096

Every method averages its own ``--count`` float32 torch tensors of
``--bytes`` bytes each (filled with ``1 + rank`` before each run, checked
after the first) over every rank; the methods are timed in one run,
interleaved (:func:`~mpi_gradreducer.bench.timing.time_cases`); a run's time
is the slowest rank's:

``reducer``
    :class:`~mpi_gradreducer.DistributedGradReducer` built on the tensors
    (``mean=True``), called on them: the fused reduction the others are
    measured against.
``grouped``
    ``hvd.grouped_allreduce_(tensors)``: one operation of every tensor.
``grouped-out``
    ``hvd.grouped_allreduce(tensors)``: the same, into new tensors.
``async``
    ``hvd.allreduce_async_(t, name=...)`` for each tensor, then
    ``hvd.synchronize`` of each handle: what Horovod's users do per
    gradient, fused by the engine's cycle (``HOROVOD_CYCLE_TIME``,
    ``HOROVOD_FUSION_THRESHOLD``).
``broadcast``
    ``hvd.broadcast_parameters(tensors, root_rank=0)``: rank 0's tensors into
    every rank's, packed in fusion buffers (not an average: timed beside
    the others for scale).

The ratios ``<method> / reducer`` follow the table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from .cli import RankParser, run_as_script, start
from .environment import environment, loadavg
from .output import write_json
from .timing import Case, all_close, expected_sum, fill_value, time_cases

__all__ = ["METHODS", "bench_small", "format_small", "main"]

METHODS = ("reducer", "grouped", "grouped-out", "async", "broadcast")


def bench_small(comm: MPI.Intracomm, count: int, nbytes: int, methods: Sequence[str], reps: int,
                warmup: int) -> dict[str, Any]:
    """Time the methods on ``count`` float32 tensors of ``nbytes`` bytes, interleaved (collective).

    Horovod's calls run over ``comm`` (``hvd.init(comm)``; shut down at the end).

    Returns:
        The workload, each method's ``median_ms``/``min_ms``/``times_ms``, and
        ``<method>_over_reducer`` for every other method.
    """
    import torch

    from .. import DistributedGradReducer, horovod as hvd

    torch.set_num_threads(1)
    numel = max(1, nbytes // 4)
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()

    def tensors() -> list[Any]:
        return [torch.empty(numel, dtype=torch.float32) for _ in range(count)]

    def fill(ts: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for t in ts:
                t.fill_(value)
        return run

    def check(ts: list[Any], expected: float = mean) -> Callable[[], bool]:
        return lambda: all_close([t.numpy() for t in ts], expected)

    hvd.init(comm)
    cases: list[Case] = []
    closers: list[Callable[[], None]] = []
    try:
        if "reducer" in methods:
            ts = tensors()
            reducer = DistributedGradReducer(ts, mean=True, group=comm)
            closers.append(reducer.free)
            cases.append(Case("reducer", fill(ts), functools.partial(reducer, ts), check(ts)))
        if "grouped" in methods:
            ts = tensors()
            cases.append(Case("grouped", fill(ts), functools.partial(hvd.grouped_allreduce_, ts, name="bench.grouped"),
                              check(ts)))
        if "grouped-out" in methods:
            ts = tensors()
            out: list[Any] = []

            def grouped_out(ts: list[Any] = ts) -> None:
                out[:] = hvd.grouped_allreduce(ts, name="bench.grouped-out")

            cases.append(Case("grouped-out", fill(ts), grouped_out, check(out)))
        if "async" in methods:
            ts = tensors()
            names = [f"bench.async.{i}" for i in range(count)]

            def per_tensor(ts: list[Any] = ts) -> None:
                handles = [hvd.allreduce_async_(t, name=n) for t, n in zip(ts, names, strict=True)]
                for h in handles:
                    hvd.synchronize(h)

            cases.append(Case("async", fill(ts), per_tensor, check(ts)))
        if "broadcast" in methods:
            ts = tensors()
            cases.append(Case("broadcast", fill(ts), functools.partial(hvd.broadcast_parameters, ts, root_rank=0),
                              check(ts, comm.bcast(value, root=0))))
        times = time_cases(comm, cases, reps, warmup)
    finally:
        for close in reversed(closers):
            close()
        hvd.shutdown()
    med = {name: statistics.median(t) for name, t in times.items()}
    res: dict[str, Any] = {
        "count": count, "bytes": numel * 4, "ranks": comm.Get_size(),
        "methods": {name: {"median_ms": med[name] * 1e3, "min_ms": min(t) * 1e3, "times_ms": [v * 1e3 for v in t]}
                    for name, t in times.items()},
    }
    if "reducer" in med:
        for name in med:
            if name != "reducer":
                res[f"{name}_over_reducer"] = med[name] / med["reducer"]
    return res


def format_small(res: dict[str, Any]) -> str:
    """The table of :func:`bench_small`'s results."""
    lines = [f"horovod: {res['count']} float32 tensors of {res['bytes']} bytes ({res['count'] * res['bytes'] / 1e6:.2f}"
             f" MB), averaged over {res['ranks']} ranks",
             f"  {'method':<14}{'median ms':>11}{'min ms':>10}"]
    for name, m in res["methods"].items():
        lines.append(f"  {name:<14}{m['median_ms']:>11.2f}{m['min_ms']:>10.2f}")
    lines.extend(f"  {key.replace('_over_', ' / ')} = {value:.2f}" for key, value in res.items()
                 if key.endswith("_over_reducer"))
    return "\n".join(lines)


def _parser(rank: int = 0) -> argparse.ArgumentParser:
    p = RankParser(prog="python -m mpi_gradreducer.bench horovod",
                   description="Time many small tensors through mpi_gradreducer.horovod (grouped_allreduce, "
                               "allreduce_async_ + synchronize) against the reducer. Run under mpiexec; only rank 0 "
                               "prints.", rank=rank)
    p.add_argument("--count", type=int, default=400, help="tensors (default 400)")
    p.add_argument("--bytes", type=int, default=4096, help="bytes per tensor, float32 (default 4096)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per method (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the results and the environment to PATH")
    return p


def _check(args: argparse.Namespace) -> str | None:
    if args.count < 1 or args.bytes < 4:
        return f"--count must be >= 1 and --bytes >= 4, got {args.count} and {args.bytes}"
    if args.reps < 1 or args.warmup < 0:
        return f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}"
    return None


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> dict[str, Any]:
    """Run the comparison; rank 0 prints the table (and writes ``--json``).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator (default ``MPI.COMM_WORLD``).

    Returns:
        The results of :func:`bench_small` and the environment; the same on every rank.

    Raises:
        SystemExit: on every rank alike, for ``--help`` and bad options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args, comm, say = start(_parser, argv, comm, _check, shared=False)
    try:
        results: dict[str, Any] = {"environment": environment(comm, "mpi_gradreducer.bench horovod", argv)}
        results["small"] = bench_small(comm, args.count, args.bytes, args.methods, args.reps, args.warmup)
        results["environment"]["loadavg_at_end"] = loadavg()
        say(format_small(results["small"]))
        if args.json and comm.Get_rank() == 0:
            write_json(args.json, results)
        return results
    finally:
        comm.Free()


if __name__ == "__main__":
    run_as_script(main, "bench horovod")
