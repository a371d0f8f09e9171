"""Horovod's collectives on torch tensors: one implementation per kind, thin variants around it.

Every call goes through the engine (:mod:`.engine`): it is matched with the
other ranks' calls by name (or by the count of unnamed calls), checked
against them, and its data moves on the engine's thread with nonblocking
MPI calls. The ``*_async`` variants return a :class:`~.engine.Handle` at
once: :func:`poll` is False until the operation has completed,
:func:`synchronize` waits for it and returns its result. The blocking
variants are the same, waited for.

Tensors travel through host memory (CUDA tensors are copied); how each
kind moves its data, and how float16 and bfloat16 are reduced, is in
:mod:`.execute`. The out-of-place collectives are differentiable, with
Horovod's backward functions (:mod:`.autograd`). A rank in :func:`join`
takes part in the others' allreduces (with the operation's identity: zero
for sums and averages) and barriers; any other kind raises
:class:`~.submit.HorovodInternalError` on the ranks that called it, as in
Horovod, and the joined rank stays in ``join``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .autograd import differentiable
from .engine import Handle
from .execute import Local
from .ops import Average, Compression, Compressor, ReduceOp, resolve_op
from .process_sets import global_process_set
from .session import SetInfo, current
from .sparse import SparseHandle
from .submit import (
    Prepared,
    entry,
    factor_arg,
    from_bytes,
    numeric,
    raw_bytes,
    set_of,
    submit,
    tensor_arg,
    tensors_arg,
    wait,
    writable_view,
)

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
           "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize",
           "grouped_broadcast_"]

_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
              torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def poll(handle: Handle) -> bool:
    """Whether the operation of ``handle`` has completed (then :func:`synchronize` does not block).

    Raises:
        TypeError: ``handle`` is not a handle of this module.
    """
    return _handle("poll", handle).poll()


def synchronize(handle: Handle) -> Any:
    """Wait for the operation of ``handle``; its result.

    Raises:
        TypeError: ``handle`` is not a handle of this module.
        HorovodInternalError, ValueError, TypeError, NotImplementedError: the
            operation's error (the same on every rank that made the call).
    """
    return wait(_handle("synchronize", handle))


def _handle(what: str, handle: Any) -> Handle:
    """``handle``, refused with a ``TypeError`` naming ``what`` unless it is a handle of this module."""
    if isinstance(handle, SparseHandle):
        handle = handle.handle
    if not isinstance(handle, Handle):
        raise TypeError(f"{what}: handle: expected a handle from an *_async call, got {type(handle).__name__}")
    return handle


# -- allreduce --------------------------------------------------------------------------------------


def _deliver(out: list[torch.Tensor], given: list[torch.Tensor], inplace: bool, single: bool) -> Any:
    """An operation's results as its call returns them: copied into the given tensors for an in-place call, one
    tensor for a single-tensor call."""
    if inplace:
        with torch.no_grad():
            for t, o in zip(given, out, strict=True):
                t.copy_(o)
        out = given
    return out[0] if single else out


def _tensor_of(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A reduced host array as a tensor of ``like``'s dtype, shape and device (no copy where they allow)."""
    out = torch.from_numpy(a)
    if out.dtype != like.dtype:
        out = out.to(like.dtype)
    out = out.reshape(like.shape)
    return out if like.is_cpu else out.to(like.device)


