"""An optimizer's state sent from one rank to every rank: its layout pickled, its tensors as raw bytes."""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from .._core import agreement

__all__ = ["Placeholder", "rebuild", "send_state", "strip"]


def send_state(comm: MPI.Intracomm, inner: torch.optim.Optimizer, root: int) -> None:
    """Copy rank ``root``'s state of ``inner`` into every rank's (collective over ``comm``).

    Raises:
        ValueError: on every rank, when some rank's optimizer cannot take
            ``root``'s state (other param groups), naming that rank.
    """
    rank = comm.Get_rank()
    tensors: list[torch.Tensor] = []
    layout = None
    if rank == root:
        layout = strip(inner.state_dict(), tensors)
    layout = comm.bcast(layout, root=root)
    if rank != root:
        tensors = []
        layout = rebuild(layout, tensors)
    for t in tensors:
        flat = t.reshape(-1)
        if flat.numel():
            comm.Bcast(flat.view(torch.uint8).numpy(), root=root)
    error = None
    if rank != root:
        try:
            inner.load_state_dict(layout)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            error = ValueError(f"load_state_dict of rank {root}'s optimizer state failed: {exc}")
    agreement.raise_if_any(comm, error)


class Placeholder:
    """A tensor's place in a state's layout: its position among the tensors, shape and dtype."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`Placeholder`; the tensors (contiguous, on the host) appended."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().to("cpu").contiguous())
        return Placeholder(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(strip(v, tensors) for v in obj)
    return obj


def rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`strip`, with empty tensors to receive the bytes."""
    if isinstance(obj, Placeholder):
        tensors.append(torch.empty(obj.shape, dtype=obj.dtype))
        return tensors[-1]
    if isinstance(obj, dict):
        return {k: rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild(v, tensors) for v in obj)
    return obj
