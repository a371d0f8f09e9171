"""Horovod's collectives on torch tensors: one implementation per kind, thin variants around it.

Every call makes one small agreement step first: each rank sends a row
(``("call", Call)``, ``("error", kind, message)`` or ``("join", rounds)``)
with ``allgather``, and every rank reads the same rows to the same verdict:
the lowest failing rank's error, or a mismatch between two ranks' calls
(naming both), is raised on every rank before any tensor moves; a rank in
:func:`join` reads which allreduce the others make and takes part with zeros.
Then the data moves with one MPI call per tensor. Operations complete
before they return: the ``*_async`` variants return a finished
:class:`Handle` (``poll`` is True), so ``synchronize`` never waits.

Tensors travel through host memory (CUDA tensors are copied). float16
tensors (what ``Compression.fp16`` makes) travel as float16 in sums and
averages, summed in float32 in rank order and rounded once (the package's
``compressed_allreduce``); bfloat16, and float16 under Min, Max or Product,
are reduced in float32. Data-moving collectives (allgather, broadcast,
alltoall) send raw bytes, so any dtype travels. The out-of-place
collectives but reducescatter are differentiable, with Horovod's backward
functions.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .._core.halves import compressed_allreduce
from .._core.wire import half_format
from .context import current
from .elastic import internal_errors
from .ops import Average, Compression, Compressor, ReduceOp, Sum, resolve_op
from .process_sets import check_global, global_process_set

__all__ = ["Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
           "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize",
           "join", "barrier", "exchange", "raise_everywhere"]

_MPI_OPS = {Average: MPI.SUM, Sum: MPI.SUM, ReduceOp.Min: MPI.MIN, ReduceOp.Max: MPI.MAX, ReduceOp.Product: MPI.PROD}
_ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (ValueError, TypeError, RuntimeError,
                                                                 NotImplementedError)}
#: Kinds whose first dimension may differ between ranks.
_RAGGED = ("allgather", "alltoall")


# -- the agreement step -----------------------------------------------------------------------------


def exchange(comm: MPI.Intracomm, row: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Every rank's row, on every rank (collective); the lowest rank's error is raised everywhere.

    Args:
        comm: the ranks.
        row: ``("error", exception class name, message)`` or anything else.

    Raises:
        ValueError, TypeError, RuntimeError or NotImplementedError: as the
            lowest rank with an ``"error"`` row raised, naming it (any other
            exception becomes a ``RuntimeError`` with its message, on that
            rank too: every rank raises the same).
    """
    with internal_errors():  # a lost rank: Horovod's error
        rows = comm.allgather(row)
    for r, other in enumerate(rows):
        if other[0] == "error":
            raise _ERRORS.get(other[1], RuntimeError)(f"rank {r}: {other[2]}")
    return rows


def raise_everywhere(comm: MPI.Intracomm, error: BaseException | None) -> None:
    """Raise the lowest failing rank's error on every rank, or return on every rank (collective)."""
    exchange(comm, _error_row(error) if error is not None else ("ok",))


def _error_row(error: BaseException) -> tuple[str, str, str]:
    return ("error", type(error).__name__, str(error))


@dataclass(frozen=True)
class Call:
    """What one rank asked for: enough for the others to check it, and for a joined rank to take part."""

    kind: str
    op: int
    root: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype name, shape) per tensor
    splits: tuple[int, ...] | None = None

    def key(self) -> tuple[Any, ...]:
        """What must be equal on every rank."""
        shapes = tuple((d, s[1:] if self.kind in _RAGGED else s) for d, s in self.tensors)
        return self.kind, self.op, self.root, shapes

    def describe(self) -> str:
        parts = [f"{d} {tuple(s)}" for d, s in self.tensors]
        text = f"{self.kind} of [{', '.join(parts)}]"
        if self.op >= 0:
            text += f" with op={ReduceOp(self.op).name}"
        if self.root >= 0:
            text += f" from root_rank={self.root}"
        return text


