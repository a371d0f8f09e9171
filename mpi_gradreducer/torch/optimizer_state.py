"""An optimizer's state taken apart and put together again: sent from one rank to every rank (its layout
pickled, its tensors as raw bytes), or kept by an elastic commit (its tensors copied)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI

from .._core import agreement

__all__ = ["Placeholder", "fill", "rebuild", "send_state", "share_state", "strip"]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def send_state(comm: MPI.Intracomm, inner: torch.optim.Optimizer, root: int) -> None:
    """Copy rank ``root``'s state of ``inner`` into every rank's (collective over ``comm``).

    Raises:
        ValueError: on every rank, when some rank's optimizer cannot take
            ``root``'s state (other param groups), naming that rank.
    """
    def bcast_tensors(tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            flat = t.reshape(-1)
            if flat.numel():
                comm.Bcast(flat.view(torch.uint8).numpy(), root=root)

    error = share_state(inner, comm.Get_rank() == root, root, lambda layout: comm.bcast(layout, root=root),
                        bcast_tensors)
    agreement.raise_if_any(comm, error)


def share_state(inner: torch.optim.Optimizer, is_root: bool, root: int, bcast_layout: Callable[[Any], Any],
                bcast_tensors: Callable[[list[torch.Tensor]], None]) -> ValueError | None:
    """Load the root's state of ``inner`` on every other rank (collective through the two callbacks).

    The root strips its ``state_dict()`` (:func:`strip`); ``bcast_layout``
    gives every rank the root's layout, the others :func:`rebuild` it with
    empty tensors, ``bcast_tensors`` copies the root's tensors into them (the
    same count, shapes and dtypes on every rank), and they load it.

    Returns:
        This rank's error when its optimizer could not load the root's state
        (other param groups), else None: the caller raises it on every rank.
    """
    tensors: list[torch.Tensor] = []
    layout = bcast_layout(strip(inner.state_dict(), tensors) if is_root else None)
    if not is_root:
        tensors = []
        layout = rebuild(layout, tensors)
    bcast_tensors(tensors)
    if is_root:
        return None
    try:
        inner.load_state_dict(layout)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        return ValueError(f"load_state_dict of rank {root}'s optimizer state failed: {exc}")
    return None


class Placeholder:
    """A tensor's place in a state's layout: its position among the tensors, shape and dtype."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def strip(obj: Any, tensors: list[torch.Tensor], keep: Callable[[torch.Tensor], torch.Tensor] = _to_host) -> Any:
    """``obj`` with every tensor replaced by a :class:`Placeholder`, every other leaf copied (``copy.deepcopy``);
    the tensors appended to ``tensors``, as ``keep`` makes them (default: detached, contiguous, on the host)."""
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(keep(value))
            return Placeholder(len(tensors) - 1, tuple(value.shape), value.dtype)
        return copy.deepcopy(value)

    return _map(obj, leaf)


def fill(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`strip`: each :class:`Placeholder` replaced by its tensor of ``tensors``, every
    other leaf copied."""
    return _map(obj, lambda value: tensors[value.index] if isinstance(value, Placeholder) else copy.deepcopy(value))


def rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`strip`, with empty host tensors to receive the bytes (appended to ``tensors``)."""
    def leaf(value: Any) -> Any:
        if isinstance(value, Placeholder):
            tensors.append(torch.empty(value.shape, dtype=value.dtype))
            return tensors[-1]
        return value

    return _map(obj, leaf)


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj``'s dicts, lists and tuples made again, with ``leaf`` of everything else (tensors too)."""
    if isinstance(obj, dict):
        return {k: _map(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, leaf) for v in obj)
    return leaf(obj)
