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

Methods (bytes are the bytes of the gradients as the caller holds them):

``limit``
    ``Allreduce(MPI.IN_PLACE, buf)`` over one preallocated contiguous float32
    buffer of the same bytes (allocated as the reducer's: on huge pages from
    1 MiB), in chunks of 256 KiB, 1, 4, 16 MiB or whole; the fastest chunk
    size (by median) is the limit, and is reported.
``per-tensor``
    One in-place Allreduce per gradient, each followed by a multiplication by
    ``1 / size``.
``reducer``
    :class:`DistributedGradReducer` on separately allocated arrays.
``reducer-novalidate``
    The same with ``validate="never"``: the difference is the cost of the
    cross-rank validation (printed as ``< noise`` when it comes out negative).
``reducer-views``
    The reducer on the arrays of ``reducer.allocate_grads()`` (no copies).
``reducer-fresh``
    The first call after the arrays change: the reducer alternately on two
    lists of distinct arrays, so that no call gets the previous call's arrays
    (which ``reducer`` gets from its third call on, and replays: see
    :mod:`mpi_gradreducer._core.replay`). Reported also as ``reducer-fresh / reducer``.
``reducer-deterministic``
    The reducer with ``deterministic=True`` on separately allocated arrays:
    every element summed in rank order; ``reducer-deterministic / reducer``
    is printed. Only when named in ``--methods``.
``packed-floor``
    The least that any reducer which packs separate arrays must do, written
    by hand with nothing else: one copy of all gradients into a preallocated
    buffer (allocated as the reducer's, on huge pages from 1 MiB; one MPI
    call over an ``hindexed`` datatype made once), the
    ``Allreduce`` in chunks of 1 MiB, each chunk scaled by ``1 / size``, one
    copy back. No checks, no header. Single-dtype workloads only;
    ``reducer / packed-floor`` is printed.
``reducer-shard``
    What a sharded (ZeRO-style) optimizer's step sends with the reducer's
    plan: ``reducer.reduce_scatter(grads)``, each piece copied into its
    parameter (standing for the update of this rank's 1/N), then
    ``shard.allgather(params)``. Reported also as ``reducer-shard / reducer``
    (the Allreduce of the same plan).
``reducer-torch``
    Where torch imports on every rank: the same gradients as torch CPU tensors
    (``torch.from_numpy`` over the numpy arrays) handed straight to a reducer
    built from them; ``reducer-torch / reducer`` is the cost of taking torch
    tensors. Reported as not supported, on every rank alike, while the
    reducer refuses torch tensors.
``reducer-fp16``
    Only when asked for (``--methods``): the reducer with
    ``compression="fp16"`` (float32 gradients travel as float16, half the
    bytes; each rank sums its slice in float32). Reported as skipped where
    the reducer refuses the workload's dtypes.
``reducer-powersgd``, ``torch-powersgd``
    Only when asked for (``--methods``): PowerSGD in the reducer, and torch
    DDP's ``powerSGD_hook`` over gloo as the peer, at ``--powersgd-rank``;
    bytes per call and a modelled link (:mod:`mpi_gradreducer.bench.powersgd`).
``torch-gloo``
    When torch is importable: ``torch.distributed`` with the gloo backend
    doing what DDP does: buckets in reverse parameter order, per dtype, of
    1 MiB for the first and 25 MiB after that; each bucket is copied into a
    flat buffer, all-reduced, divided by the world size and copied back.

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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer
from .._core.backend import empty
from . import powersgd
from .cli import RankParser, add_network_options, add_shared_options, run_as_script, start
from .counters import reducer_stats
from .environment import environment, loadavg
from .limit import best_limit, limit_cases
from .network import NicMeter, figures, format_lines as network_lines
from .output import KIB, MIB, bytes_label, noise_or, size_label, write_json
from .overlap import bench_overlap, format_overlap
from .sweeps import SWEEPS, allreduce_curve, format_sweeps, run_sweeps
from .timing import Case, agree, all_close, expected_sum, fill_value, filler, keep_working, summary, time_cases
from .torch_methods import Gloo, gloo_usable, torch_ingestion
from .workloads import WORKLOADS, Workload, make_workload, many_small

__all__ = ["DEFAULT_WORKLOADS", "LIMIT_CHUNKS", "METHODS", "bench_workload", "main"]

#: What runs without ``--workload``.
DEFAULT_WORKLOADS = ("resnet50", "bert-base", "many-small", "mixed")
METHODS = ("limit", "per-tensor", "packed-floor", "reducer", "reducer-novalidate", "reducer-views", "reducer-fresh",
           "reducer-shard", "reducer-torch", "torch-gloo", "reducer-deterministic", "reducer-fp16",
           *powersgd.POWERSGD_METHODS)
#: Methods timed only when named in ``--methods``.
ON_REQUEST = ("reducer-deterministic", "reducer-fp16", *powersgd.POWERSGD_METHODS)
#: Methods whose bytes on the wire are not the gradients' (their own optimum is printed too).
COMPRESSED = ("reducer-fp16", *powersgd.POWERSGD_METHODS)
#: What runs without ``--methods``: all but PowerSGD's and ``reducer-deterministic``.
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ON_REQUEST)
#: Chunk sizes tried for the raw-MPI limit; 0 stands for "the whole buffer at once".
LIMIT_CHUNKS = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 0)
#: The limit case that is one Allreduce of all the bytes.
_WHOLE = "limit@whole"


