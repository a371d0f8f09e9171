"""How a call becomes an operation of the engine: its key, its local checks, its request, its handle.

:func:`submit` runs the call's local checks and preparation (``prepare``,
which returns the request's fields, this rank's host arrays and how to
make the result). When they raise, the request carries the error instead,
so that the other ranks of the process set raise it too (the lowest
failing rank's, naming it) rather than wait: a blocking call on this rank
raises the same verdict; an ``*_async`` call raises its own error at once,
as in Horovod. A name already in flight in the process set is refused at
once, on this rank only (``ValueError``, as in Horovod): the operation is
never submitted.

Errors have Horovod's types: ranks that disagree (dtype, shape, root,
operation) or a kind that cannot run while a rank is in ``join()`` raise
:class:`HorovodInternalError` (a ``RuntimeError``); a bad argument raises
its own type (``ValueError``, ``TypeError``, ``NotImplementedError``) on
every rank.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._core import agreement, interop
from .engine import Handle, Op
from .exceptions import HorovodInternalError
from .execute import NUMPY, Local, wire_dtype
from .negotiation import JOIN, Request, Response
from .session import SetInfo, current

__all__ = ["Prepared", "submit", "wait", "set_of", "tensor_arg", "tensors_arg", "entry",
           "numeric", "writable_view", "raw_bytes", "from_bytes", "factor_arg", "dtype_name"]

#: What ``prepare`` returns: the request's fields (but key, kind, what), this rank's arrays, the result maker.
Prepared = tuple[dict[str, Any], Local | None, Callable[[Response, list[Any]], Any]]


def set_of(what: str, process_set: Any) -> SetInfo:
    """The process set ``process_set`` (a ``ProcessSet``; None: the global one) of this rank.

    Raises:
        ValueError: it is not registered, or this rank is not in it (on this rank only).
        TypeError: it is not a ``ProcessSet``.
    """
    ctx = current(what)
    if process_set is None:
        return ctx.sets[0]
    set_id = getattr(process_set, "process_set_id", "absent")
    if set_id == "absent":
        raise TypeError(f"{what}: process_set: expected a ProcessSet (hvd.global_process_set or one from "
                        f"hvd.add_process_set), got {type(process_set).__name__}")
    info = ctx.sets.get(set_id) if isinstance(set_id, int) else None
    if info is None:
        raise ValueError(f"{what}: process_set: {process_set} is not registered (add it with hvd.add_process_set "
                         "on every rank first)")
    if not info.member:
        raise ValueError(f"{what}: process_set: rank {ctx.comm.Get_rank()} is not in {process_set}")
    return info


def _key(engine: Any, info: SetInfo, what: str, name: Any, kind: str) -> str:
    wanted = JOIN if kind == "join" else name if isinstance(name, str) else None
    key = engine.reserve(info.id, wanted)
    if key is None:
        raise ValueError(f"{what}: name={wanted!r} is already in flight in this process set: Horovod refuses a "
                         "second operation with the name of one that has not completed")
    return str(key)


def error_of(response: Response) -> BaseException:
    """The exception of an error response: Horovod's internal error, or the bad argument's type."""
    assert response.error is not None
    kind, message = response.error
    if response.internal:
        return HorovodInternalError(message)
    return agreement.exception_of(kind, message)


def submit(what: str, kind: str, process_set: Any, name: Any, prepare: Callable[[SetInfo], Prepared],
           blocking: bool) -> Handle:
    """Check and submit one operation; its handle.

    Args:
        what: the call, for messages (``hvd.allreduce``).
        kind: the operation's kind (see :class:`~.negotiation.Request`).
        process_set: the ``process_set`` argument.
        name: the ``name`` argument (None: matched by the count of unnamed operations).
        prepare: this rank's checks and arrays (raises on bad arguments).
        blocking: whether the caller waits for the result (a local error then waits for the verdict).

    Raises:
        ValueError, TypeError: an unknown process set or one without this
            rank, or a name in flight (this rank only, nothing submitted);
            an ``*_async`` call's own bad argument (after submitting it).
    """
    ctx = current(what)
    info = set_of(what, process_set)
    local_error: Exception | None = None
    if name is not None and not isinstance(name, str):
        local_error = TypeError(f"{what}: name: expected a str or None, got {type(name).__name__}")
    key = _key(ctx.engine, info, what, name, kind)
    fields: dict[str, Any] = {}
    local: Local | None = None
    finish: Callable[[Response, list[Any]], Any] = _nothing
    if local_error is None:
        try:
            fields, local, finish = prepare(info)
        except Exception as exc:  # anything (a user's compressor too): raised on every rank, never on one alone
            local_error = exc
    if local_error is not None:
        fields = {"error": (type(local_error).__name__, str(local_error))}
        local = None
    request = Request(key, kind, what, **fields)
    handle = ctx.engine.submit(Op(info.id, request, local, Handle(finish, ctx.engine.signal), error_of))
    if local_error is not None and not blocking:
        raise agreement.exception_of(type(local_error).__name__, f"rank {ctx.comm.Get_rank()}: {local_error}")
    return handle


def _nothing(response: Response, outputs: list[Any]) -> None:
    return None


def wait(handle: Handle) -> Any:
    """The result of ``handle`` (blocks; the engine naps shorter meanwhile)."""
    ctx = current("hvd.synchronize()")
    return handle.wait(ctx.engine)


# -- local checks and host copies ---------------------------------------------------------------------


def tensors_arg(what: str, tensors: Any, argument: str = "tensors") -> list[torch.Tensor]:
    """``tensors``, checked: a list of dense torch tensors."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{what}: {argument}: expected a list of torch tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        tensor_arg(what, t, f"{argument}[{i}]")
    return list(tensors)