def _allreduce_async(what: str, tensors: Any, average: bool | None, name: Any, op: Any, prescale_factor: Any,
                     postscale_factor: Any, process_set: Any, compression: Any = Compression.none,
                     inplace: bool = False, single: bool = False, blocking: bool = False) -> Handle:
    """The one allreduce: every variant is this with other arguments (the result: a list, or its one tensor)."""

    def prepare(info: SetInfo) -> Prepared:
        reduce_op = resolve_op(op, average, what)
        factors = (factor_arg(what, "prescale_factor", prescale_factor),
                   factor_arg(what, "postscale_factor", postscale_factor))
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise TypeError(f"{what}: compression: expected Compression.none or Compression.fp16, got {compression!r}")
        code, plain = int(reduce_op), compression is Compression.none
        site = (name, code) if inplace and plain and not single else None  # where the views may be kept
        found = info.views.recall(site, tensors) if site is not None else None
        if found is not None:  # the last call's tensors here, unchanged: each reduced where it lies, as then
            given, (arrays, entries) = list(tensors), found
            sent, contexts, own = given, [None] * len(given), [True] * len(given)
        else:
            given = [tensor_arg(what, tensors)] if single else tensors_arg(what, tensors)
            sent, contexts, arrays, own, listed = [], [], [], [], []
            for i, t in enumerate(given):  # one pass: per tensor, what travels, its array and its entry
                c, ctx = (t, None) if plain else compression.compress(t)
                if c.dtype not in _REDUCIBLE or c.dtype.is_complex and reduce_op in (ReduceOp.Min, ReduceOp.Max):
                    raise TypeError(f"{what}: tensors[{i}]: {c.dtype} cannot be reduced with op={reduce_op.name}")
                mine = writable_view(c, code) if inplace and c is t else None  # reduced where it lies
                sent.append(c)
                contexts.append(ctx)
                own.append(mine is not None)
                arrays.append(mine if mine is not None else numeric(c, code))
                listed.append(entry(c))
            entries = tuple(listed)
            if site is not None and all(own):
                info.views.remember(site, tensors, arrays, entries)

        def finish(response: Any, outputs: list[Any]) -> Any:
            if not inplace:
                out = [compression.decompress(_tensor_of(a, c), ctx)
                       for a, c, ctx in zip(outputs, sent, contexts, strict=True)]
                return out[0] if single else out
            if not all(own):
                with torch.no_grad():
                    for t, a, c, ctx, viewed in zip(given, outputs, sent, contexts, own, strict=True):
                        if not viewed:
                            t.copy_(compression.decompress(_tensor_of(a, c), ctx))
            return given[0] if single else given

        fields = {"entries": entries, "op": code, "factors": factors}
        return fields, Local(arrays), finish

    return submit(what, "allreduce", process_set, name, prepare, blocking)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` over the process set into a new tensor; its handle.

    Args:
        tensor: the same dtype and shape on every rank of the process set.
        average: deprecated: True for ``op=Average``, False for ``op=Sum``.
        name: the name the ranks' calls match by (None: the count of unnamed calls).
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor: multiplies each rank's tensor before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks (``global_process_set``, or one from ``add_process_set``).

    Raises:
        ValueError, TypeError, NotImplementedError: bad arguments on this
            rank (its ``synchronize`` raises the same on the other ranks).
    """
    return _allreduce_async("hvd.allreduce_async", tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, single=True)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set into a new tensor; as :func:`allreduce_async`, waited for.

    Differentiable, as in Horovod: the gradient is the allreduce of the
    output's gradient with the same op, factors and process set.

    Args:
        compression: ``Compression.none`` or ``Compression.fp16`` (floating
            tensors travel as float16; the result has the tensor's dtype).
    """
    def run() -> torch.Tensor:
        return wait(_allreduce_async("hvd.allreduce", tensor, average, name, op, prescale_factor, postscale_factor,
                                     process_set, compression, single=True, blocking=True))

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        return [allreduce(grad, average, None, Compression.none, op, prescale_factor, postscale_factor, process_set)]

    return differentiable(run, back, [tensor])


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` in place (written when the handle is synchronized); its handle."""
    return _allreduce_async("hvd.allreduce_async_", tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, inplace=True, single=True)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it. See :func:`allreduce_async`."""
    return wait(_allreduce_async("hvd.allreduce_", tensor, average, name, op, prescale_factor, postscale_factor,
                                 process_set, inplace=True, single=True, blocking=True))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> Handle:
    """Start reducing a list of tensors (one operation) into new tensors; its handle."""
    return _allreduce_async("hvd.grouped_allreduce_async", tensors, average, name, op, prescale_factor,
                            postscale_factor, process_set)


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors (one operation) into new tensors; differentiable as :func:`allreduce`."""
    def run() -> tuple[torch.Tensor, ...]:
        return tuple(wait(_allreduce_async("hvd.grouped_allreduce", tensors, average, name, op, prescale_factor,
                                           postscale_factor, process_set, compression, blocking=True)))

    def back(*grads: torch.Tensor) -> list[torch.Tensor]:
        return grouped_allreduce(list(grads), average, None, Compression.none, op, prescale_factor, postscale_factor,
                                 process_set)

    return list(differentiable(run, back, tensors if isinstance(tensors, Sequence) else []))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """Start reducing a list of tensors in place; its handle."""
    return _allreduce_async("hvd.grouped_allreduce_async_", tensors, average, name, op, prescale_factor,
                            postscale_factor, process_set, inplace=True)


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors in place and return it."""
    return wait(_allreduce_async("hvd.grouped_allreduce_", tensors, average, name, op, prescale_factor,
                                 postscale_factor, process_set, inplace=True, blocking=True))