@dataclass
class _Methods:
    """The cases of one workload, and what is needed to report on them."""

    cases: list[Case] = field(default_factory=list)
    reducers: dict[str, DistributedGradReducer] = field(default_factory=dict)
    limit_sizes: dict[str, int] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    peers: dict[str, Any] = field(default_factory=dict)

    def free(self) -> None:
        """Free every reducer and MPI handle made."""
        for r in self.reducers.values():
            r.free()
        for h in self.handles:
            h.Free()


def _per_tensor(comm: MPI.Comm, grads: Sequence[np.ndarray]) -> None:
    scale = 1.0 / comm.Get_size()
    for g in grads:
        comm.Allreduce(MPI.IN_PLACE, g)
        np.multiply(g, scale, out=g)


def _add_packed_floor(comm: MPI.Intracomm, grads: list[np.ndarray], m: _Methods) -> None:
    """``packed-floor``: pack (one MPI call), chunked Allreduce with scaling, unpack (one MPI call)."""
    if len({g.dtype for g in grads}) != 1:
        m.skipped["packed-floor"] = "gradients of several dtypes"
        return
    buf = empty(sum(g.size for g in grads), grads[0].dtype, "cpu")  # as the reducer's buffers (huge pages)
    local = MPI.COMM_SELF.Dup()
    m.handles.append(local)
    members = MPI.BYTE.Create_hindexed([g.nbytes for g in grads], [MPI.Get_address(g) for g in grads]).Commit()
    m.handles.append(members)
    step, scale = max(1, MIB // buf.itemsize), 1.0 / comm.Get_size()

    def run() -> None:
        local.Sendrecv([MPI.BOTTOM, 1, members], 0, 0, [buf, MPI.BYTE], 0, 0)
        for first in range(0, buf.shape[0], step):
            chunk = buf[first : first + step]
            comm.Allreduce(MPI.IN_PLACE, chunk)
            np.multiply(chunk, scale, out=chunk)
        local.Sendrecv([buf, MPI.BYTE], 0, 0, [MPI.BOTTOM, 1, members], 0, 0)

    m.messages["packed-floor"] = -(-buf.nbytes // MIB)
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    m.cases.append(Case("packed-floor", filler(grads, value), run, lambda: all_close(grads, mean)))


def _shard_step(reducer: DistributedGradReducer, grads: list[np.ndarray], params: list[np.ndarray]) -> None:
    """reduce_scatter, this rank's pieces into ``params``, allgather."""
    shard = reducer.reduce_scatter(grads)
    for piece in shard:
        params[piece.index].reshape(-1)[piece.start : piece.stop] = piece.grad
    shard.allgather(params)


def _add_reducers(comm: MPI.Intracomm, grads: list[np.ndarray], methods: Sequence[str], m: _Methods) -> None:
    """The numpy reducer methods."""
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    variants: tuple[tuple[str, dict[str, Any]], ...] = (
        ("reducer", {}), ("reducer-novalidate", {"validate": "never"}),
        ("reducer-deterministic", {"deterministic": True}))
    for name, kwargs in variants:
        if name in methods:
            r = m.reducers[name] = DistributedGradReducer(grads, group=comm, **kwargs)
            m.cases.append(Case(name, filler(grads, value), partial(r, grads), lambda: all_close(grads, mean)))
    if "reducer-fp16" in methods:
        _add_fp16(comm, grads, m)
    if "reducer-views" in methods:
        r = m.reducers["reducer-views"] = DistributedGradReducer(grads, group=comm)
        views = r.allocate_grads()
        m.cases.append(Case("reducer-views", filler(views, value), partial(r, views),
                            partial(all_close, views, mean)))
    if "reducer-fresh" in methods:
        _add_fresh(comm, grads, m)
    if "reducer-shard" in methods:
        r = m.reducers["reducer-shard"] = DistributedGradReducer(grads, group=comm)
        params = [np.empty_like(g) for g in grads]
        m.cases.append(Case("reducer-shard", filler(grads, value), partial(_shard_step, r, grads, params),
                            lambda: all_close(params, mean)))


def _add_fp16(comm: MPI.Intracomm, grads: list[np.ndarray], m: _Methods) -> None:
    """``reducer-fp16``: the reducer with ``compression="fp16"``, where it takes the workload's dtypes."""
    holder: dict[str, DistributedGradReducer] = {}
    why = agree(comm, lambda: holder.setdefault("r", DistributedGradReducer(grads, group=comm, compression="fp16")))
    if why is not None:  # a reducer built on some ranks only is left alone: freeing it could wait for the others
        m.skipped["reducer-fp16"] = f"refused by the reducer: {why}"
        return
    r = m.reducers["reducer-fp16"] = holder["r"]
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    m.cases.append(Case("reducer-fp16", filler(grads, value), partial(r, grads), lambda: all_close(grads, mean)))


def _add_fresh(comm: MPI.Intracomm, grads: list[np.ndarray], m: _Methods) -> None:
    """``reducer-fresh``: every call with other arrays than the call before (two lists, in turn)."""
    r = m.reducers["reducer-fresh"] = DistributedGradReducer(grads, group=comm)
    lists = [[np.zeros_like(g) for g in grads], [np.zeros_like(g) for g in grads]]
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    turn = [0]

    def prepare() -> None:
        turn[0] ^= 1
        filler(lists[turn[0]], value)()

    m.cases.append(Case("reducer-fresh", prepare, lambda: r(lists[turn[0]]), lambda: all_close(lists[turn[0]], mean)))


def _add_torch_reducer(comm: MPI.Intracomm, grads: list[np.ndarray], unsupported: str | None, m: _Methods) -> None:
    """``reducer-torch``: torch tensors over ``grads``' memory, fed to a reducer built from them."""
    if unsupported is not None:
        m.skipped["reducer-torch"] = unsupported
        return
    import torch

    tensors = [torch.from_numpy(g) for g in grads]
    holder: dict[str, DistributedGradReducer] = {}
    why = agree(comm, lambda: holder.setdefault("r", DistributedGradReducer(tensors, group=comm)))
    if why is not None:
        m.skipped["reducer-torch"] = f"not supported by this reducer (construction: {why})"
        return
    r = m.reducers["reducer-torch"] = holder["r"]
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    case = Case("reducer-torch", filler(grads, value), lambda: r(tensors), lambda: all_close(grads, mean))
    kept, failed = keep_working(comm, [case])
    m.cases.extend(kept)
    if failed:
        m.skipped["reducer-torch"] = f"not supported by this reducer (call: {failed['reducer-torch']})"


def _workload_methods(comm: MPI.Intracomm, wl: Workload, grads: list[np.ndarray], methods: Sequence[str],
                      gloo: Gloo | None, torch_unsupported: str | None, powersgd_rank: int = 4) -> _Methods:
    """Every requested case of one workload; reducers are built here (collective)."""
    m = _Methods()
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    try:
        if "limit" in methods:
            cases, m.limit_sizes = limit_cases(comm, wl.nbytes, LIMIT_CHUNKS)
            m.cases.extend(cases)
        if "per-tensor" in methods:
            m.messages["per-tensor"] = wl.count
            m.cases.append(Case("per-tensor", filler(grads, value), lambda: _per_tensor(comm, grads),
                                lambda: all_close(grads, mean)))
        if "packed-floor" in methods:
            _add_packed_floor(comm, grads, m)
        _add_reducers(comm, grads, methods, m)
        if "reducer-torch" in methods:
            _add_torch_reducer(comm, grads, torch_unsupported, m)
        if "torch-gloo" in methods and gloo is not None:
            run, m.messages["torch-gloo"] = gloo.ddp_like(grads)
            m.cases.append(Case("torch-gloo", filler(grads, value), run, lambda: all_close(grads, mean)))
        powersgd.add_cases(comm, grads, methods, powersgd_rank, gloo, m.cases, m.reducers, m.skipped, m.peers)
    except BaseException:
        m.free()
        raise
    for name, r in m.reducers.items():
        m.messages[name] = len(r.buckets) * (2 if name == "reducer-shard" else 1)  # reduce-scatter + allgather
    m.messages.pop("reducer-powersgd", None)  # its buckets are not all it sends: see its reducer_stats
    return m


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
    m = _workload_methods(comm, wl, grads, methods, gloo, torch_unsupported, powersgd_rank)
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


def _method_summaries(wl: Workload, results: dict[str, dict[str, Any]], m: _Methods,
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
             "reducer_over_one_allreduce": ("reducer", _WHOLE),
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


# -- output -----------------------------------------------------------------------------


def _method_line(method: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    ratio = f"{m['ratio_to_limit']:.2f}" if "ratio_to_limit" in m else "-"
    notes = []
    if method == "limit":
        notes.append(f"chunk {m['chunk']}")
    if method in res["messages"]:
        notes.append(f"{res['messages'][method]} messages")
    return (f"  {method:<20}{m['median_ms']:>11.2f}{m['min_ms']:>10.2f}{ratio:>9}{m['algbw_GBps']:>12.3f}"
            f"{m['busbw_GBps']:>12.3f}  {', '.join(notes)}")


def _derived_lines(name: str, res: dict[str, Any]) -> list[str]:
    lines = []
    if "torch_over_reducer" in res:
        lines.append(f"  reducer-torch / reducer = {res['torch_over_reducer']:.2f} "
                     f"(torch CPU tensors against numpy arrays, same memory)")
    if "shard_over_reducer" in res:
        lines.append(f"  reducer-shard / reducer = {res['shard_over_reducer']:.2f} "
                     f"(reduce_scatter + allgather against the Allreduce of the same plan)")
    if "deterministic_over_reducer" in res:
        lines.append(f"  reducer-deterministic / reducer = {res['deterministic_over_reducer']:.2f} "
                     f"(every element summed in rank order)")
    if name == "small" and "reducer_over_one_allreduce" in res:
        lines.append(f"  reducer / one Allreduce of all {res['bytes']} bytes = {res['reducer_over_one_allreduce']:.2f}")
    if "reducer_over_floor" in res:
        lines.append(f"  reducer / packed-floor = {res['reducer_over_floor']:.2f} "
                     "(against the least a reducer that packs must do)")
    if "fresh_over_reducer" in res:
        lines.append(f"  reducer-fresh / reducer = {res['fresh_over_reducer']:.2f} "
                     "(the first call after the arrays change, against the same arrays again)")
    if name == "small" and "always_over_never" in res:
        lines.append(f"  validate=\"always\" / validate=\"never\" = {res['always_over_never']:.2f}")
    if "validation_cost_percent" in res:
        lines.append(f"  validation cost: {noise_or(res['validation_cost_percent'], '.1f', '%')} of reducer "
                     f"(median of the paired differences with reducer-novalidate); from its local part, the "
                     f"overlap check, {res['validation_local_ms']:.2f} ms = {res['validation_estimate_percent']:.2f}% "
                     "(the verdict rides in the first message)")
    return lines


def format_workload(name: str, res: dict[str, Any]) -> str:
    """The table of one workload's results (what rank 0 prints)."""
    lines = [
        f"{name}: {res['tensors']} tensors, {bytes_label(res['bytes'])} ({'/'.join(res['dtypes'])}), "
        f"{res['ranks']} ranks — {res['note']}",
        f"  {'method':<20}{'median ms':>11}{'min ms':>10}{'x limit':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}  notes",
    ]
    lines.extend(_method_line(method, m, res) for method, m in res["methods"].items())
    lines.extend(f"  {method:<20}skipped: {why}" for method, why in res.get("skipped", {}).items())
    if "limit_by_chunk" in res:
        chunks = ", ".join(f"{size_label(v['chunk_bytes'])} {v['median_ms']:.2f}"
                           for v in res["limit_by_chunk"].values())
        lines.append(f"  limit by chunk (ms): {chunks}")
    lines.extend(_derived_lines(name, res))
    if "powersgd_rank" in res:
        lines.extend(powersgd.format_lines(res))
    if "network" in res:
        lines.extend(network_lines(res["network"]))
    return "\n".join(lines)


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