def tensor_arg(what: str, tensor: Any, argument: str = "tensor") -> torch.Tensor:
    """``tensor``, checked: a dense torch tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: {argument}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: {argument}: expected a dense (strided) tensor, got {tensor.layout}")
    return tensor


def factor_arg(what: str, argument: str, value: Any) -> float:
    """A finite real scaling factor."""
    if type(value) is float and math.isfinite(value):  # the common case, at once
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(float(value)):
        raise ValueError(f"{what}: {argument}: expected a finite number, got {value!r}")
    return float(value)


def dtype_name(t: torch.Tensor) -> str:
    """``float32`` for ``torch.float32``, and so on."""
    name = _NAMES.get(t.dtype)
    return name if name is not None else str(t.dtype).replace("torch.", "")


def entry(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """What the other ranks see of a tensor: its dtype name and shape."""
    return dtype_name(t), tuple(t.shape)


def numeric(t: torch.Tensor, op: int) -> np.ndarray:
    """A private 1-D host copy of ``t`` in the dtype it is reduced in with ``op``.

    Raises:
        TypeError: a dtype that cannot be reduced.
    """
    wire = wire_dtype(dtype_name(t), op)
    host = t.detach()
    if host.dtype == torch.bfloat16 or host.dtype == torch.float16 and wire == np.float32:
        host = host.float()
    return np.array(host.cpu().numpy(), dtype=wire, copy=True).reshape(-1)


def writable_view(t: torch.Tensor, op: int) -> np.ndarray | None:
    """A writable 1-D host view of ``t``'s own memory when it is reduced in its own dtype with ``op`` (a
    contiguous CPU tensor of a dtype numpy has), through the core's :func:`~mpi_gradreducer._core.interop.view`;
    else None."""
    dtype = _VIEWABLE.get(t.dtype)
    if dtype is None or not t.is_cpu or not t.is_contiguous() or dtype == np.float16 and op not in _HALF_SUMS:
        return None
    own = t.detach() if t.requires_grad else t
    try:  # a CPU tensor's numpy() shares its memory (the common case, at once); else the core's views
        a = own.numpy() if type(own) is torch.Tensor else interop.view(own)
    except RuntimeError:  # a conjugate or negative view: its bits are not its values
        return None
    if not isinstance(a, np.ndarray) or not a.flags.writeable or a.dtype != dtype:
        return None
    return a.reshape(-1)


#: torch dtypes reduced in their own dtype (float16: under Average and Sum only), and their numpy dtypes.
_VIEWABLE = {getattr(torch, name): np.dtype(dtype) for name, dtype in NUMPY.items() if name != "bfloat16"}
#: torch dtypes and their names (``dtype_name``'s answer without building a string per call).
_NAMES = {getattr(torch, name): name for name in NUMPY}
#: Operations under which float16 is summed as float16 (Average, Sum).
_HALF_SUMS = (0, 1)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A private host copy of ``t``'s bytes (1-D uint8)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return np.array(flat.view(torch.uint8).numpy(), copy=True) if flat.numel() else np.zeros(0, np.uint8)


def from_bytes(buf: np.ndarray, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``like``'s dtype and device over ``buf``'s bytes, of shape ``shape``."""
    out = torch.from_numpy(buf).view(like.dtype).reshape(tuple(shape)) if buf.size else \
        torch.empty(tuple(shape), dtype=like.dtype)
    return out.to(like.device)
