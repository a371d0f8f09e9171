"""Experiments that chose the reducer's constants, and the Allreduce bandwidth curve.

``--sweep`` runs them: the reducer at several ``bucket_bytes`` (ResNet-50 and
many-small); the chunk size of the in-place transport on ResNet-50's large
tensors; for one tensor of 16 KiB to 4 MiB, packing it into a fused
buffer against reducing it alone in place; and the same Allreduces over
ResNet-50's large tensors where they lie, against one buffer on huge pages
and one on ordinary pages (what memory pages cost MPI). ``--plot`` adds the curve: single
Allreduces of 4 KiB to 64 MiB.
"""

from __future__ import annotations

import contextlib
import mmap
import statistics
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer, reducer as reducer_module
from .._core import backend, transport
from .._core.hosts import Hosts
from .._core.topology import Topology
from .environment import huge_pages
from .limit import chunked_allreduce, limit_cases
from .output import KIB, MIB, size_label
from .timing import Case, all_close, expected_sum, fill_value, filler, summary, time_cases
from .workloads import Workload, resnet50

__all__ = ["CURVE_SIZES", "SWEEPS", "allreduce_curve", "format_sweeps", "run_sweeps", "sweep_buckets", "sweep_chunks",
           "sweep_direct", "sweep_pages"]

#: The experiments of ``--sweep``.
SWEEPS = ("buckets", "chunks", "direct", "pages")
#: ``bucket_bytes`` values of the reducer sweep.
SWEEP_BUCKETS = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 25 * MIB)
#: Chunk sizes of the reducer sweep's limit.
SWEEP_LIMIT_CHUNKS = (1 * MIB, 4 * MIB, 16 * MIB)
#: Chunk sizes of the transport sweep.
SWEEP_CHUNKS = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 16 * MIB)
#: Tensor sizes of the pack-or-alone experiment.
SWEEP_DIRECT = tuple(16 * KIB << k for k in range(9))  # 16 KiB ... 4 MiB
#: Single-message sizes of the Allreduce bandwidth curve (the plot).
CURVE_SIZES = tuple(4 * KIB << k for k in range(15))  # 4 KiB ... 64 MiB