# -- allgather ------------------------------------------------------------------------------------------


def _allgather_async(what: str, tensors: Any, name: Any, process_set: Any, single: bool,
                     blocking: bool = False, counts: list[list[int]] | None = None) -> Handle:
    """The one allgather (``counts``: receives every rank's first dimension, per tensor)."""

    def prepare(info: SetInfo) -> Prepared:
        given = [tensor_arg(what, tensors)] if single else tensors_arg(what, tensors)
        for i, t in enumerate(given):
            if t.dim() == 0:
                raise ValueError(f"{what}: tensors[{i}]: expected at least one dimension, got a 0-d tensor")
        rows = [int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size() for t in given]

        def finish(response: Any, outputs: list[Any]) -> Any:
            out = [from_bytes(recv, t, (sum(firsts), *t.shape[1:])) for (recv, firsts), t in
                   zip(outputs, given, strict=True)]
            if counts is not None:
                counts.extend(firsts for _, firsts in outputs)
            return out[0] if single else out

        return {"entries": tuple(entry(t) for t in given)}, Local([raw_bytes(t) for t in given], rows), finish

    return submit(what, "allgather", process_set, name, prepare, blocking)


def _mine(grad: torch.Tensor, firsts: list[int], process_set: Any) -> torch.Tensor:
    """This rank's rows of ``grad`` (gathered with first dimensions ``firsts``)."""
    me = set_of("hvd.allgather", process_set).ranks.index(current("hvd.allgather").comm.Get_rank())
    return grad.narrow(0, sum(firsts[:me]), firsts[me])


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """Every rank's tensor, concatenated along the first dimension in rank order (of the process set).

    The first dimension may differ between ranks; the others and the dtype
    may not. Differentiable, as in Horovod: the average of every rank's
    gradient, this rank's rows of it.
    """
    counts: list[list[int]] = []

    def run() -> torch.Tensor:
        return wait(_allgather_async("hvd.allgather", tensor, name, process_set, True, blocking=True, counts=counts))

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        return [_mine(allreduce(grad, op=Average, process_set=process_set), counts[0], process_set)]

    return differentiable(run, back, [tensor])


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> Handle:
    """Start :func:`allgather`; its handle."""
    return _allgather_async("hvd.allgather_async", tensor, name, process_set, True)


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor, as one operation (differentiable as it)."""
    counts: list[list[int]] = []

    def run() -> tuple[torch.Tensor, ...]:
        return tuple(wait(_allgather_async("hvd.grouped_allgather", tensors, name, process_set, False,
                                           blocking=True, counts=counts)))

    def back(*grads: torch.Tensor) -> list[torch.Tensor]:
        reduced = grouped_allreduce(list(grads), op=Average, process_set=process_set)
        return [_mine(g, firsts, process_set) for g, firsts in zip(reduced, counts, strict=True)]

    return list(differentiable(run, back, tensors if isinstance(tensors, Sequence) else []))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start :func:`grouped_allgather`; its handle."""
    return _allgather_async("hvd.grouped_allgather_async", tensors, name, process_set, False)


# -- broadcast ----------------------------------------------------------------------------------------


def _root_arg(what: str, info: SetInfo, root_rank: Any) -> int:
    if isinstance(root_rank, torch.Tensor) and root_rank.numel() == 1:
        root_rank = root_rank.item()
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) or \
            int(root_rank) not in info.ranks:
        ranks = f"[0, {len(info.ranks) - 1}]" if info.id == 0 else f"{list(info.ranks)}"
        raise ValueError(f"{what}: root_rank: expected a rank in {ranks}, got {root_rank!r}")
    return int(root_rank)


