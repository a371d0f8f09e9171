"""Horovod's helper functions: parameters, optimizer state and Python objects from one rank to all.

Each is one or a few operations of the engine (a grouped broadcast, a
pickled payload), so that bad input on one rank raises on every rank and a
rank in ``join()`` makes them raise instead of wait, as any broadcast does.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .. import torch as mgr_torch
from ..torch.optimizer_state import share_state
from .collectives import grouped_broadcast_
from .control import check
from .execute import Local
from .process_sets import global_process_set
from .session import SetInfo, current
from .submit import Prepared, submit, wait

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = global_process_set) -> None:
    """Copy rank ``root_rank``'s tensors into every rank's, in place (one operation).

    Args:
        params: ``model.state_dict()`` (a dict: taken in sorted key order, as
            Horovod does), ``model.named_parameters()`` or a list of tensors
            or ``(name, tensor)`` tuples; the same dtypes and shapes on every rank.
        root_rank: the rank whose values everyone takes.
        process_set: the ranks (not Horovod's: it broadcasts over every rank).

    Raises:
        ValueError, TypeError: on every rank, for bad input on any rank;
            HorovodInternalError, for tensors that differ between ranks.
    """
    what = "hvd.broadcast_parameters"
    tensors: list[torch.Tensor] = []
    error: Exception | None = None
    try:
        if isinstance(params, dict):
            items = sorted(params.items())
        elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        else:
            raise ValueError(f"{what}: params: expected a dict (state_dict()), named_parameters() or a list of "
                             f"tensors, got {type(params).__name__}")
        for i, (key, t) in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: params[{key if key is not None else i!r}]: expected a torch.Tensor, got "
                                f"{type(t).__name__}")
            tensors.append(t)
    except Exception as exc:  # e.g. a generator that raises: on every rank, never on one alone
        error = exc
    if error is not None:
        check(what, (), error, process_set)
    with torch.no_grad():
        grouped_broadcast_([t.detach() for t in tensors], root_rank, process_set=process_set)


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None,
                              process_set: Any = global_process_set) -> None:
    """Copy rank ``root_rank``'s optimizer state and hyper-parameters into every rank's optimizer.

    The state's layout travels pickled, its tensors in one grouped
    broadcast; every other rank loads it with ``load_state_dict``. An
    optimizer with no state yet gets zero gradients for its parameters that
    have none (as Horovod leaves them), but no step is taken (Horovod takes
    one, which moves the weights under weight decay): its state is made by
    the first step, on every rank alike.

    Args:
        optimizer: a :class:`DistributedOptimizer` or a torch optimizer.
        root_rank: the rank whose state everyone takes.
        model: accepted for compatibility; unused.
        process_set: the ranks (not Horovod's: it broadcasts over every rank).

    Raises:
        ValueError, TypeError: on every rank, for bad input on any rank or a
            state that some rank's optimizer cannot load.
    """
    what = "hvd.broadcast_optimizer_state"
    me = current(what).comm.Get_rank()
    inner = optimizer.optimizer if isinstance(optimizer, mgr_torch.DistributedOptimizer) else optimizer
    error: Exception | None = None
    try:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"{what}: optimizer: expected a torch optimizer or a DistributedOptimizer, got "
                            f"{type(optimizer).__name__}")
        if not inner.state:
            _zero_grads(inner)
    except Exception as exc:
        error = exc
    if error is not None:
        check(what, (), error, process_set)

    def bcast_tensors(tensors: list[torch.Tensor]) -> None:
        if tensors:
            grouped_broadcast_(tensors, root_rank, process_set=process_set)

    failed = share_state(inner, me == root_rank, root_rank,
                         lambda layout: broadcast_object(layout, root_rank, name=None, process_set=process_set),
                         bcast_tensors)
    check(what, (), ValueError(f"{what}: {failed}") if failed is not None else None, process_set)


def _zero_grads(inner: torch.optim.Optimizer) -> None:
    """Zero gradients where there are none (sparse ones for ``SparseAdam``), as Horovod leaves them."""
    for group in inner.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(inner, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()


def _payload(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Rank ``root_rank``'s ``obj`` (pickled; a global rank in the process set), returned on every rank of the set.

    Raises:
        ValueError: on every rank, for a bad ``root_rank`` on any rank.
    """
    what = "hvd.broadcast_object"

    def prepare(info: SetInfo) -> Prepared:
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in info.ranks:
            raise ValueError(f"{what}: root_rank: expected a rank of the process set {list(info.ranks)}, got "
                             f"{root_rank!r}")
        mine = _payload(obj) if current(what).comm.Get_rank() == root_rank else np.zeros(0, np.uint8)
        return {"root": root_rank, "splits": (mine.size,)}, Local([mine]), \
            lambda response, outputs: pickle.loads(outputs[0].tobytes())

    return wait(submit(what, "bcast_object", process_set, name, prepare, True))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj`` (pickled), as a list in rank order (of the process set), on every rank of the set."""
    what = "hvd.allgather_object"

    def prepare(info: SetInfo) -> Prepared:
        mine = _payload(obj)

        def finish(response: Any, outputs: list[Any]) -> list[Any]:
            recv, sizes = outputs[0]
            starts = np.cumsum([0, *sizes])
            return [pickle.loads(recv[starts[r]:starts[r + 1]].tobytes()) for r in range(len(sizes))]

        return {"splits": (mine.size,)}, Local([mine]), finish

    return wait(submit(what, "gather_object", process_set, name, prepare, True))