def _verdict(rows: Sequence[tuple[Any, ...]]) -> tuple[Call | None, list[int]]:
    """The call every active rank makes, and the ranks in join(); raises the same error on every rank."""
    calls = [(r, row[1]) for r, row in enumerate(rows) if row[0] == "call"]
    joined = [r for r, row in enumerate(rows) if row[0] == "join"]
    if not calls:
        return None, joined
    first, ref = calls[0]
    for r, call in calls[1:]:
        if call.key() != ref.key():
            ragged = " (only the first dimension may differ)" if ref.kind in _RAGGED else ""
            raise ValueError(f"the ranks disagree: rank {first} called {ref.describe()} but rank {r} called "
                             f"{call.describe()}; make the same calls, with tensors of the same dtype and "
                             f"shape{ragged}, in the same order on every rank")
    if joined and not (ref.kind == "allreduce" and ref.op in (Average, Sum)):
        raise RuntimeError(f"rank {first} called {ref.describe()} while ranks {joined} are in hvd.join(); only "
                           "allreduce with op Average or Sum can run while some ranks have joined (as in Horovod)")
    return ref, joined


def _agree(what: str, check: Any) -> tuple[MPI.Intracomm, list[tuple[Any, ...]], Call]:
    """Run ``check()`` (local: returns this rank's Call or raises), then the agreement step."""
    comm = current(what).comm
    try:
        row: tuple[Any, ...] = ("call", check())
    except Exception as exc:  # anything (a user's compressor too): raised on every rank, never on one alone
        row = _error_row(exc)
    rows = exchange(comm, row)
    ref, _ = _verdict(rows)
    assert ref is not None
    return comm, rows, ref


# -- local checks -----------------------------------------------------------------------------------


def _tensors(what: str, tensors: Any, argument: str = "tensors") -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{what}: {argument}: expected a list of torch tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _tensor(what, t, f"{argument}[{i}]")
    return list(tensors)