def _broadcast_async(what: str, tensors: Any, root_rank: Any, name: Any, process_set: Any, inplace: bool,
                     single: bool = True, blocking: bool = False) -> Handle:
    def prepare(info: SetInfo) -> Prepared:
        given = [tensor_arg(what, tensors)] if single else tensors_arg(what, tensors)
        root = _root_arg(what, info, root_rank)

        def finish(response: Any, outputs: list[Any]) -> Any:
            out = [from_bytes(buf, t, t.shape) for buf, t in zip(outputs, given, strict=True)]
            return _deliver(out, given, inplace, single)

        return {"entries": tuple(entry(t) for t in given), "root": root}, Local([raw_bytes(t) for t in given]), \
            finish

    return submit(what, "broadcast", process_set, name, prepare, blocking)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s tensor (a global rank, in the process set), as a new tensor on every rank of the set.

    Differentiable, as in Horovod: the root's gradient is the average of
    every rank's, the others' is zero.
    """
    def run() -> torch.Tensor:
        return wait(_broadcast_async("hvd.broadcast", tensor, root_rank, name, process_set, False, blocking=True))

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        averaged = allreduce(grad, op=Average, process_set=process_set)
        return [averaged if current("hvd.broadcast").comm.Get_rank() == root_rank else averaged * 0]

    return differentiable(run, back, [tensor])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start :func:`broadcast`; its handle."""
    return _broadcast_async("hvd.broadcast_async", tensor, root_rank, name, process_set, False)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Copy rank ``root_rank``'s tensor into ``tensor`` on every rank of the set and return it."""
    return wait(_broadcast_async("hvd.broadcast_", tensor, root_rank, name, process_set, True, blocking=True))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start :func:`broadcast_` (``tensor`` is written when the handle is synchronized); its handle."""
    return _broadcast_async("hvd.broadcast_async_", tensor, root_rank, name, process_set, True)


def grouped_broadcast_(tensors: list[torch.Tensor], root_rank: int, name: str | None = None,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """:func:`broadcast_` of each tensor, as one operation (``broadcast_parameters`` uses it)."""
    return wait(_broadcast_async("hvd.broadcast_parameters", tensors, root_rank, name, process_set, True,
                                 single=False, blocking=True))


# -- alltoall --------------------------------------------------------------------------------------------


def _alltoall_async(what: str, tensor: Any, splits: Any, name: Any, process_set: Any,
                    blocking: bool = False) -> Handle:
    def prepare(info: SetInfo) -> Prepared:
        t = tensor_arg(what, tensor)
        size = len(info.ranks)
        if t.dim() == 0:
            raise ValueError(f"{what}: tensor: expected at least one dimension, got a 0-d tensor")
        if splits is None:
            if t.shape[0] % size:
                raise ValueError(f"{what}: tensor: without splits the first dimension must divide by the number "
                                 f"of ranks ({size}), got shape {tuple(t.shape)}")
            mine = [t.shape[0] // size] * size
        else:
            if isinstance(splits, torch.Tensor) and (splits.is_floating_point() or splits.is_complex()):
                raise ValueError(f"{what}: splits: expected an int tensor, got {splits.dtype}")
            raw = splits.tolist() if isinstance(splits, (torch.Tensor, np.ndarray)) else splits
            if not isinstance(raw, (list, tuple)) or len(raw) != size or \
                    any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in raw):
                raise ValueError(f"{what}: splits: expected {size} non-negative ints (one per rank), got {splits!r}")
            if sum(raw) != t.shape[0]:
                raise ValueError(f"{what}: splits: expected ints that sum to the first dimension {t.shape[0]}, got "
                                 f"{list(raw)} (sum {sum(raw)})")
            mine = list(raw)
        row = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
        device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")

        def finish(response: Any, outputs: list[Any]) -> Any:
            recv, received = outputs[0]
            return (from_bytes(recv, t, (sum(received), *t.shape[1:])),
                    torch.tensor(received, dtype=torch.int32, device=device))

        return {"entries": (entry(t),), "splits": tuple(mine)}, Local([raw_bytes(t)], [row]), finish

    return submit(what, "alltoall", process_set, name, prepare, blocking)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` (in order) to each rank ``r`` of the set; receive theirs.

    Args:
        tensor: at least 1-D; the first dimension may differ between ranks.
        splits: one non-negative int per rank of the set (a list or an int
            tensor) summing to the first dimension; None: equal parts.

    Returns:
        Without ``splits``: the received rows, in rank order. With
        ``splits`` (as Horovod 0.28): ``(rows, received_splits)``, the
        second an int32 tensor of how many rows came from each rank.
        Differentiable, as in Horovod: the gradient travels back by the
        received splits.
    """
    received: list[torch.Tensor] = []

    def run() -> Any:
        out, got = wait(_alltoall_async("hvd.alltoall", tensor, splits, name, process_set, blocking=True))
        received.append(got)
        return out if splits is None else (out, got)

    def back(grad: torch.Tensor, *ignored: Any) -> list[torch.Tensor]:
        return [alltoall(grad, splits=received[0], process_set=process_set)[0]]

    return differentiable(run, back, [tensor])


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start :func:`alltoall`; its handle (its result is always ``(rows, received_splits)``, as in Horovod)."""
    return _alltoall_async("hvd.alltoall_async", tensor, splits, name, process_set)


# -- reducescatter -----------------------------------------------------------------------------------------


def _rows_of(first: int, size: int, rank: int) -> int:
    """Rows of a first dimension ``first`` that rank ``rank`` gets (the first ``first % size`` get one more)."""
    return first // size + (1 if rank < first % size else 0)


def _reducescatter_async(what: str, tensors: Any, name: Any, compression: Any, op: Any, process_set: Any,
                         prescale_factor: Any, postscale_factor: Any, single: bool,
                         blocking: bool = False) -> Handle:
    def prepare(info: SetInfo) -> Prepared:
        reduce_op = resolve_op(op, None, what)
        factors = (factor_arg(what, "prescale_factor", prescale_factor),
                   factor_arg(what, "postscale_factor", postscale_factor))
        given = [tensor_arg(what, tensors)] if single else tensors_arg(what, tensors)
        sent, contexts = [], []
        for i, t in enumerate(given):
            if t.dim() == 0:
                raise ValueError(f"{what}: tensors[{i}]: expected at least one dimension, got a 0-d tensor")
            c, ctx = compression.compress(t)
            if c.dtype not in _REDUCIBLE or c.dtype.is_complex and reduce_op in (ReduceOp.Min, ReduceOp.Max):
                raise TypeError(f"{what}: tensors[{i}]: {c.dtype} cannot be reduced with op={reduce_op.name}")
            sent.append(c)
            contexts.append(ctx)
        size, me = len(info.ranks), info.ranks.index(current(what).comm.Get_rank())

        def finish(response: Any, outputs: list[Any]) -> Any:
            out = []
            for recv, c, ctx in zip(outputs, sent, contexts, strict=True):
                shape = (_rows_of(c.shape[0], size, me), *c.shape[1:])
                out.append(compression.decompress(torch.from_numpy(recv).reshape(shape).to(c.dtype).to(c.device),
                                                  ctx))
            return out[0] if single else out

        arrays = [numeric(c, int(ReduceOp.Max)) for c in sent]  # float16: reduced as float32
        fields = {"entries": tuple(entry(c) for c in sent), "op": int(reduce_op), "factors": factors}
        return fields, Local(arrays), finish

    return submit(what, "reducescatter", process_set, name, prepare, blocking)


def _scaled_gather(grads: Sequence[torch.Tensor], op: Any, process_set: Any, prescale_factor: float,
                   postscale_factor: float) -> list[torch.Tensor]:
    """Horovod's reducescatter gradient: each rank's output gradient (times the set's size for Sum, and the
    factors), gathered."""
    factor = prescale_factor * postscale_factor
    if resolve_op(op, None, "hvd.reducescatter") == ReduceOp.Sum:
        factor *= len(set_of("hvd.reducescatter", process_set).ranks)
    scaled = [g * factor if factor != 1.0 else g for g in grads]
    return grouped_allgather(scaled, process_set=process_set)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the process set; each rank gets its rows of the result.

    Rank ``r`` of the set gets ``n // size`` rows of the first dimension
    ``n``, one more when ``r < n % size``, in rank order. Differentiable, as
    in Horovod: the gathered output gradients, times the set's size for
    ``Sum``, and the factors.
    """
    def run() -> torch.Tensor:
        return wait(_reducescatter_async("hvd.reducescatter", tensor, name, compression, op, process_set,
                                         prescale_factor, postscale_factor, True, blocking=True))

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        return _scaled_gather([grad], op, process_set, prescale_factor, postscale_factor)

    return differentiable(run, back, [tensor])


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start :func:`reducescatter`; its handle."""
    return _reducescatter_async("hvd.reducescatter_async", tensor, name, Compression.none, op, process_set,
                                prescale_factor, postscale_factor, True)


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor, as one operation (differentiable as it)."""
    def run() -> tuple[torch.Tensor, ...]:
        return tuple(wait(_reducescatter_async("hvd.grouped_reducescatter", tensors, name, compression, op,
                                               process_set, prescale_factor, postscale_factor, False,
                                               blocking=True)))

    def back(*grads: torch.Tensor) -> list[torch.Tensor]:
        return _scaled_gather(grads, op, process_set, prescale_factor, postscale_factor)

    return list(differentiable(run, back, tensors if isinstance(tensors, Sequence) else []))


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start :func:`grouped_reducescatter`; its handle."""
    return _reducescatter_async("hvd.grouped_reducescatter_async", tensors, name, Compression.none, op,
                                process_set, prescale_factor, postscale_factor, False)
