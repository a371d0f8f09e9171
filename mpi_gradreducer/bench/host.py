"""Host benchmark: the reducer against the raw MPI limit, a per-tensor loop and torch gloo.

Run it under MPI; only rank 0 prints::

    mpiexec -n 4 python -m mpi_gradreducer.bench --scale 0.25 --json out/bench.json

All methods of a workload are timed in one run, interleaved (each repetition
runs every method once, starting from a different method each time, so that
no method always follows the same neighbour), and summarised by medians: the
machine may be shared and noisy, and only ratios measured side by side mean
much. Each timed call is preceded, outside the timed region, by writing fresh
values into the gradients, then a barrier; the time of a repetition is the
maximum over the ranks. Every method's result is checked once against the
exact expected mean.

The methods and what each times: :mod:`mpi_gradreducer.bench.host_methods`;
the tables: :mod:`mpi_gradreducer.bench.host_tables`.

For the ``small`` workload (the digits MLP, 38 KB) the reducer is also given
as a ratio to ONE raw Allreduce of all its bytes, with ``validate="always"``
over ``validate="never"``.

Across hosts (a run whose ranks span several hosts), each workload also
gets a table of each host's NIC bytes per call and, with ``--link-rate``,
the wire bound: see :mod:`mpi_gradreducer.bench.network`.

``--sweep``, ``--overlap`` and ``--plot`` add the experiments of
:mod:`mpi_gradreducer.bench.sweeps` and :mod:`mpi_gradreducer.bench.overlap`.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer
from . import powersgd
from .cli import RankParser, add_network_options, add_shared_options, run_as_script, start
from .counters import reducer_stats
from .environment import environment, loadavg
from .host_methods import (
    COMPRESSED,
    DEFAULT_METHODS,
    DEFAULT_WORKLOADS,
    METHODS,
    ON_REQUEST,
    WHOLE,
    Methods,
    workload_methods,
)
from .host_tables import format_workload
from .limit import best_limit
from .network import NicMeter, figures
from .output import size_label, write_json
from .overlap import bench_overlap, format_overlap
from .sweeps import SWEEPS, allreduce_curve, format_sweeps, run_sweeps
from .timing import Case, fill_value, filler, summary, time_cases
from .torch_methods import Gloo, gloo_usable, torch_ingestion
from .workloads import WORKLOADS, Workload, make_workload, many_small

__all__ = ["bench_workload", "format_workload", "main"]


def bench_workload(comm: MPI.Intracomm, wl: Workload, methods: Sequence[str], gloo: Gloo | None,
                   torch_unsupported: str | None, reps: int, warmup: int, powersgd_rank: int = 4,
                   model_ranks: int | None = None, meter: NicMeter | None = None,
                   link_rate: float | None = None) -> dict[str, Any]:
    """Time the ``methods`` on one workload, interleaved (collective).

    Args:
        comm: the communicator.
        wl: the workload.
        methods: names from :data:`METHODS`.
        gloo: the gloo group for ``torch-gloo``, or None to leave it out.
        torch_unsupported: why ``reducer-torch`` cannot run (the same on every
            rank), or None to try it.
        reps: timed repetitions.
        warmup: untimed repetitions first.
        powersgd_rank: the rank of ``reducer-powersgd`` and ``torch-powersgd``.
        model_ranks: the ranks of the modelled link (default: those of ``comm``).
        meter: counts each host's NIC bytes around every timed call; with
            it, the results hold ``network`` (:func:`.network.figures`).
        link_rate: each host's link rate in bits per second, for the wire
            bound in ``network`` (with ``meter``).

    Returns:
        The workload's facts, ``messages``, ``reducer_stats``, ``skipped``,
        ``methods`` (summaries, with ``ratio_to_limit``) and the derived figures.
    """
    grads = wl.arrays()
    m = workload_methods(comm, wl, grads, methods, gloo, torch_unsupported, powersgd_rank)
    try:
        times = time_cases(comm, m.cases, reps, warmup, meter)
        sent = meter.per_call([c.name for c in m.cases]) if meter is not None else {}
        stats = {name: reducer_stats(r) for name, r in m.reducers.items() if name in times}
        peer_bytes = {name: peer.wire_bytes() for name, peer in m.peers.items()}
    finally:
        m.free()
    size = comm.Get_size()
    results = {name: summary(t, wl.nbytes, size) for name, t in times.items()}
    out: dict[str, Any] = {**wl.facts(size), "messages": m.messages, "reducer_stats": stats,
                           "skipped": {name: m.skipped[name] for name in METHODS if name in m.skipped}}
    out["methods"] = _method_summaries(wl, results, m, out)
    out.update(_ratios(times, results))
    if "reducer" in times and "reducer-novalidate" in times:
        out.update(_validation_cost(comm, wl, times, reps, warmup))
    if any(name in times for name in powersgd.POWERSGD_METHODS):
        out["powersgd_rank"] = powersgd_rank
        out["powersgd_peer_bytes"] = peer_bytes
        out["powersgd_link"] = powersgd.model(out, model_ranks or size)
    if meter is not None:
        out["network"] = _network(wl, out, sent, stats, peer_bytes, meter, link_rate)
    return out


def _network(wl: Workload, out: dict[str, Any], sent: dict[str, list[float]], stats: dict[str, Any],
             peer_bytes: dict[str, int], meter: NicMeter, link_rate: float | None) -> dict[str, Any]:
    """The figures across hosts: the limit is its fastest chunk size's; compressed methods get their own optimum."""
    sent = dict(sent)
    for name, chunk in out.get("limit_by_chunk", {}).items():
        chunk["host_bytes"] = sent.get(name)
    if "limit" in out["methods"]:
        sent["limit"] = sent.get(f"limit@{out['limit_chunk']}", [])
    own = {name: stats[name]["wire_bytes"] for name in COMPRESSED if name in stats}
    own.update({name: b for name, b in peer_bytes.items() if name in out["methods"]})
    medians = {name: res["median_ms"] for name, res in out["methods"].items()}
    return figures(meter.hosts, wl.nbytes, link_rate, medians, sent, own)