def _tensor(what: str, tensor: Any, argument: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: {argument}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: {argument}: expected a dense (strided) tensor, got {tensor.layout}")
    return tensor


def _common(what: str, name: Any, process_set: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{what}: name: expected a str or None, got {type(name).__name__}")
    check_global(process_set, what)


def _factor(what: str, argument: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(float(value)):
        raise ValueError(f"{what}: {argument}: expected a finite number, got {value!r}")
    return float(value)


def _rank(what: str, comm_size: int, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < comm_size:
        raise ValueError(f"{what}: root_rank: expected a rank in [0, {comm_size - 1}], got {value!r}")
    return int(value)


def _entry(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(t.dtype).replace("torch.", ""), tuple(t.shape)


# -- moving data ------------------------------------------------------------------------------------


def _numeric(t: torch.Tensor, op: int) -> np.ndarray:
    """A private 1-D host copy of ``t`` to reduce with ``op`` (bfloat16, and float16 but in sums, as float32)."""
    t = t.detach()
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16 and op not in (Average, Sum):
        t = t.float()
    return np.array(t.cpu().numpy(), copy=True).reshape(-1)


def _zeros(dtype_name: str, shape: tuple[int, ...], op: int) -> np.ndarray:
    return _numeric(torch.zeros(shape, dtype=getattr(torch, dtype_name)), op)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous host copy of ``t``'s bytes."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return np.array(flat.view(torch.uint8).numpy(), copy=True) if flat.numel() else np.zeros(0, np.uint8)


def _from_bytes(buf: np.ndarray, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    out = torch.from_numpy(buf).view(like.dtype).reshape(tuple(shape)) if buf.size else \
        torch.empty(tuple(shape), dtype=like.dtype)
    return out.to(like.device)


def _reduce(comm: MPI.Intracomm, arr: np.ndarray, op: int, pre: float, post: float) -> None:
    """Reduce ``arr`` in place over ``comm``: Horovod's ``post * op(pre * x)`` (Average: sum / size)."""
    if arr.dtype == np.float16:  # a sum (see _numeric): on the wire as float16, added in float32, rounded once
        if pre != 1.0:
            np.multiply(arr, pre, out=arr, dtype=np.float32, casting="unsafe")
        compressed_allreduce(comm, arr, half_format(np.float16), scale=post / comm.Get_size() if op == Average
                             else post)
        return
    if pre != 1.0:
        np.multiply(arr, pre, out=arr, casting="unsafe")
    comm.Allreduce(MPI.IN_PLACE, arr, op=_MPI_OPS[ReduceOp(op)])
    scale = post / comm.Get_size() if op == Average else post
    if scale != 1.0:
        np.multiply(arr, scale, out=arr, casting="unsafe")


class _Collective(torch.autograd.Function):
    """A collective as an autograd function: ``run()`` makes the outputs, ``back(*grads)`` the inputs' gradients."""

    @staticmethod
    def forward(ctx: Any, run: Any, back: Any, *inputs: torch.Tensor) -> Any:
        ctx.back = back
        out = run()
        outs = out if isinstance(out, tuple) else (out,)
        ctx.mark_non_differentiable(*(o for o in outs if not (o.is_floating_point() or o.is_complex())))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *ctx.back(*grads))


def _differentiable(run: Any, back: Any, inputs: Sequence[Any]) -> Any:
    """``run()``, recorded by autograd (``back`` computes the inputs' gradients, collectively) when it must be.

    Whether it is recorded changes nothing in what is sent: every rank makes
    the same calls either way.
    """
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return _Collective.apply(run, back, *inputs)
    return run()


class Handle:
    """A finished operation: :func:`synchronize` returns its result, :func:`poll` is True."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def poll(self) -> bool:
        """True: the operation has completed."""
        return True

    def wait(self) -> Any:
        """The operation's result."""
        return self._result


def poll(handle: Handle) -> bool:
    """Whether the operation of ``handle`` has completed (always, here).

    Raises:
        TypeError: ``handle`` is not a handle of this module.
    """
    return _handle("poll", handle).poll()


def synchronize(handle: Handle) -> Any:
    """The result of the operation of ``handle``.

    Raises:
        TypeError: ``handle`` is not a handle of this module.
    """
    return _handle("synchronize", handle).wait()


def _handle(what: str, handle: Any) -> Handle:
    """``handle``, refused with a ``TypeError`` naming ``what`` unless it is a handle of this module."""
    if not isinstance(handle, Handle):
        raise TypeError(f"{what}: handle: expected a handle from an *_async call, got {type(handle).__name__}")
    return handle


# -- allreduce --------------------------------------------------------------------------------------


def _allreduce(what: str, tensors: Any, average: bool | None, name: Any, op: Any, prescale_factor: Any,
               postscale_factor: Any, process_set: Any, compression: Any = Compression.none,
               inplace: bool = False, single: bool = False) -> list[torch.Tensor]:
    """The one allreduce: every variant is this with other arguments."""
    sent: list[torch.Tensor] = []
    contexts: list[Any] = []
    factors = (1.0, 1.0)

    def check() -> Call:
        nonlocal factors
        reduce_op = resolve_op(op, average, what)
        _common(what, name, process_set)
        factors = (_factor(what, "prescale_factor", prescale_factor),
                   _factor(what, "postscale_factor", postscale_factor))
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise TypeError(f"{what}: compression: expected Compression.none or Compression.fp16, got {compression!r}")
        checked = [_tensor(what, tensors[0])] if single else _tensors(what, tensors)
        for i, t in enumerate(checked):
            if t.dtype == torch.bool or t.is_complex() and reduce_op in (ReduceOp.Min, ReduceOp.Max):
                raise TypeError(f"{what}: tensors[{i}]: {t.dtype} cannot be reduced with op={reduce_op.name}")
            c, ctx = compression.compress(t)
            sent.append(c)
            contexts.append(ctx)
        return Call("allreduce", int(reduce_op), -1, tuple(_entry(t) for t in sent))

    comm, _, call = _agree(what, check)
    out = []
    for t, ctx in zip(sent, contexts, strict=True):
        arr = _numeric(t, call.op)
        _reduce(comm, arr, call.op, *factors)
        out.append(compression.decompress(torch.from_numpy(arr).reshape(t.shape).to(t.dtype).to(t.device), ctx))
    if inplace:
        with torch.no_grad():
            for t, o in zip(tensors, out, strict=True):
                t.copy_(o)
        return list(tensors)
    return out


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Reduce ``tensor`` over the ranks into a new tensor; a handle to it (collective).

    Args:
        tensor: the same dtype and shape on every rank.
        average: deprecated: True for ``op=Average``, False for ``op=Sum``.
        name: accepted for compatibility (calls are matched by order, as in MPI).
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor: multiplies each rank's tensor before the reduction.
        postscale_factor: multiplies the result.
        process_set: only ``global_process_set``.

    Raises:
        ValueError, TypeError, NotImplementedError: on every rank, for bad
            input on any rank or tensors that differ between ranks.
    """
    return Handle(_allreduce("allreduce_async", [tensor], average, name, op,
                             prescale_factor, postscale_factor, process_set, single=True)[0])


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks into a new tensor (collective); as :func:`allreduce_async`.

    Differentiable, as in Horovod: the gradient is the allreduce of the
    outputs' gradients with the same op and factors.

    Args:
        compression: ``Compression.none`` or ``Compression.fp16`` (floating
            tensors travel as float16; the result has the tensor's dtype).
    """
    def run() -> torch.Tensor:
        return _allreduce("allreduce", [tensor], average, name, op, prescale_factor, postscale_factor, process_set,
                          compression, single=True)[0]

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        return [allreduce(grad, average, None, Compression.none, op, prescale_factor, postscale_factor)]

    return _differentiable(run, back, [tensor])


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """Reduce ``tensor`` in place; a handle to it (collective). See :func:`allreduce_async`."""
    return Handle(_allreduce("allreduce_async_", [tensor], average, name, op,
                             prescale_factor, postscale_factor, process_set, inplace=True, single=True)[0])


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it (collective). See :func:`allreduce_async`."""
    return _allreduce("allreduce_", [tensor], average, name, op, prescale_factor,
                      postscale_factor, process_set, inplace=True, single=True)[0]


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> Handle:
    """Reduce a list of tensors into new tensors; a handle to the list (collective)."""
    return Handle(_allreduce("grouped_allreduce_async", tensors, average, name, op, prescale_factor,
                             postscale_factor, process_set))


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors into new tensors (collective); differentiable as :func:`allreduce`."""
    def run() -> tuple[torch.Tensor, ...]:
        return tuple(_allreduce("grouped_allreduce", tensors, average, name, op, prescale_factor, postscale_factor,
                                process_set, compression))

    def back(*grads: torch.Tensor) -> list[torch.Tensor]:
        return grouped_allreduce(list(grads), average, None, Compression.none, op, prescale_factor, postscale_factor)

    return list(_differentiable(run, back, tensors if isinstance(tensors, Sequence) else []))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """Reduce a list of tensors in place; a handle to the list (collective)."""
    return Handle(_allreduce("grouped_allreduce_async_", tensors, average, name, op, prescale_factor,
                             postscale_factor, process_set, inplace=True))


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors in place and return it (collective)."""
    return _allreduce("grouped_allreduce_", tensors, average, name, op, prescale_factor, postscale_factor,
                      process_set, inplace=True)


# -- allgather, broadcast, alltoall, reducescatter -----------------------------------------------------


def _allgather(what: str, tensor: Any, name: Any, process_set: Any) -> tuple[torch.Tensor, list[int]]:
    def check() -> Call:
        _common(what, name, process_set)
        t = _tensor(what, tensor)
        if t.dim() == 0:
            raise ValueError(f"{what}: tensor: expected at least one dimension, got a 0-d tensor")
        return Call("allgather", -1, -1, (_entry(t),))

    comm, rows, call = _agree(what, check)
    firsts = [row[1].tensors[0][1][0] for row in rows]
    tail = call.tensors[0][1][1:]
    row_bytes = int(np.prod(tail, dtype=np.int64)) * tensor.element_size()
    recv = np.empty(sum(firsts) * row_bytes, dtype=np.uint8)
    comm.Allgatherv(_bytes(tensor), [recv, [f * row_bytes for f in firsts]])
    return _from_bytes(recv, tensor, (sum(firsts), *tail)), firsts


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """Every rank's tensor, concatenated along the first dimension in rank order (collective).

    The first dimension may differ between ranks; the others and the dtype
    may not. Differentiable, as in Horovod: this rank's rows of the average
    of every rank's gradient.
    """
    firsts: list[int] = []

    def run() -> torch.Tensor:
        out, counts = _allgather("allgather", tensor, name, process_set)
        firsts.extend(counts)
        return out

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        me = current("allgather").comm.Get_rank()
        return [allreduce(grad, op=Average).narrow(0, sum(firsts[:me]), firsts[me])]

    return _differentiable(run, back, [tensor])


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> Handle:
    """:func:`allgather`, as a handle."""
    return Handle(_allgather("allgather_async", tensor, name, process_set)[0])


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor, in order (differentiable as it)."""
    return [allgather(t, name, process_set) for t in tensors]


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> Handle:
    """:func:`grouped_allgather`, as a handle."""
    return Handle(grouped_allgather(tensors, name, process_set))


def _broadcast(what: str, tensor: Any, root_rank: Any, name: Any, process_set: Any, inplace: bool) -> torch.Tensor:
    def check() -> Call:
        _common(what, name, process_set)
        t = _tensor(what, tensor)
        root = _rank(what, current(what).comm.Get_size(), root_rank)
        return Call("broadcast", -1, root, (_entry(t),))

    comm, _, call = _agree(what, check)
    buf = _bytes(tensor)
    if buf.size:
        comm.Bcast(buf, root=call.root)
    out = _from_bytes(buf, tensor, tensor.shape)
    if inplace:
        with torch.no_grad():
            tensor.copy_(out)
        return tensor
    return out


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s tensor, as a new tensor on every rank (collective).

    Differentiable, as in Horovod: the root's gradient is the average of
    every rank's, the others' is zero.
    """
    def run() -> torch.Tensor:
        return _broadcast("broadcast", tensor, root_rank, name, process_set, False)

    def back(grad: torch.Tensor) -> list[torch.Tensor]:
        averaged = allreduce(grad, op=Average)
        return [averaged if current("broadcast").comm.Get_rank() == root_rank else averaged * 0]

    return _differentiable(run, back, [tensor])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """:func:`broadcast`, as a handle."""
    return Handle(_broadcast("broadcast_async", tensor, root_rank, name, process_set, False))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Copy rank ``root_rank``'s tensor into ``tensor`` on every rank and return it (collective)."""
    return _broadcast("broadcast_", tensor, root_rank, name, process_set, True)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """:func:`broadcast_`, as a handle."""
    return Handle(_broadcast("broadcast_async_", tensor, root_rank, name, process_set, True))


def _alltoall(what: str, tensor: Any, splits: Any, name: Any, process_set: Any) -> Any:
    def check() -> Call:
        _common(what, name, process_set)
        t = _tensor(what, tensor)
        size = current(what).comm.Get_size()
        if t.dim() == 0:
            raise ValueError(f"{what}: tensor: expected at least one dimension, got a 0-d tensor")
        if splits is None:
            if t.shape[0] % size:
                raise ValueError(f"{what}: tensor: without splits the first dimension must divide by the number "
                                 f"of ranks ({size}), got shape {tuple(t.shape)}")
            mine = [t.shape[0] // size] * size
        else:
            raw = splits.tolist() if isinstance(splits, (torch.Tensor, np.ndarray)) else splits
            if not isinstance(raw, (list, tuple)) or len(raw) != size or \
                    any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in raw):
                raise ValueError(f"{what}: splits: expected {size} non-negative ints (one per rank), got {splits!r}")
            if sum(raw) != t.shape[0]:
                raise ValueError(f"{what}: splits: expected ints that sum to the first dimension {t.shape[0]}, got "
                                 f"{list(raw)} (sum {sum(raw)})")
            mine = list(raw)
        return Call("alltoall", -1, -1, (_entry(t),), tuple(mine))

    comm, rows, call = _agree(what, check)
    me = comm.Get_rank()
    tail = call.tensors[0][1][1:]
    row_bytes = int(np.prod(tail, dtype=np.int64)) * tensor.element_size()
    send_splits = list(rows[me][1].splits)
    received = [row[1].splits[me] for row in rows]
    recv = np.empty(sum(received) * row_bytes, dtype=np.uint8)
    send_counts = [s * row_bytes for s in send_splits]
    recv_counts = [s * row_bytes for s in received]
    comm.Alltoallv([_bytes(tensor), (send_counts, _offsets(send_counts))],
                   [recv, (recv_counts, _offsets(recv_counts))])
    out = _from_bytes(recv, tensor, (sum(received), *tail))
    if splits is None:
        return out
    return out, torch.tensor(received, dtype=torch.int32)


def _offsets(counts: Sequence[int]) -> list[int]:
    return [0, *np.cumsum(counts[:-1], dtype=np.int64).tolist()] if counts else []


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` (in order) to each rank ``r``; receive theirs (collective).

    Args:
        tensor: at least 1-D; the first dimension may differ between ranks.
        splits: one non-negative int per rank (a list or an int tensor)
            summing to the first dimension; None: equal parts.

    Returns:
        Without ``splits``: the received rows, in rank order. With
        ``splits`` (as Horovod 0.28): ``(rows, received_splits)``, the
        second an int32 tensor of how many rows came from each rank.
        Differentiable, as in Horovod: the gradient travels back by the
        received splits.
    """
    received: list[torch.Tensor] = []

    def run() -> Any:
        out = _alltoall("alltoall", tensor, splits, name, process_set)
        if isinstance(out, tuple):
            received.append(out[1])
        return out

    def back(grad: torch.Tensor, *ignored: Any) -> list[torch.Tensor]:
        if received:
            return [alltoall(grad, splits=received[0])[0]]
        return [alltoall(grad)]

    return _differentiable(run, back, [tensor])


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> Handle:
    """:func:`alltoall`, as a handle (its result is always ``(rows, received_splits)``, as in Horovod)."""
    result = _alltoall("alltoall_async", tensor, splits, name, process_set)
    if splits is None:
        size = current("alltoall_async").comm.Get_size()
        result = (result, torch.full((size,), result.shape[0] // size, dtype=torch.int32))
    return Handle(result)


def _rows_of(first: int, size: int, rank: int) -> int:
    """Rows of a first dimension ``first`` that rank ``rank`` gets (the first ``first % size`` get one more)."""
    return first // size + (1 if rank < first % size else 0)


def _reducescatter(what: str, tensor: Any, name: Any, compression: Any, op: Any, process_set: Any,
                   prescale_factor: Any, postscale_factor: Any) -> torch.Tensor:
    state: dict[str, Any] = {}

    def check() -> Call:
        reduce_op = resolve_op(op, None, what)
        _common(what, name, process_set)
        state["factors"] = (_factor(what, "prescale_factor", prescale_factor),
                            _factor(what, "postscale_factor", postscale_factor))
        t = _tensor(what, tensor)
        if t.dim() == 0:
            raise ValueError(f"{what}: tensor: expected at least one dimension, got a 0-d tensor")
        if t.dtype == torch.bool:
            raise TypeError(f"{what}: tensor: {t.dtype} cannot be reduced")
        c, ctx = compression.compress(t)
        state["sent"], state["ctx"] = c, ctx
        return Call("reducescatter", int(reduce_op), -1, (_entry(c),))

    comm, _, call = _agree(what, check)
    sent: torch.Tensor = state["sent"]
    pre, post = state["factors"]
    size, me = comm.Get_size(), comm.Get_rank()
    arr = _numeric(sent, ReduceOp.Max)  # float32 for 16-bit floats: Reduce_scatter sums natively
    row = int(np.prod(sent.shape[1:], dtype=np.int64))
    counts = [_rows_of(sent.shape[0], size, r) * row for r in range(size)]
    if pre != 1.0:
        np.multiply(arr, pre, out=arr, casting="unsafe")
    recv = np.empty(counts[me], dtype=arr.dtype)
    comm.Reduce_scatter(arr, recv, counts, op=_MPI_OPS[ReduceOp(call.op)])
    scale = post / size if call.op == Average else post
    if scale != 1.0:
        np.multiply(recv, scale, out=recv, casting="unsafe")
    out = torch.from_numpy(recv).reshape((counts[me] // row if row else _rows_of(sent.shape[0], size, me),
                                          *sent.shape[1:]))
    return compression.decompress(out.to(sent.dtype).to(sent.device), state["ctx"])


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks; each rank gets its rows of the result (collective).

    Rank ``r`` gets ``n // size`` rows of the first dimension ``n``, one
    more when ``r < n % size``, in rank order.
    """
    return _reducescatter("reducescatter", tensor, name, compression, op, process_set, prescale_factor,
                          postscale_factor)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """:func:`reducescatter`, as a handle."""
    return Handle(_reducescatter("reducescatter_async", tensor, name, Compression.none, op, process_set,
                                 prescale_factor, postscale_factor))


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor, in order."""
    return [_reducescatter("grouped_reducescatter", t, name, compression, op, process_set, prescale_factor,
                           postscale_factor) for t in tensors]


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """:func:`grouped_reducescatter`, as a handle."""
    return Handle(grouped_reducescatter(tensors, name, Compression.none, op, process_set, prescale_factor,
                                        postscale_factor))


# -- join and barrier ---------------------------------------------------------------------------------


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with zeros until every rank joins.

    As in Horovod, an Average still divides by the number of all ranks, and
    any other collective while some rank is in ``join`` raises on every rank.

    Args:
        device: accepted for compatibility (zeros are made on the host).

    Returns:
        The rank that joined last (the highest, when several joined in the same step).
    """
    comm = current("hvd.join()").comm
    rounds = 0
    while True:
        rows = exchange(comm, ("join", rounds))
        call, _ = _verdict(rows)
        if call is None:
            last = min(row[1] for row in rows)
            return max(r for r, row in enumerate(rows) if row[1] == last)
        for dtype, shape in call.tensors:
            _reduce(comm, _zeros(dtype, shape, call.op), call.op, 1.0, 1.0)
        rounds += 1


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank has called it (collective)."""
    def check() -> Call:
        check_global(process_set, "barrier")
        return Call("barrier", -1, -1, ())

    comm, _, _ = _agree("barrier", check)
    comm.Barrier()