def sweep_buckets(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> dict[str, Any]:
    """The reducer at each of SWEEP_BUCKETS, on ordinary arrays and on views.

    Caps that give the same plan as a smaller cap are not timed again (the
    answer names the cap they share a plan with).
    """
    size = comm.Get_size()
    value = fill_value(comm)
    mean = expected_sum(comm) / size
    grads = wl.arrays()
    cases, sizes = limit_cases(comm, wl.nbytes, SWEEP_LIMIT_CHUNKS)
    reducers: list[DistributedGradReducer] = []
    counts: dict[int, int] = {}
    same_as: dict[int, int] = {}
    plans: dict[tuple[tuple[int, ...], ...], int] = {}
    try:
        for cap in SWEEP_BUCKETS:
            r = DistributedGradReducer(grads, group=comm, bucket_bytes=cap)
            plan = tuple(b.indices for b in r.buckets)
            if plan in plans:
                same_as[cap] = plans[plan]
                r.free()
                continue
            plans[plan] = cap
            reducers.append(r)
            counts[cap] = len(r.buckets)
            cases.append(Case(f"reducer@{size_label(cap)}", filler(grads, value), partial(r, grads),
                              lambda: all_close(grads, mean)))
            rv = DistributedGradReducer(grads, group=comm, bucket_bytes=cap)
            reducers.append(rv)
            views = rv.allocate_grads()
            cases.append(Case(f"views@{size_label(cap)}", filler(views, value),
                              partial(rv, views), partial(all_close, views, mean)))
        times = time_cases(comm, cases, reps, warmup)
    finally:
        for r in reducers:
            r.free()
    limit = min(statistics.median(times[n]) for n in sizes)
    rows = []
    for cap in SWEEP_BUCKETS:
        row: dict[str, Any] = {"bucket_bytes": cap}
        if cap in same_as:
            row["same_plan_as"] = same_as[cap]
        else:
            for kind in ("reducer", "views"):
                name = f"{kind}@{size_label(cap)}"
                med = statistics.median(times[name])
                row[kind] = {"median_ms": med * 1e3, "ratio_to_limit": med / limit, "buckets": counts[cap]}
        rows.append(row)
    return {"workload": wl.name, "limit_ms": limit * 1e3, "rows": rows}


def sweep_chunks(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> dict[str, Any]:
    """The in-place transport at each of SWEEP_CHUNKS on the workload's tensors of >= DIRECT_BYTES.

    This is what the reducer does with those tensors: ``transport.allreduce``
    over each, chunked, a mean's large chunks summed by the reducer's summer
    (:class:`~mpi_gradreducer._core.hosts.Hosts`: two levels across hosts), each
    chunk multiplied by ``1 / size`` while in cache. The same without the
    multiplication ("sum": one Allreduce a chunk) shows what the mean costs.
    """
    size = comm.Get_size()
    value = fill_value(comm)
    total = expected_sum(comm)
    big = [g for g in wl.arrays() if g.nbytes >= reducer_module.DIRECT_BYTES and g.dtype == np.float32]
    flats = [g.reshape(-1) for g in big]

    hosts = Hosts(comm, Topology.of(comm))
    summers = {c: hosts.ordered_sum(np.float32, c) for c in SWEEP_CHUNKS}

    def run(chunk: int, scale: float) -> None:
        for f in flats:
            transport.allreduce(comm, f, scale, chunk_bytes=chunk, ordered=summers[chunk])

    cases = []
    for c in SWEEP_CHUNKS:
        for kind, scale in (("mean", 1.0 / size), ("sum", 1.0)):
            cases.append(Case(f"{kind}@{size_label(c)}", filler(flats, value),
                              partial(run, c, scale), partial(all_close, flats, total * scale)))
    times = time_cases(comm, cases, reps, warmup)
    hosts.free()
    nbytes = sum(f.nbytes for f in flats)
    rows = []
    for c in SWEEP_CHUNKS:
        row: dict[str, Any] = {"chunk_bytes": c}
        for kind in ("mean", "sum"):
            stats = summary(times[f"{kind}@{size_label(c)}"], nbytes, size)
            del stats["times_ms"]
            row[kind] = stats
        rows.append(row)
    return {"workload": wl.name, "tensors": len(flats), "bytes": nbytes, "rows": rows}


def sweep_pages(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> dict[str, Any]:
    """In-place Allreduces of 1 MiB over the workload's tensors of >= DIRECT_BYTES, by where their memory lies.

    ``tensors``: the separately allocated arrays themselves (numpy asks for
    huge pages only from 4 MiB); ``huge pages``: the same bytes in one buffer
    allocated as the reducer's; ``small pages``: in one buffer that asks for
    ordinary pages (``MADV_NOHUGEPAGE``). The same calls, the same bytes.
    """
    size = comm.Get_size()
    value, total = fill_value(comm), expected_sum(comm)
    flats = [g.reshape(-1) for g in wl.arrays() if g.nbytes >= reducer_module.DIRECT_BYTES and g.dtype == np.float32]
    count = sum(f.shape[0] for f in flats)
    huge = backend.empty(count, np.dtype(np.float32), "cpu")
    memory = mmap.mmap(-1, max(4, count * 4), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without huge pages: ordinary pages anyway
            memory.madvise(mmap.MADV_NOHUGEPAGE)
    small = np.frombuffer(memory, np.float32, count)
    step = MIB // 4
    layouts = {"tensors": flats, "huge pages": [huge], "small pages": [small]}

    def reduce_each(arrays: list[np.ndarray]) -> None:
        for x in arrays:
            chunked_allreduce(comm, x, step)

    cases = [Case(name, filler(arrays, value), partial(reduce_each, arrays), partial(all_close, arrays, total))
             for name, arrays in layouts.items()]
    times = time_cases(comm, cases, reps, warmup)
    rows = []
    for name in layouts:
        stats = summary(times[name], count * 4, size)
        del stats["times_ms"]
        rows.append({"memory": name, **stats})
    return {"workload": wl.name, "tensors": len(flats), "bytes": count * 4, "transparent_huge_pages": huge_pages(),
            "rows": rows}


def sweep_direct(comm: MPI.Intracomm, reps: int, warmup: int, base_count: int = 64) -> dict[str, Any]:
    """For one float32 tensor of each of SWEEP_DIRECT: packed with small ones, or reduced alone.

    Both variants reduce the same ``base_count`` small tensors (1024 float32
    each) packed in one fused buffer, as the reducer does: one concatenate
    into the buffer, chunked Allreduce, scaled copy out. "packed" adds the tensor to that buffer;
    "alone" reduces it in place in a separate chunked Allreduce that scales
    each chunk. The difference is the marginal cost of each choice.
    """
    size = comm.Get_size()
    value = fill_value(comm)
    mean = expected_sum(comm) / size
    scale = 1.0 / size
    cases: list[Case] = []

    def packed_run(buf: np.ndarray, views: list[np.ndarray], members: list[np.ndarray]) -> None:
        np.concatenate([g.reshape(-1) for g in members], out=buf)
        transport.allreduce(comm, buf, 1.0)
        for v, g in zip(views, members, strict=True):
            np.multiply(v, scale, out=g)

    def split(buf: np.ndarray, members: list[np.ndarray]) -> list[np.ndarray]:
        views, offset = [], 0
        for g in members:
            views.append(buf[offset : offset + g.size].reshape(g.shape))
            offset += g.size
        return views

    for nbytes in SWEEP_DIRECT:
        base = [np.zeros(1024, np.float32) for _ in range(base_count)]
        tensor = np.zeros(nbytes // 4, np.float32)
        members = base + [tensor]
        buf = np.zeros(sum(g.size for g in members), np.float32)
        views = split(buf, members)
        cases.append(Case(f"packed@{size_label(nbytes)}", filler(members, value),
                          partial(packed_run, buf, views, members), partial(all_close, members, mean)))
        base2 = [np.zeros(1024, np.float32) for _ in range(base_count)]
        tensor2 = np.zeros(nbytes // 4, np.float32)
        buf2 = np.zeros(sum(g.size for g in base2), np.float32)
        views2 = split(buf2, base2)

        def alone(b: np.ndarray = buf2, v: list[np.ndarray] = views2, m: list[np.ndarray] = base2,
                  t: np.ndarray = tensor2) -> None:
            packed_run(b, v, m)
            transport.allreduce(comm, t, scale)

        cases.append(Case(f"alone@{size_label(nbytes)}", filler(base2 + [tensor2], value), alone,
                          partial(all_close, base2 + [tensor2], mean)))
    times = time_cases(comm, cases, reps, warmup)
    rows = []
    for nbytes in SWEEP_DIRECT:
        p = np.array(times[f"packed@{size_label(nbytes)}"])
        a = np.array(times[f"alone@{size_label(nbytes)}"])
        rows.append({"tensor_bytes": nbytes, "packed_ms": float(np.median(p)) * 1e3,
                     "alone_ms": float(np.median(a)) * 1e3,
                     "alone_minus_packed_ms": float(np.median(a - p)) * 1e3})
    return {"base": f"{base_count} x 1024 float32", "rows": rows}


def allreduce_curve(comm: MPI.Intracomm, reps: int, warmup: int) -> list[dict[str, Any]]:
    """Single in-place Allreduces of each of CURVE_SIZES.

    Sizes under 4 MiB are timed as up to 8 Allreduces per sample, each over
    its own freshly filled slice (so that no value is summed twice).
    """
    size = comm.Get_size()
    buf = np.zeros(CURVE_SIZES[-1] // 4, np.float32)
    value, total = fill_value(comm), expected_sum(comm)
    cases = []
    inner_of = {}
    for nbytes in CURVE_SIZES:
        inner = int(min(8, max(1, (4 * MIB) // nbytes)))
        inner_of[nbytes] = inner
        n = nbytes // 4
        parts = [buf[j * n : (j + 1) * n] for j in range(inner)]
        used = buf[: inner * n]

        def run(parts: list[np.ndarray] = parts) -> None:
            for p in parts:
                comm.Allreduce(MPI.IN_PLACE, p)

        cases.append(Case(size_label(nbytes), partial(used.fill, value), run, partial(all_close, [used], total)))
    times = time_cases(comm, cases, reps, warmup)
    rows = []
    for nbytes in CURVE_SIZES:
        per_call = [t / inner_of[nbytes] for t in times[size_label(nbytes)]]
        row = summary(per_call, nbytes, size)
        del row["times_ms"]
        rows.append(dict(row, bytes=nbytes))
    return rows


def format_sweeps(sweeps: dict[str, Any]) -> str:
    """The tables of :func:`run_sweeps`'s results."""
    lines = []
    for res in sweeps.get("bucket_bytes", []):
        lines.append(f"bucket_bytes sweep, {res['workload']} (limit {res['limit_ms']:.2f} ms):")
        lines.append(f"  {'bucket_bytes':<14}{'ordinary ms':>12}{'x limit':>9}{'views ms':>10}{'x limit':>9}"
                     f"{'messages':>10}")
        for row in res["rows"]:
            if "same_plan_as" in row:
                lines.append(f"  {size_label(row['bucket_bytes']):<14}same plan as {size_label(row['same_plan_as'])}")
                continue
            o, v = row["reducer"], row["views"]
            lines.append(f"  {size_label(row['bucket_bytes']):<14}{o['median_ms']:>12.2f}{o['ratio_to_limit']:>9.2f}"
                         f"{v['median_ms']:>10.2f}{v['ratio_to_limit']:>9.2f}{o['buckets']:>10}")
    if "chunk_bytes" in sweeps:
        res = sweeps["chunk_bytes"]
        lines.append(f"chunk sweep: transport.allreduce on {res['workload']}'s {res['tensors']} tensors "
                     f">= DIRECT_BYTES ({res['bytes'] / 1e6:.1f} MB):")
        lines.append(f"  {'chunk':<10}{'mean ms':>9}{'busbw GB/s':>12}{'sum ms':>9}{'busbw GB/s':>12}")
        for row in res["rows"]:
            m, t = row["mean"], row["sum"]
            lines.append(f"  {size_label(row['chunk_bytes']):<10}{m['median_ms']:>9.2f}{m['busbw_GBps']:>12.3f}"
                         f"{t['median_ms']:>9.2f}{t['busbw_GBps']:>12.3f}")
    if "direct_bytes" in sweeps:
        res = sweeps["direct_bytes"]
        lines.append(f"pack or alone: one float32 tensor with {res['base']} packed:")
        lines.append(f"  {'tensor':<10}{'packed ms':>11}{'alone ms':>10}{'alone-packed':>14}")
        for row in res["rows"]:
            lines.append(f"  {size_label(row['tensor_bytes']):<10}{row['packed_ms']:>11.3f}{row['alone_ms']:>10.3f}"
                         f"{row['alone_minus_packed_ms']:>+14.3f}")
    if "pages" in sweeps:
        res = sweeps["pages"]
        lines.append(f"memory pages: 1 MiB Allreduces over {res['workload']}'s {res['tensors']} tensors "
                     f">= DIRECT_BYTES ({res['bytes'] / 1e6:.1f} MB; transparent huge pages: "
                     f"{res['transparent_huge_pages']}):")
        lines.append(f"  {'memory':<14}{'median ms':>10}{'busbw GB/s':>12}")
        for row in res["rows"]:
            lines.append(f"  {row['memory']:<14}{row['median_ms']:>10.2f}{row['busbw_GBps']:>12.3f}")
    return "\n".join(lines)


def run_sweeps(comm: MPI.Intracomm, chosen: list[str], many: Workload, reps: int, warmup: int) -> dict[str, Any]:
    """The experiments in ``chosen`` (names of :data:`SWEEPS`; empty: all), collective.

    Args:
        comm: the communicator.
        chosen: which experiments.
        many: the many-small workload of the bucket sweep (ResNet-50 is the other).
        reps: timed repetitions.
        warmup: untimed repetitions first.
    """
    chosen = chosen or list(SWEEPS)
    sweeps: dict[str, Any] = {}
    if "buckets" in chosen:
        sweeps["bucket_bytes"] = [sweep_buckets(comm, wl, reps, warmup) for wl in (resnet50(), many)]
    if "chunks" in chosen:
        sweeps["chunk_bytes"] = sweep_chunks(comm, resnet50(), reps, warmup)
    if "direct" in chosen:
        sweeps["direct_bytes"] = sweep_direct(comm, reps, warmup)
    if "pages" in chosen:
        sweeps["pages"] = sweep_pages(comm, resnet50(), reps, warmup)
    return sweeps
