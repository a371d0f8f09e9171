"""The methods of the host benchmark: what each times, built for one workload (collective).

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer
from .._core.backend import empty
from . import powersgd
from .limit import limit_cases
from .output import KIB, MIB
from .timing import Case, agree, all_close, expected_sum, fill_value, filler, keep_working
from .torch_methods import Gloo
from .workloads import Workload

__all__ = ["COMPRESSED", "DEFAULT_METHODS", "DEFAULT_WORKLOADS", "LIMIT_CHUNKS", "METHODS", "ON_REQUEST", "WHOLE",
           "Methods", "workload_methods"]

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
WHOLE = "limit@whole"


@dataclass
class Methods:
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


def _add_packed_floor(comm: MPI.Intracomm, grads: list[np.ndarray], m: Methods) -> None:
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


def _add_reducers(comm: MPI.Intracomm, grads: list[np.ndarray], methods: Sequence[str], m: Methods) -> None:
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


def _add_fp16(comm: MPI.Intracomm, grads: list[np.ndarray], m: Methods) -> None:
    """``reducer-fp16``: the reducer with ``compression="fp16"``, where it takes the workload's dtypes."""
    holder: dict[str, DistributedGradReducer] = {}
    why = agree(comm, lambda: holder.setdefault("r", DistributedGradReducer(grads, group=comm, compression="fp16")))
    if why is not None:  # a reducer built on some ranks only is left alone: freeing it could wait for the others
        m.skipped["reducer-fp16"] = f"refused by the reducer: {why}"
        return
    r = m.reducers["reducer-fp16"] = holder["r"]
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    m.cases.append(Case("reducer-fp16", filler(grads, value), partial(r, grads), lambda: all_close(grads, mean)))


def _add_fresh(comm: MPI.Intracomm, grads: list[np.ndarray], m: Methods) -> None:
    """``reducer-fresh``: every call with other arrays than the call before (two lists, in turn)."""
    r = m.reducers["reducer-fresh"] = DistributedGradReducer(grads, group=comm)
    lists = [[np.zeros_like(g) for g in grads], [np.zeros_like(g) for g in grads]]
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    turn = [0]

    def prepare() -> None:
        turn[0] ^= 1
        filler(lists[turn[0]], value)()

    m.cases.append(Case("reducer-fresh", prepare, lambda: r(lists[turn[0]]), lambda: all_close(lists[turn[0]], mean)))


def _add_torch_reducer(comm: MPI.Intracomm, grads: list[np.ndarray], unsupported: str | None, m: Methods) -> None:
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


def workload_methods(comm: MPI.Intracomm, wl: Workload, grads: list[np.ndarray], methods: Sequence[str],
                      gloo: Gloo | None, torch_unsupported: str | None, powersgd_rank: int = 4) -> Methods:
    """Every requested case of one workload; reducers are built here (collective)."""
    m = Methods()
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
