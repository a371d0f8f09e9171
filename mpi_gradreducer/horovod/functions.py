"""Horovod's helper functions: parameters, optimizer state and Python objects from one rank to all."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch

from .. import torch as mgr_torch
from .collectives import raise_everywhere
from .context import current
from .process_sets import check_global, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _root(what: str, size: int, root_rank: Any) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral) or not 0 <= int(root_rank) < size:
        raise ValueError(f"{what}: root_rank: expected a rank in [0, {size - 1}], got {root_rank!r}")


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy rank ``root_rank``'s tensors into every rank's, in place (collective).

    Args:
        params: ``model.state_dict()`` (a dict: taken in sorted key order, as
            Horovod does), ``model.named_parameters()`` or a list of tensors
            or ``(name, tensor)`` tuples; the same shapes on every rank.
        root_rank: the rank whose values everyone takes.

    Raises:
        ValueError, TypeError: on every rank, for bad input on any rank or
            tensors that differ between ranks (naming the first).
    """
    what = "broadcast_parameters"
    comm = current(what).comm
    error = None
    tensors: list[torch.Tensor] = []
    try:
        _root(what, comm.Get_size(), root_rank)
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
    raise_everywhere(comm, error)
    mgr_torch.broadcast_parameters(tensors, root=int(root_rank), group=comm)


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None) -> None:
    """Copy rank ``root_rank``'s optimizer state and hyper-parameters into every rank's optimizer (collective).

    An optimizer with no state yet gets ``root_rank``'s hyper-parameters (its
    state is then made by the first step on every rank alike; Horovod makes
    it by a step with zero gradients instead).

    Args:
        optimizer: a :class:`DistributedOptimizer` or a torch optimizer.
        root_rank: the rank whose state everyone takes.
        model: accepted for compatibility; unused.

    Raises:
        ValueError, TypeError: on every rank, for bad input on any rank or a
            state that some rank's optimizer cannot load.
    """
    what = "broadcast_optimizer_state"
    comm = current(what).comm
    error = None
    try:
        _root(what, comm.Get_size(), root_rank)
        if not isinstance(optimizer, (torch.optim.Optimizer, mgr_torch.DistributedOptimizer)):
            raise TypeError(f"{what}: optimizer: expected a torch optimizer or a DistributedOptimizer, got "
                            f"{type(optimizer).__name__}")
    except (TypeError, ValueError) as exc:
        error = exc
    raise_everywhere(comm, error)
    mgr_torch.broadcast_optimizer_state(optimizer, root=int(root_rank), group=comm)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Rank ``root_rank``'s ``obj`` (pickled), returned on every rank (collective).

    Raises:
        ValueError, NotImplementedError: on every rank, for a bad
            ``root_rank`` or process set on any rank.
    """
    what = "broadcast_object"
    comm = current(what).comm
    error = None
    try:
        _root(what, comm.Get_size(), root_rank)
        check_global(process_set, what)
    except (ValueError, NotImplementedError) as exc:
        error = exc
    raise_everywhere(comm, error)
    return comm.bcast(obj, root=int(root_rank))


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj`` (pickled), as a list in rank order, on every rank (collective)."""
    return current("allgather_object").comm.allgather(obj)
