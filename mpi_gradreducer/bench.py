"""Benchmark of the reducer against the raw MPI limit, a per-tensor loop and torch gloo.

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
    buffer of the same bytes, in chunks of 256 KiB, 1, 4, 16 MiB or whole; the
    fastest chunk size (by median) is the limit, and is reported.
``per-tensor``
    One in-place Allreduce per gradient, each followed by a multiplication by
    ``1 / size``.
``reducer``
    :class:`DistributedGradReducer` on separately allocated arrays.
``reducer-novalidate``
    The same with ``validate="never"``: the difference is the cost of the
    cross-rank validation.
``reducer-views``
    The reducer on the arrays of ``reducer.allocate_grads()`` (no copies).
``torch-gloo``
    When torch is importable: ``torch.distributed`` with the gloo backend
    doing what DDP does: buckets in reverse parameter order, per dtype, of
    1 MiB for the first and 25 MiB after that; each bucket is copied into a
    flat buffer, all-reduced, divided by the world size and copied back.

Bandwidths follow the nccl-tests convention: ``algbw = bytes / time`` and
``busbw = algbw * 2 (n - 1) / n``.

``--sweep`` adds three experiments to choose the reducer's constants from
measurement: the reducer at several ``bucket_bytes`` (resnet50, many-small);
the chunk size of the in-place transport on ResNet-50's large tensors; and,
for one tensor of 16 KiB to 4 MiB, packing it into a fused buffer against
reducing it alone in place.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import __version__, reducer as reducer_module, transport
from .reducer import DistributedGradReducer

__all__ = [
    "Case",
    "Workload",
    "bert_base",
    "main",
    "many_small",
    "mixed",
    "resnet50",
    "time_cases",
]

KIB = 1 << 10
MIB = 1 << 20

WORKLOADS = ("resnet50", "bert-base", "many-small", "mixed")
METHODS = ("limit", "per-tensor", "reducer", "reducer-novalidate", "reducer-views", "torch-gloo")
#: Chunk sizes tried for the raw-MPI limit; 0 stands for "the whole buffer at once".
LIMIT_CHUNKS = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 0)
#: ``bucket_bytes`` values of the reducer sweep.
SWEEP_BUCKETS = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 25 * MIB)
#: The experiments of ``--sweep``.
SWEEPS = ("buckets", "chunks", "direct")
#: Chunk sizes of the transport sweep.
SWEEP_CHUNKS = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 16 * MIB)
#: Tensor sizes of the pack-or-alone experiment.
SWEEP_DIRECT = tuple(16 * KIB << k for k in range(9))  # 16 KiB ... 4 MiB
#: Single-message sizes of the Allreduce bandwidth curve (the plot).
CURVE_SIZES = tuple(4 * KIB << k for k in range(15))  # 4 KiB ... 64 MiB
#: Name of the internal case that times the validation's tiny Allreduce.
_TINY = "tiny-allreduce"
#: DDP's bucket caps: the first bucket, then every other.
DDP_FIRST_BUCKET = 1 * MIB
DDP_BUCKET = 25 * MIB


# -- workloads --------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A list of gradient shapes and dtypes.

    Attributes:
        name: the workload's name.
        shapes: one shape per tensor, in parameter order.
        dtypes: one dtype per tensor.
        note: how the shapes were made.
    """

    name: str
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[np.dtype, ...]
    note: str

    @property
    def count(self) -> int:
        """Number of tensors."""
        return len(self.shapes)

    @property
    def elements(self) -> int:
        """Total number of elements (parameters)."""
        return int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))

    @property
    def nbytes(self) -> int:
        """Total bytes of the gradients."""
        return int(sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(self.shapes, self.dtypes)))

    def facts(self, ranks: int) -> Dict[str, Any]:
        """What a results file records about the workload, run over ``ranks`` ranks."""
        return {
            "tensors": self.count,
            "parameters": self.elements,
            "bytes": self.nbytes,
            "dtypes": sorted({d.name for d in self.dtypes}),
            "ranks": ranks,
            "note": self.note,
        }

    def arrays(self) -> List[np.ndarray]:
        """One separately allocated, zero-filled array per tensor."""
        return [np.zeros(s, dtype=d) for s, d in zip(self.shapes, self.dtypes)]


def resnet50(num_classes: int = 1000) -> Workload:
    """ResNet-50's parameters, in torchvision's order.

    A 7x7 stem convolution, then bottleneck blocks (1x1, 3x3, 1x1 convolutions,
    each followed by a batch norm with weight and bias) in stages of 3, 4, 6
    and 3 blocks of widths 64, 128, 256 and 512 (expansion 4); the first
    block of each stage has a 1x1 projection shortcut with its batch norm; then
    the classifier: 161 tensors, 25,557,032 float32 parameters.
    """
    shapes: List[Tuple[int, ...]] = []

    def conv_bn(cout: int, cin: int, k: int) -> None:
        shapes.extend([(cout, cin, k, k), (cout,), (cout,)])

    conv_bn(64, 3, 7)
    cin = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            conv_bn(width, cin, 1)
            conv_bn(width, width, 3)
            conv_bn(4 * width, width, 1)
            if b == 0:
                conv_bn(4 * width, cin, 1)
            cin = 4 * width
    shapes.extend([(num_classes, cin), (num_classes,)])
    f32 = np.dtype(np.float32)
    return Workload("resnet50", tuple(shapes), (f32,) * len(shapes), "ResNet-50 (torchvision layout), float32")