def _method_summaries(wl: Workload, results: dict[str, dict[str, Any]], m: Methods,
                      out: dict[str, Any]) -> dict[str, Any]:
    """Each method's summary, the limit being its fastest chunk size; records the limit's facts in ``out``."""
    methods_out: dict[str, Any] = {}
    if m.limit_sizes:
        sizes = m.limit_sizes
        best = best_limit(results, sizes)
        out["limit_by_chunk"] = {name: dict(results[name], chunk_bytes=sizes[name]) for name in sizes}
        out["limit_chunk"] = size_label(sizes[best])
        out["limit_chunk_bytes"] = sizes[best] or wl.nbytes
        m.messages["limit"] = -(-wl.nbytes // out["limit_chunk_bytes"])
        methods_out["limit"] = dict(results[best], chunk=out["limit_chunk"])
    for name in METHODS:
        if name != "limit" and name in results:
            methods_out[name] = results[name]
    if "limit" in methods_out:
        limit_ms = methods_out["limit"]["median_ms"]
        for res in methods_out.values():
            res["ratio_to_limit"] = res["median_ms"] / limit_ms
    return methods_out


def _ratios(times: dict[str, list[float]], results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Ratios of medians between pairs of methods that were both timed."""
    pairs = {"torch_over_reducer": ("reducer-torch", "reducer"),
             "reducer_over_one_allreduce": ("reducer", WHOLE),
             "always_over_never": ("reducer", "reducer-novalidate"),
             "reducer_over_floor": ("reducer", "packed-floor"),
             "fresh_over_reducer": ("reducer-fresh", "reducer"),
             "shard_over_reducer": ("reducer-shard", "reducer"),
             "deterministic_over_reducer": ("reducer-deterministic", "reducer")}
    return {key: results[a]["median_ms"] / results[b]["median_ms"]
            for key, (a, b) in pairs.items() if a in times and b in times}


def _validation_cost(comm: MPI.Intracomm, wl: Workload, times: dict[str, list[float]], reps: int,
                     warmup: int) -> dict[str, float]:
    """The cost of ``validate="always"``: paired differences, and an estimate from its local part.

    The verdict itself travels in the call's first message, in both modes,
    so the only difference is the local check that no two gradients overlap.
    """
    with_v, without = np.array(times["reducer"]), np.array(times["reducer-novalidate"])
    local = _local_validation_seconds(comm, wl, reps, warmup)
    return {"validation_cost_percent": float(np.median(with_v - without) / np.median(with_v) * 100),
            "validation_local_ms": local * 1e3,
            "validation_estimate_percent": float(local / np.median(with_v) * 100)}


def _local_validation_seconds(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> float:
    """The local work that ``validate="always"`` adds, timed on ``MPI.COMM_SELF``.

    Both modes check shapes, dtypes, devices and flags locally, and agree on
    the verdict in the call's first message; "always" adds the check that no
    two gradients overlap. This is local CPU work, which noise can only slow
    down, so the difference of the two minimum times estimates it (15
    repetitions at least). Returns the median over the ranks.
    """
    grads = wl.arrays()
    fill = filler(grads, fill_value(comm))
    always = DistributedGradReducer(grads, group=MPI.COMM_SELF, timeout=None)
    never = DistributedGradReducer(grads, group=MPI.COMM_SELF, validate="never", timeout=None)
    try:
        cases = [Case("always", fill, lambda: always(grads)), Case("never", fill, lambda: never(grads))]
        times = time_cases(MPI.COMM_SELF, cases, max(reps, 15), max(warmup, 1))
    finally:
        always.free()
        never.free()
    cost = max(0.0, min(times["always"]) - min(times["never"]))
    return float(statistics.median(comm.allgather(cost)))


# -- entry point ------------------------------------------------------------------------


def _parser(rank: int = 0) -> argparse.ArgumentParser:
    from . import describe_commands

    p = RankParser(
        prog="python -m mpi_gradreducer.bench",
        description="Time DistributedGradReducer against raw MPI_Allreduce, a per-tensor loop and torch gloo. "
                    "Run under mpiexec; only rank 0 prints.",
        epilog=describe_commands(), formatter_class=argparse.RawDescriptionHelpFormatter, rank=rank,
    )
    p.add_argument("--workload", nargs="*", choices=list(WORKLOADS), default=None,
                   help=f"workloads to run (default: {' '.join(DEFAULT_WORKLOADS)}; the option alone: none, "
                        "e.g. to run only --sweep)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                   help="methods to time (default: all but " + ", ".join(ON_REQUEST) + "; reducer-torch, "
                        "torch-gloo and torch-powersgd only where torch imports)")
    p.add_argument("--powersgd-rank", type=int, default=4, metavar="R",
                   help="the rank of reducer-powersgd and torch-powersgd (default 4)")
    p.add_argument("--powersgd-model-ranks", type=int, default=None, metavar="N",
                   help="the ranks of the modelled link (default: the ranks of the run), e.g. 4 from a 1-rank run "
                        "whose compute had a core to itself")
    p.add_argument("--powersgd-plot", metavar="PATH",
                   help="write a PNG of step time against link bandwidth, modelled from the measured parts of "
                        "reducer and reducer-powersgd")
    add_shared_options(p, reps=7)
    add_network_options(p)
    p.add_argument("--sweep", nargs="*", choices=SWEEPS, default=None,
                   help="also run these experiments (no value: all): the reducer's bucket_bytes on resnet50 "
                        "and many-small; the transport's chunk size; packing a tensor or reducing it alone")
    p.add_argument("--overlap", nargs=3, type=int, metavar=("LAYERS", "WIDTH", "BATCH"), default=None,
                   help="also time a step of backward compute + reduction, sequential and overlapped "
                        "(begin/ready/wait), e.g. --overlap 8 1024 32 (run with OPENBLAS_NUM_THREADS=1)")
    p.add_argument("--json", metavar="PATH", help="write all results and the environment to PATH")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of bus bandwidth against message size (times an Allreduce size sweep)")
    return p


def _check(args: argparse.Namespace) -> str | None:
    for option, value in (("--plot", args.plot), ("--powersgd-plot", args.powersgd_plot)):
        if value and importlib.util.find_spec("matplotlib") is None:
            return f"{option} needs matplotlib (pip install matplotlib)"
    if args.powersgd_rank < 1:
        return f"--powersgd-rank: expected a positive int, got {args.powersgd_rank}"
    if args.powersgd_model_ranks is not None and args.powersgd_model_ranks < 2:
        return f"--powersgd-model-ranks: expected an int >= 2, got {args.powersgd_model_ranks}"
    return None


def _run_workloads(comm: MPI.Intracomm, args: argparse.Namespace, say: Callable[[str], None],
                   results: dict[str, Any]) -> None:
    names = list(DEFAULT_WORKLOADS) if args.workload is None else args.workload
    torch_unsupported = torch_ingestion(comm) if "reducer-torch" in args.methods and names else None
    gloo = None
    if ("torch-gloo" in args.methods or "torch-powersgd" in args.methods) and names:
        if gloo_usable(comm):
            gloo = Gloo(comm)
        else:
            say("torch-gloo, torch-powersgd: skipped (torch with gloo is not importable on every rank)")
    results["torch_gloo"] = gloo is not None
    meter = NicMeter(comm, args.nics) if names else None
    try:
        for name in names:
            wl = make_workload(name, args.scale, args.small_count, args.small_size)
            res = bench_workload(comm, wl, args.methods, gloo, torch_unsupported, args.reps, args.warmup,
                                 args.powersgd_rank, args.powersgd_model_ranks, meter, args.link_rate)
            results["workloads"][name] = res
            say(format_workload(name, res) + "\n")
    finally:
        if gloo is not None:
            gloo.close()


def _run_extras(comm: MPI.Intracomm, args: argparse.Namespace, say: Callable[[str], None],
                results: dict[str, Any]) -> None:
    if args.sweep is not None:
        many = many_small(args.small_count, args.small_size)
        results["sweeps"] = run_sweeps(comm, args.sweep, many, args.reps, args.warmup)
        say(format_sweeps(results["sweeps"]) + "\n")
    if args.overlap is not None:
        layers, width, batch = args.overlap
        results["overlap"] = bench_overlap(comm, layers, width, batch, args.reps, args.warmup)
        say(format_overlap(results["overlap"]) + "\n")
    if args.plot:
        results["allreduce_curve"] = allreduce_curve(comm, args.reps, args.warmup)


def _write_outputs(comm: MPI.Intracomm, args: argparse.Namespace, say: Callable[[str], None],
                   results: dict[str, Any]) -> None:
    """Rank 0 writes the files; a failure there raises on every rank (collective)."""
    failure = None
    if comm.Get_rank() == 0:
        try:
            if args.json:
                write_json(args.json, results)
            if args.plot:
                from .plot import plot

                plot(args.plot, results)
            if args.powersgd_plot:
                powersgd.plot_links(args.powersgd_plot, results)
        except Exception as exc:  # tell the other ranks instead of leaving them waiting
            failure = f"could not write the results: {exc!r}"
        else:
            for path in (args.json, args.plot, args.powersgd_plot):
                if path:
                    say(f"wrote {path}")
    failure = comm.bcast(failure, root=0)
    if failure is not None:
        raise RuntimeError(failure)


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> dict[str, Any]:
    """Run the benchmark; rank 0 prints the tables and writes the files.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator to run over (default ``MPI.COMM_WORLD``).

    Returns:
        All results (what ``--json`` writes); the timings are the same on every rank.

    Raises:
        SystemExit: on every rank alike, for ``--help`` and bad options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args, comm, say = start(_parser, argv, comm, _check)
    try:
        results: dict[str, Any] = {"environment": environment(comm, "mpi_gradreducer.bench", argv),
                                   "settings": {k: v for k, v in vars(args).items()
                                                if k not in ("json", "plot", "powersgd_plot")},
                                   "workloads": {}}
        _run_workloads(comm, args, say, results)
        _run_extras(comm, args, say, results)
        results["environment"]["loadavg_at_end"] = loadavg()
        _write_outputs(comm, args, say, results)
        return results
    finally:
        comm.Free()


if __name__ == "__main__":
    run_as_script(main, "bench")