def bert_base(scale: float = 1.0) -> Workload:
    """BERT-base's parameters (the encoder with pooler), optionally shrunk.

    Full size: embeddings (30522-word vocabulary, 512 positions, 2 token
    types, hidden 768, layer norm), 12 layers of self-attention (query, key,
    value and output projections with biases, layer norm) and feed-forward
    (768 -> 3072 -> 768 with biases, layer norm), and the pooler: 199 float32
    tensors, 109,482,240 parameters.

    ``scale`` < 1 keeps every per-layer shape as it is (hidden 768,
    intermediate 3072) and scales the two things that make up the size: the
    number of layers, ``max(1, round(12 * scale))``, and the vocabulary,
    ``round(30522 * scale)``; the parameter count is then about ``scale``
    times the full one.

    Args:
        scale: in (0, 1].
    """
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale: expected a number in (0, 1], got {scale!r}")
    hidden, inter, positions, types = 768, 3072, 512, 2
    layers = max(1, round(12 * scale))
    vocab = max(1, round(30522 * scale))
    shapes: List[Tuple[int, ...]] = [(vocab, hidden), (positions, hidden), (types, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _qkvo in range(4):
            shapes.extend([(hidden, hidden), (hidden,)])
        shapes.extend([(hidden,), (hidden,)])
        shapes.extend([(inter, hidden), (inter,), (hidden, inter), (hidden,), (hidden,), (hidden,)])
    shapes.extend([(hidden, hidden), (hidden,)])
    f32 = np.dtype(np.float32)
    note = f"BERT-base, {layers} of 12 layers, vocabulary {vocab} of 30522 (scale {scale:g}), float32"
    return Workload("bert-base", tuple(shapes), (f32,) * len(shapes), note)


def many_small(count: int = 1000, size: int = 1024) -> Workload:
    """``count`` float32 tensors of ``size`` elements each."""
    if count <= 0 or size <= 0:
        raise ValueError(f"many-small: expected a positive count and size, got {count} x {size}")
    f32 = np.dtype(np.float32)
    return Workload("many-small", ((size,),) * count, (f32,) * count, f"{count} x {size} float32")


def mixed() -> Workload:
    """A small mixed-precision transformer: float16 weights, float32 embedding and norms.

    A float32 embedding (4096 x 256), then 8 blocks of [float32 layer norm
    weight and bias, float16 QKV (768 x 256) and output (256 x 256)
    projections with float16 biases, float32 layer norm, float16 feed-forward
    256 -> 1024 -> 256 with float16 biases], then a float32 final layer norm:
    99 tensors, 7.4 M parameters, 16.8 MB. The reducer sums float16 in
    float32, so it moves more bytes than the gradients hold.
    """
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    d, ff = 256, 1024
    shapes: List[Tuple[int, ...]] = [(4096, d)]
    dtypes: List[np.dtype] = [f32]
    for _ in range(8):
        block = [
            ((d,), f32), ((d,), f32),
            ((3 * d, d), f16), ((3 * d,), f16), ((d, d), f16), ((d,), f16),
            ((d,), f32), ((d,), f32),
            ((ff, d), f16), ((ff,), f16), ((d, ff), f16), ((d,), f16),
        ]
        shapes.extend(s for s, _ in block)
        dtypes.extend(t for _, t in block)
    shapes.extend([(d,), (d,)])
    dtypes.extend([f32, f32])
    return Workload("mixed", tuple(shapes), tuple(dtypes), "float16 weights, float32 embedding and norms")


def _make_workload(name: str, args: argparse.Namespace) -> Workload:
    if name == "resnet50":
        return resnet50()
    if name == "bert-base":
        return bert_base(args.scale)
    if name == "many-small":
        return many_small(args.small_count, args.small_size)
    return mixed()


# -- timing -----------------------------------------------------------------------------


@dataclass
class Case:
    """One timed method.

    Attributes:
        name: the method's name.
        prepare: writes fresh values into the method's arrays (not timed).
        run: the timed work.
        check: after a run, True when the results are right (not timed).
    """

    name: str
    prepare: Callable[[], None]
    run: Callable[[], None]
    check: Optional[Callable[[], bool]] = None


def time_cases(comm: MPI.Intracomm, cases: Sequence[Case], reps: int, warmup: int) -> Dict[str, List[float]]:
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
            comm.Barrier()
            t0 = time.perf_counter()
            case.run()
            elapsed = time.perf_counter() - t0
            if rep >= 0:
                times[rep, j] = elapsed
            if not checked[j]:
                checked[j] = True
                wrong[j] = 0 if case.check() else 1
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    comm.Allreduce(MPI.IN_PLACE, wrong, op=MPI.MAX)
    bad = [cases[j].name for j in range(k) if wrong[j]]
    if bad:
        raise RuntimeError(f"wrong results from: {', '.join(bad)}")
    return {c.name: [float(t) for t in times[:, j]] for j, c in enumerate(cases)}


def _summary(seconds: Sequence[float], nbytes: int, ranks: int) -> Dict[str, Any]:
    median = statistics.median(seconds)
    algbw = nbytes / median / 1e9 if median > 0 else float("inf")
    return {
        "median_ms": median * 1e3,
        "min_ms": min(seconds) * 1e3,
        "times_ms": [t * 1e3 for t in seconds],
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (ranks - 1) / ranks,
    }


def _fill_value(comm: MPI.Comm) -> float:
    """Rank r contributes 1 + r: exact in float16, no overflow, no denormals."""
    return 1.0 + comm.Get_rank()


def _expected_sum(comm: MPI.Comm) -> float:
    n = comm.Get_size()
    return n + n * (n - 1) / 2


def _all_close(arrays: Sequence[Any], value: float) -> bool:
    """A cheap check: a strided sample and the last element of every array."""
    for a in arrays:
        flat = np.asarray(a).reshape(-1)
        if flat.size == 0:
            continue
        sample = np.concatenate([flat[:: 97], flat[-1:]]).astype(np.float64)
        if not np.allclose(sample, value, rtol=1e-3, atol=0.0):
            return False
    return True


def _chunked_allreduce(comm: MPI.Comm, buf: np.ndarray, chunk_elems: int) -> None:
    for start in range(0, buf.shape[0], chunk_elems):
        comm.Allreduce(MPI.IN_PLACE, buf[start : start + chunk_elems])


def _size_label(nbytes: int) -> str:
    if nbytes == 0:
        return "whole"
    if nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def _limit_cases(comm: MPI.Comm, nbytes: int, chunks: Sequence[int]) -> Tuple[List[Case], Dict[str, int]]:
    """One ``limit@chunk`` case per chunk size, over one shared float32 buffer."""
    buf = np.zeros(max(1, -(-nbytes // 4)), dtype=np.float32)
    value, total = _fill_value(comm), _expected_sum(comm)
    cases, sizes = [], {}
    for chunk in [c for c in chunks if 0 < c < nbytes] + [0]:
        elems = buf.shape[0] if chunk == 0 else max(1, chunk // 4)
        name = f"limit@{_size_label(chunk)}"
        sizes[name] = chunk
        cases.append(Case(name, lambda: buf.fill(value),
                          lambda e=elems: _chunked_allreduce(comm, buf, e),
                          lambda: _all_close([buf], total)))
    return cases, sizes


def _per_tensor(comm: MPI.Comm, grads: Sequence[np.ndarray]) -> None:
    scale = 1.0 / comm.Get_size()
    for g in grads:
        comm.Allreduce(MPI.IN_PLACE, g)
        np.multiply(g, scale, out=g)


def _filler(arrays: Sequence[Any], value: float) -> Callable[[], None]:
    def fill() -> None:
        for a in arrays:
            a.fill(value)
    return fill


# -- torch gloo -------------------------------------------------------------------------


def _torch_usable(comm: MPI.Comm, wanted: bool) -> bool:
    """Whether every rank can import torch with gloo (the same answer on all ranks)."""
    ok = 0
    if wanted:
        try:
            import torch.distributed as dist

            ok = int(dist.is_available() and dist.is_gloo_available() and not dist.is_initialized())
        except Exception:  # torch missing or broken: skip the method everywhere
            ok = 0
    return bool(comm.allreduce(ok, op=MPI.MIN))


class _Gloo:
    """A gloo process group over the ranks of ``comm`` (TCP on rank 0's address)."""

    def __init__(self, comm: MPI.Comm) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        rank, size = comm.Get_rank(), comm.Get_size()
        hosts = comm.allgather(MPI.Get_processor_name())
        host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
        port = 0
        if rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        host, port = comm.bcast((host, port), root=0)
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)  # numpy's copies are single-threaded too; 4 ranks share 2 cores
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=300))
        self.size = size
        self.version = torch.__version__

    def close(self) -> None:
        self.dist.destroy_process_group()
        self.torch.set_num_threads(self._threads)

    def ddp_like(self, grads: Sequence[np.ndarray]) -> Tuple[Callable[[], None], int]:
        """DDP's reduction of ``grads`` (shared with numpy), and its bucket count."""
        torch, dist = self.torch, self.dist
        tensors = [torch.from_numpy(g) for g in grads]
        buckets: List[List[int]] = []
        open_bucket: Dict[Any, Tuple[List[int], int]] = {}
        filled_count: Dict[Any, int] = {}
        for i in reversed(range(len(tensors))):
            t = tensors[i]
            members, nbytes = open_bucket.get(t.dtype, ([], 0))
            members.append(i)
            nbytes += t.numel() * t.element_size()
            cap = DDP_FIRST_BUCKET if filled_count.get(t.dtype, 0) == 0 else DDP_BUCKET
            if nbytes >= cap:
                buckets.append(members)
                filled_count[t.dtype] = filled_count.get(t.dtype, 0) + 1
                open_bucket.pop(t.dtype, None)
            else:
                open_bucket[t.dtype] = (members, nbytes)
        buckets.extend(m for m, _ in open_bucket.values())
        plan = []
        for members in buckets:
            flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=tensors[members[0]].dtype)
            views, offset = [], 0
            for i in members:
                n = tensors[i].numel()
                views.append((flat[offset : offset + n], tensors[i].view(-1)))
                offset += n
            plan.append((flat, views))
        size = self.size

        def run() -> None:
            for flat, views in plan:
                for v, t in views:
                    v.copy_(t)
                dist.all_reduce(flat)
                flat.div_(size)
                for v, t in views:
                    t.copy_(v)

        return run, len(plan)


# -- one workload -----------------------------------------------------------------------


def _bench_workload(comm: MPI.Intracomm, wl: Workload, methods: Sequence[str], gloo: Optional[_Gloo],
                    reps: int, warmup: int) -> Dict[str, Any]:
    size = comm.Get_size()
    value = _fill_value(comm)
    mean = _expected_sum(comm) / size
    grads = wl.arrays()
    cases: List[Case] = []
    reducers: Dict[str, DistributedGradReducer] = {}
    limit_sizes: Dict[str, int] = {}
    buckets: Dict[str, int] = {}
    try:
        if "limit" in methods:
            limit_cases, limit_sizes = _limit_cases(comm, wl.nbytes, LIMIT_CHUNKS)
            cases.extend(limit_cases)
        if "per-tensor" in methods:
            buckets["per-tensor"] = wl.count
            cases.append(Case("per-tensor", _filler(grads, value), lambda: _per_tensor(comm, grads),
                              lambda: _all_close(grads, mean)))
        for name, kwargs in (("reducer", {}), ("reducer-novalidate", {"validate": "never"})):
            if name in methods:
                r = reducers[name] = DistributedGradReducer(grads, group=comm, **kwargs)
                cases.append(Case(name, _filler(grads, value), lambda r=r: r(grads), lambda: _all_close(grads, mean)))
        if "reducer-views" in methods:
            r = reducers["reducer-views"] = DistributedGradReducer(grads, group=comm)
            views = r.allocate_grads()
            cases.append(Case("reducer-views", _filler(views, value), lambda r=r, v=views: r(v),
                              lambda v=views: _all_close(v, mean)))
        if "torch-gloo" in methods and gloo is not None:
            run, buckets["torch-gloo"] = gloo.ddp_like(grads)
            cases.append(Case("torch-gloo", _filler(grads, value), run, lambda: _all_close(grads, mean)))
        for name, r in reducers.items():
            buckets[name] = len(r.buckets)
        if "reducer" in reducers and "reducer-novalidate" in reducers:
            # what the agreement of validate="always" sends: one tiny Allreduce
            flag = np.zeros(1, dtype=np.int64)
            cases.append(Case(_TINY, lambda: flag.fill(0), lambda: comm.Allreduce(MPI.IN_PLACE, flag),
                              lambda: bool(flag[0] == 0)))
        times = time_cases(comm, cases, reps, warmup)
        stats = {}
        for name, r in reducers.items():
            s = r.stats
            calls = max(1, s.calls)
            stats[name] = {"pack_ms": s.pack_seconds / calls * 1e3,
                           "allreduce_ms": s.allreduce_seconds / calls * 1e3,
                           "unpack_ms": s.unpack_seconds / calls * 1e3,
                           "wire_bytes": s.bytes // calls}
    finally:
        for r in reducers.values():
            r.free()
    results = {name: _summary(t, wl.nbytes, size) for name, t in times.items() if name != _TINY}
    out: Dict[str, Any] = {
        **wl.facts(size),
        "messages": buckets,
        "reducer_stats": stats,
    }
    methods_out: Dict[str, Any] = {}
    if limit_sizes:
        by_chunk = {name: results[name] for name in limit_sizes}
        best = min(by_chunk, key=lambda n: by_chunk[n]["median_ms"])
        out["limit_by_chunk"] = {name: dict(res, chunk_bytes=limit_sizes[name]) for name, res in by_chunk.items()}
        out["limit_chunk"] = _size_label(limit_sizes[best])
        out["limit_chunk_bytes"] = limit_sizes[best] or wl.nbytes
        buckets["limit"] = -(-wl.nbytes // out["limit_chunk_bytes"])
        methods_out["limit"] = dict(results[best], chunk=out["limit_chunk"])
    for name in METHODS:
        if name != "limit" and name in results:
            methods_out[name] = results[name]
    if "limit" in methods_out:
        limit_ms = methods_out["limit"]["median_ms"]
        for res in methods_out.values():
            res["ratio_to_limit"] = res["median_ms"] / limit_ms
    if "reducer" in times and "reducer-novalidate" in times:
        with_v, without = np.array(times["reducer"]), np.array(times["reducer-novalidate"])
        out["validation_cost_percent"] = float(np.median(with_v - without) / np.median(with_v) * 100)
        local = _local_validation_seconds(comm, wl, reps, warmup)
        tiny = statistics.median(times[_TINY])
        out["validation_local_ms"] = local * 1e3
        out["tiny_allreduce_ms"] = tiny * 1e3
        out["validation_estimate_percent"] = float((local + tiny) / np.median(with_v) * 100)
    out["methods"] = methods_out
    return out


def _local_validation_seconds(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> float:
    """The local work that ``validate="always"`` adds, timed on ``MPI.COMM_SELF``.

    Both modes check shapes, dtypes, devices and flags locally; "always"
    adds the check that no two gradients overlap, and the agreement, which on
    one process sends nothing. This is local CPU work, which noise can only
    slow down, so the difference of the two minimum times estimates it (15
    repetitions at least); the agreement's one tiny Allreduce is timed
    separately, in the interleaved run. Returns the median over the ranks.
    """
    grads = wl.arrays()
    value = _fill_value(comm)
    always = DistributedGradReducer(grads, group=MPI.COMM_SELF, timeout=None)
    never = DistributedGradReducer(grads, group=MPI.COMM_SELF, validate="never", timeout=None)
    try:
        fill = _filler(grads, value)
        cases = [Case("always", fill, lambda: always(grads)), Case("never", fill, lambda: never(grads))]
        times = time_cases(MPI.COMM_SELF, cases, max(reps, 15), max(warmup, 1))
    finally:
        always.free()
        never.free()
    cost = max(0.0, min(times["always"]) - min(times["never"]))
    return float(statistics.median(comm.allgather(cost)))


# -- sweeps -----------------------------------------------------------------------------


def _sweep_buckets(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> Dict[str, Any]:
    """The reducer at each of SWEEP_BUCKETS, on ordinary arrays and on views.

    Caps that give the same plan as a smaller cap are not timed again (the
    answer names the cap they share a plan with).
    """
    size = comm.Get_size()
    value = _fill_value(comm)
    mean = _expected_sum(comm) / size
    grads = wl.arrays()
    cases, sizes = _limit_cases(comm, wl.nbytes, [c for c in LIMIT_CHUNKS if c != 256 * KIB])
    reducers: List[DistributedGradReducer] = []
    counts: Dict[int, int] = {}
    same_as: Dict[int, int] = {}
    plans: Dict[Tuple[Tuple[int, ...], ...], int] = {}
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
            cases.append(Case(f"reducer@{_size_label(cap)}", _filler(grads, value), lambda r=r: r(grads),
                              lambda: _all_close(grads, mean)))
            rv = DistributedGradReducer(grads, group=comm, bucket_bytes=cap)
            reducers.append(rv)
            views = rv.allocate_grads()
            cases.append(Case(f"views@{_size_label(cap)}", _filler(views, value),
                              lambda rv=rv, views=views: rv(views), lambda views=views: _all_close(views, mean)))
        times = time_cases(comm, cases, reps, warmup)
    finally:
        for r in reducers:
            r.free()
    limit = min(statistics.median(times[n]) for n in sizes)
    rows = []
    for cap in SWEEP_BUCKETS:
        row: Dict[str, Any] = {"bucket_bytes": cap}
        if cap in same_as:
            row["same_plan_as"] = same_as[cap]
        else:
            for kind in ("reducer", "views"):
                name = f"{kind}@{_size_label(cap)}"
                med = statistics.median(times[name])
                row[kind] = {"median_ms": med * 1e3, "ratio_to_limit": med / limit, "buckets": counts[cap]}
        rows.append(row)
    return {"workload": wl.name, "limit_ms": limit * 1e3, "rows": rows}


def _sweep_chunks(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> Dict[str, Any]:
    """The in-place transport at each of SWEEP_CHUNKS on the workload's tensors of >= DIRECT_BYTES.

    This is what the reducer does with those tensors: ``transport.allreduce``
    over each, chunked, each chunk multiplied by ``1 / size`` right after its
    Allreduce. The same without the multiplication ("sum") shows what the
    mean costs.
    """
    size = comm.Get_size()
    value = _fill_value(comm)
    total = _expected_sum(comm)
    big = [g for g in wl.arrays() if g.nbytes >= reducer_module.DIRECT_BYTES and g.dtype == np.float32]
    flats = [g.reshape(-1) for g in big]

    def run(chunk: int, scale: float) -> None:
        for f in flats:
            transport.allreduce(comm, f, scale, chunk_bytes=chunk)

    cases = []
    for c in SWEEP_CHUNKS:
        for kind, scale in (("mean", 1.0 / size), ("sum", 1.0)):
            cases.append(Case(f"{kind}@{_size_label(c)}", _filler(flats, value),
                              lambda c=c, s=scale: run(c, s),
                              lambda s=scale: _all_close(flats, total * s)))
    times = time_cases(comm, cases, reps, warmup)
    nbytes = sum(f.nbytes for f in flats)
    rows = []
    for c in SWEEP_CHUNKS:
        row: Dict[str, Any] = {"chunk_bytes": c}
        for kind in ("mean", "sum"):
            summary = _summary(times[f"{kind}@{_size_label(c)}"], nbytes, size)
            del summary["times_ms"]
            row[kind] = summary
        rows.append(row)
    return {"workload": wl.name, "tensors": len(flats), "bytes": nbytes, "rows": rows}


def _sweep_direct(comm: MPI.Intracomm, reps: int, warmup: int, base_count: int = 64) -> Dict[str, Any]:
    """For one float32 tensor of each of SWEEP_DIRECT: packed with small ones, or reduced alone.

    Both variants reduce the same ``base_count`` small tensors (1024 float32
    each) packed in one fused buffer, as the reducer does: one concatenate
    into the buffer, chunked Allreduce, scaled copy out. "packed" adds the tensor to that buffer;
    "alone" reduces it in place in a separate chunked Allreduce that scales
    each chunk. The difference is the marginal cost of each choice.
    """
    size = comm.Get_size()
    value = _fill_value(comm)
    mean = _expected_sum(comm) / size
    scale = 1.0 / size
    cases: List[Case] = []

    def packed_run(buf: np.ndarray, views: List[np.ndarray], members: List[np.ndarray]) -> None:
        np.concatenate([g.reshape(-1) for g in members], out=buf)
        transport.allreduce(comm, buf, 1.0)
        for v, g in zip(views, members):
            np.multiply(v, scale, out=g)

    def split(buf: np.ndarray, members: List[np.ndarray]) -> List[np.ndarray]:
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
        cases.append(Case(f"packed@{_size_label(nbytes)}", _filler(members, value),
                          lambda b=buf, v=views, m=members: packed_run(b, v, m),
                          lambda m=members: _all_close(m, mean)))
        base2 = [np.zeros(1024, np.float32) for _ in range(base_count)]
        tensor2 = np.zeros(nbytes // 4, np.float32)
        buf2 = np.zeros(sum(g.size for g in base2), np.float32)
        views2 = split(buf2, base2)

        def alone(b: np.ndarray = buf2, v: List[np.ndarray] = views2, m: List[np.ndarray] = base2,
                  t: np.ndarray = tensor2) -> None:
            packed_run(b, v, m)
            transport.allreduce(comm, t, scale)

        cases.append(Case(f"alone@{_size_label(nbytes)}", _filler(base2 + [tensor2], value), alone,
                          lambda m=base2 + [tensor2]: _all_close(m, mean)))
    times = time_cases(comm, cases, reps, warmup)
    rows = []
    for nbytes in SWEEP_DIRECT:
        p = np.array(times[f"packed@{_size_label(nbytes)}"])
        a = np.array(times[f"alone@{_size_label(nbytes)}"])
        rows.append({"tensor_bytes": nbytes, "packed_ms": float(np.median(p)) * 1e3,
                     "alone_ms": float(np.median(a)) * 1e3,
                     "alone_minus_packed_ms": float(np.median(a - p)) * 1e3})
    return {"base": f"{base_count} x 1024 float32", "rows": rows}


def _allreduce_curve(comm: MPI.Intracomm, reps: int, warmup: int) -> List[Dict[str, Any]]:
    """Single in-place Allreduces of each of CURVE_SIZES.

    Sizes under 4 MiB are timed as up to 8 Allreduces per sample, each over
    its own freshly filled slice (so that no value is summed twice).
    """
    size = comm.Get_size()
    buf = np.zeros(CURVE_SIZES[-1] // 4, np.float32)
    value, total = _fill_value(comm), _expected_sum(comm)
    cases = []
    inner_of = {}
    for nbytes in CURVE_SIZES:
        inner = int(min(8, max(1, (4 * MIB) // nbytes)))
        inner_of[nbytes] = inner
        n = nbytes // 4
        parts = [buf[j * n : (j + 1) * n] for j in range(inner)]
        used = buf[: inner * n]

        def run(parts: List[np.ndarray] = parts) -> None:
            for p in parts:
                comm.Allreduce(MPI.IN_PLACE, p)

        cases.append(Case(_size_label(nbytes), lambda u=used: u.fill(value), run,
                          lambda u=used: _all_close([u], total)))
    times = time_cases(comm, cases, reps, warmup)
    rows = []
    for nbytes in CURVE_SIZES:
        per_call = [t / inner_of[nbytes] for t in times[_size_label(nbytes)]]
        row = _summary(per_call, nbytes, size)
        del row["times_ms"]
        rows.append(dict(row, bytes=nbytes))
    return rows


# -- output -----------------------------------------------------------------------------


def _bench_overlap(comm: MPI.Intracomm, layers: int, width: int, batch: int, reps: int,
                   warmup: int) -> Dict[str, Any]:
    """A training step = backward compute + reduction, sequential and overlapped, interleaved.

    The "model" is ``layers`` float32 weight matrices of ``width`` x ``width``;
    the backward of layer ``i`` computes ``X.T @ (X @ W[i])`` into its gradient
    (two matmuls of a ``batch`` x ``width`` activation), last layer first.
    ``sequential`` runs backward, then ``reducer(grads)``; ``overlapped-MODE``
    runs ``reducer.begin(grads)``, declares each layer's gradient ready as soon
    as it is written, and ends with ``step.wait()``, with the reducer's
    ``progress`` set to MODE (``auto`` chooses one of the others).
    """
    rng = np.random.default_rng(comm.Get_rank())
    weights = [rng.standard_normal((width, width)).astype(np.float32) / width for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    hidden = np.empty((batch, width), np.float32)
    modes = ("thread", "deferred") if MPI.Query_thread() >= MPI.THREAD_MULTIPLE else ("deferred",)
    reducers = {mode: DistributedGradReducer(weights, group=comm, progress=mode) for mode in modes}
    grads = {mode: r.allocate_grads() for mode, r in reducers.items()}
    auto = DistributedGradReducer(weights, group=comm).progress
    plain = reducers["deferred"]

    def backward(g: Sequence[np.ndarray], ready: Optional[Callable[[int], None]] = None) -> None:
        for i in reversed(range(layers)):
            np.matmul(x, weights[i], out=hidden)
            np.matmul(x.T, hidden, out=g[i])
            if ready is not None:
                ready(i)

    def overlapped(mode: str) -> Callable[[], None]:
        def run() -> None:
            step = reducers[mode].begin(grads[mode])
            backward(grads[mode], step.ready)
            step.wait()
        return run

    def sequential() -> None:
        backward(grads["deferred"])
        plain(grads["deferred"])

    nothing = lambda: None  # noqa: E731 (the gradients are rewritten by each run)
    cases = [Case("compute", nothing, lambda: backward(grads["deferred"])),
             Case("reduce", nothing, lambda: plain(grads["deferred"])),
             Case("sequential", nothing, sequential)]
    cases += [Case(f"overlapped-{mode}", nothing, overlapped(mode)) for mode in modes]
    try:
        times = time_cases(comm, cases, reps, warmup)
    finally:
        for r in reducers.values():
            r.free()
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "layers": layers, "width": width, "batch": batch, "bytes": sum(g.nbytes for g in grads["deferred"]),
        "auto": auto, "median_s": med, "times_s": times,
        "over_sequential": {m: med[f"overlapped-{m}"] / med["sequential"] for m in modes},
        "ideal_over_sequential": max(med["compute"], med["reduce"]) / med["sequential"],
    }


def _format_overlap(res: Dict[str, Any]) -> str:
    med = res["median_s"]
    lines = [f"overlap: {res['layers']} layers of {res['width']}x{res['width']} float32 "
             f"({res['bytes'] / 1e6:.1f} MB of gradients), batch {res['batch']}; progress='auto' here "
             f"means {res['auto']!r}"]
    for name in med:
        ratio = f"  {med[name] / med['sequential']:.2f} x sequential" if name.startswith("overlapped") else ""
        lines.append(f"  {name:<20} {med[name] * 1e3:9.2f} ms{ratio}")
    lines.append(f"  ideal max(compute, reduce) / sequential = {res['ideal_over_sequential']:.2f}")
    return "\n".join(lines)


def _environment(comm: MPI.Comm, argv: Sequence[str]) -> Dict[str, Any]:
    import mpi4py

    hosts = sorted(set(comm.allgather(MPI.Get_processor_name())))
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("MPIR_CVAR_", "MPICH_", "MPI_GRADREDUCER_", "OMP_NUM_THREADS"))}
    try:
        torch_version: Optional[str] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "mpi_library_version": MPI.Get_library_version().strip(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "torch": torch_version,
        "python": platform.python_version(),
        "mpi_gradreducer": __version__,
        "ranks": comm.Get_size(),
        "hostname": socket.gethostname(),
        "hosts": hosts,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": " ".join([os.path.basename(sys.executable), "-m", "mpi_gradreducer.bench", *argv]),
        "argv": list(argv),
        "environment_variables": env,
        "constants": {"DEFAULT_BUCKET_BYTES": reducer_module.DEFAULT_BUCKET_BYTES,
                      "DIRECT_BYTES": reducer_module.DIRECT_BYTES,
                      "CHUNK_BYTES": transport.CHUNK_BYTES},
    }


def _format_workload(name: str, res: Dict[str, Any]) -> str:
    lines = [
        f"{name}: {res['tensors']} tensors, {res['bytes'] / 1e6:.1f} MB ({'/'.join(res['dtypes'])}), "
        f"{res['ranks']} ranks — {res['note']}",
        f"  {'method':<20}{'median ms':>11}{'min ms':>10}{'x limit':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}  notes",
    ]
    for method, m in res["methods"].items():
        ratio = f"{m['ratio_to_limit']:.2f}" if "ratio_to_limit" in m else "-"
        notes = []
        if method == "limit":
            notes.append(f"chunk {m['chunk']}")
        if method in res["messages"]:
            notes.append(f"{res['messages'][method]} messages")
        lines.append(f"  {method:<20}{m['median_ms']:>11.2f}{m['min_ms']:>10.2f}{ratio:>9}{m['algbw_GBps']:>12.3f}"
                     f"{m['busbw_GBps']:>12.3f}  {', '.join(notes)}")
    if "limit_by_chunk" in res:
        chunks = ", ".join(f"{_size_label(v['chunk_bytes'])} {v['median_ms']:.2f}"
                           for v in res["limit_by_chunk"].values())
        lines.append(f"  limit by chunk (ms): {chunks}")
    if "validation_cost_percent" in res:
        lines.append(f"  validation cost: {res['validation_cost_percent']:.1f}% of reducer (median of the paired "
                     f"differences with reducer-novalidate); from its parts: overlap check "
                     f"{res['validation_local_ms']:.2f} ms + one tiny Allreduce {res['tiny_allreduce_ms']:.2f} ms "
                     f"= {res['validation_estimate_percent']:.2f}%")
    return "\n".join(lines)


def _format_sweeps(sweeps: Dict[str, Any]) -> str:
    lines = []
    for res in sweeps.get("bucket_bytes", []):
        lines.append(f"bucket_bytes sweep, {res['workload']} (limit {res['limit_ms']:.2f} ms):")
        lines.append(f"  {'bucket_bytes':<14}{'ordinary ms':>12}{'x limit':>9}{'views ms':>10}{'x limit':>9}"
                     f"{'messages':>10}")
        for row in res["rows"]:
            if "same_plan_as" in row:
                lines.append(f"  {_size_label(row['bucket_bytes']):<14}same plan as {_size_label(row['same_plan_as'])}")
                continue
            o, v = row["reducer"], row["views"]
            lines.append(f"  {_size_label(row['bucket_bytes']):<14}{o['median_ms']:>12.2f}{o['ratio_to_limit']:>9.2f}"
                         f"{v['median_ms']:>10.2f}{v['ratio_to_limit']:>9.2f}{o['buckets']:>10}")
    if "chunk_bytes" in sweeps:
        res = sweeps["chunk_bytes"]
        lines.append(f"chunk sweep: transport.allreduce on {res['workload']}'s {res['tensors']} tensors "
                     f">= DIRECT_BYTES ({res['bytes'] / 1e6:.1f} MB):")
        lines.append(f"  {'chunk':<10}{'mean ms':>9}{'busbw GB/s':>12}{'sum ms':>9}{'busbw GB/s':>12}")
        for row in res["rows"]:
            m, t = row["mean"], row["sum"]
            lines.append(f"  {_size_label(row['chunk_bytes']):<10}{m['median_ms']:>9.2f}{m['busbw_GBps']:>12.3f}"
                         f"{t['median_ms']:>9.2f}{t['busbw_GBps']:>12.3f}")
    if "direct_bytes" in sweeps:
        res = sweeps["direct_bytes"]
        lines.append(f"pack or alone: one float32 tensor with {res['base']} packed:")
        lines.append(f"  {'tensor':<10}{'packed ms':>11}{'alone ms':>10}{'alone-packed':>14}")
        for row in res["rows"]:
            lines.append(f"  {_size_label(row['tensor_bytes']):<10}{row['packed_ms']:>11.3f}{row['alone_ms']:>10.3f}"
                         f"{row['alone_minus_packed_ms']:>+14.3f}")
    return "\n".join(lines)


def _plot(path: str, results: Dict[str, Any]) -> None:
    """Bus bandwidth against message size: single Allreduces, and the limit's chunk sizes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    env = results["environment"]
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    curve = results.get("allreduce_curve", [])
    if curve:
        ax.plot([r["bytes"] for r in curve], [r["busbw_GBps"] for r in curve], "o-", color="black",
                label="one Allreduce of that size")
    markers = "sD^v"
    for k, (name, res) in enumerate(results["workloads"].items()):
        if "limit_by_chunk" not in res:
            continue
        rows = sorted(res["limit_by_chunk"].values(), key=lambda v: v["chunk_bytes"] or res["bytes"])
        ax.plot([min(v["chunk_bytes"] or res["bytes"], res["bytes"]) for v in rows], [v["busbw_GBps"] for v in rows],
                markers[k % len(markers)] + "--", alpha=0.8, label=f"{name}: its whole gradient in chunks of that size")
    consts = env["constants"]
    for label, value, style in (("CHUNK_BYTES", consts["CHUNK_BYTES"], ":"),
                                ("DIRECT_BYTES", consts["DIRECT_BYTES"], "-."),
                                ("DEFAULT_BUCKET_BYTES", consts["DEFAULT_BUCKET_BYTES"], "--")):
        ax.axvline(value, color="grey", linestyle=style, linewidth=1)
        ax.text(value, 0.02, label + " ", rotation=90, va="bottom", ha="right", fontsize=7,
                transform=ax.get_xaxis_transform(), color="dimgrey")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _size_label(int(x)).replace(" ", "")))
    ax.set_xlabel("message (or chunk) size, bytes")
    ax.set_ylabel("bus bandwidth, GB/s (nccl-tests convention)")
    nolocal = env["environment_variables"].get("MPIR_CVAR_NOLOCAL")
    ax.set_title(f"MPI_Allreduce, {env['ranks']} ranks on {env['cpu_count']} cores"
                 f"{', MPIR_CVAR_NOLOCAL=' + nolocal if nolocal else ''}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path)


def _write_outputs(json_path: Optional[str], plot_path: Optional[str], results: Dict[str, Any]) -> None:
    """Write the JSON file and the plot, creating their directories."""
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    if plot_path:
        _plot(plot_path, results)


# -- entry point ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpi_gradreducer.bench",
        description="Time DistributedGradReducer against raw MPI_Allreduce, a per-tensor loop and torch gloo. "
                    "Run under mpiexec; only rank 0 prints.",
    )
    p.add_argument("--workload", nargs="*", choices=WORKLOADS, default=None,
                   help="workloads to run (default: all; the option alone: none, e.g. to run only --sweep)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods to time (default: all; torch-gloo only where torch imports)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="bert-base size in (0, 1]: fraction of its 12 layers and of its vocabulary (default 1)")
    p.add_argument("--small-count", type=int, default=1000, help="many-small: number of tensors (default 1000)")
    p.add_argument("--small-size", type=int, default=1024, help="many-small: elements per tensor (default 1024)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per method (default 7)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
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


def start(parser: argparse.ArgumentParser, argv: Sequence[str], comm: Optional[MPI.Intracomm]
          ) -> Tuple[argparse.Namespace, MPI.Intracomm, Callable[[str], None]]:
    """Parse and check the options every benchmark shares (``--scale``, ``--reps``, ``--warmup``,
    ``--small-count``, ``--small-size``).

    Returns:
        The options, the run's own duplicate of ``comm`` (default ``MPI.COMM_WORLD``; free
        it when done) and a ``say`` that prints on rank 0 only.
    """
    args = parser.parse_args(argv)
    if not 0.0 < args.scale <= 1.0:
        raise SystemExit(f"--scale: expected a number in (0, 1], got {args.scale}")
    if args.reps < 1 or args.warmup < 0:
        raise SystemExit(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.small_count < 1 or args.small_size < 1:
        raise SystemExit(f"--small-count and --small-size must be >= 1, got {args.small_count} and {args.small_size}")
    comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
    rank = comm.Get_rank()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    return args, comm, say


def main(argv: Optional[Sequence[str]] = None, comm: Optional[MPI.Intracomm] = None) -> Dict[str, Any]:
    """Run the benchmark; rank 0 prints the tables and writes the files.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator to run over (default ``MPI.COMM_WORLD``).

    Returns:
        All results (what ``--json`` writes); the timings are the same on every rank.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args, comm, say = start(_parser(), argv, comm)
    rank = comm.Get_rank()
    try:
        missing = args.plot and rank == 0 and importlib.util.find_spec("matplotlib") is None
        if comm.bcast(bool(missing), root=0):
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)")
        results: Dict[str, Any] = {"environment": _environment(comm, argv),
                                   "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                                   "workloads": {}}
        names = list(WORKLOADS) if args.workload is None else args.workload
        gloo = None
        if "torch-gloo" in args.methods and names:
            if _torch_usable(comm, True):
                gloo = _Gloo(comm)
            else:
                say("torch-gloo: skipped (torch with gloo is not importable on every rank)")
        results["torch_gloo"] = gloo is not None
        try:
            for name in names:
                wl = _make_workload(name, args)
                res = _bench_workload(comm, wl, args.methods, gloo, args.reps, args.warmup)
                results["workloads"][name] = res
                say(_format_workload(name, res) + "\n")
        finally:
            if gloo is not None:
                gloo.close()
        if args.sweep is not None:
            chosen = args.sweep or list(SWEEPS)
            sweeps: Dict[str, Any] = {}
            if "buckets" in chosen:
                sweeps["bucket_bytes"] = [_sweep_buckets(comm, wl, args.reps, args.warmup)
                                          for wl in (resnet50(), many_small(args.small_count, args.small_size))]
            if "chunks" in chosen:
                sweeps["chunk_bytes"] = _sweep_chunks(comm, resnet50(), args.reps, args.warmup)
            if "direct" in chosen:
                sweeps["direct_bytes"] = _sweep_direct(comm, args.reps, args.warmup)
            results["sweeps"] = sweeps
            say(_format_sweeps(sweeps) + "\n")
        if args.overlap is not None:
            results["overlap"] = _bench_overlap(comm, *args.overlap, args.reps, args.warmup)
            say(_format_overlap(results["overlap"]) + "\n")
        if args.plot:
            results["allreduce_curve"] = _allreduce_curve(comm, args.reps, args.warmup)
        if hasattr(os, "getloadavg"):
            results["environment"]["loadavg_at_end"] = list(os.getloadavg())
        failure = None
        if rank == 0:
            try:
                _write_outputs(args.json, args.plot, results)
            except Exception as exc:  # tell the other ranks instead of leaving them waiting
                failure = f"could not write the results: {exc!r}"
            else:
                for path in (args.json, args.plot):
                    if path:
                        say(f"wrote {path}")
        failure = comm.bcast(failure, root=0)
        if failure is not None:
            raise RuntimeError(failure)
        return results
    finally:
        comm.Free()


if __name__ == "__main__":
    main()
