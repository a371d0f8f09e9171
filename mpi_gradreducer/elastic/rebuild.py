"""Rebuilding reducers and optimizers on a new communicator, with the options they were made with.

:func:`reducer_arguments` is the one place that knows how to make a reducer
again from a live one: its parameters' shapes and its resolved options
(``DistributedGradReducer(params, group=new, options=old.options)``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any, Protocol

from mpi4py import MPI

from .._core import backend
from .._core.options import Options
from ..reducer import DistributedGradReducer
from . import _ulfm

__all__ = ["Rebuildable", "adapter_for", "reducer_arguments"]


class Rebuildable(Protocol):
    """What a world rebuilds: the communicators to revoke on a failure, and a rebuild on a new communicator."""

    def communicators(self) -> Iterator[MPI.Comm]:
        """Every communicator the object made (revoked when a rank is lost)."""
        ...

    def rebuild(self, comm: MPI.Intracomm) -> None:
        """Release the old communicators locally and make the object again over ``comm`` (collective)."""
        ...


def reducer_arguments(reducer: DistributedGradReducer) -> tuple[list[Any], Options]:
    """Parameters and options that make a reducer like ``reducer`` (local).

    The parameters are fresh arrays of the same shapes, dtypes and devices
    (never written; host ones take no memory until touched); the options are
    the reducer's resolved ones (a ``degree`` that was not given stays
    unset: the new reducer divides by its own number of ranks).
    """
    params = [backend.empty(max(1, math.prod(s.shape)), s.dtype, s.device)[:math.prod(s.shape)].reshape(s.shape)
              for s in reducer._specs]
    return params, reducer.options


class _Reducer:
    """A :class:`~mpi_gradreducer.DistributedGradReducer`, remade in place (the caller's reference stays valid)."""

    def __init__(self, reducer: DistributedGradReducer) -> None:
        self.reducer = reducer

    def communicators(self) -> Iterator[MPI.Comm]:
        return _ulfm.communicators_in(self.reducer)

    def release(self) -> None:
        """Stop the watchdog (at exit, before MPI is finalized); local."""
        self.reducer._instrument.close(write=False)

    def rebuild(self, comm: MPI.Intracomm) -> None:
        params, options = reducer_arguments(self.reducer)
        self.reducer._abandon()
        DistributedGradReducer.__init__(self.reducer, params, group=comm, options=options)


class _Optimizer:
    """The torch ``DistributedOptimizer`` (and Horovod's): its reducer and control communicator remade in place.

    The wrapped torch optimizer, its state and the model are kept; the
    gradient hooks are registered again over the new reducer's buffers.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def communicators(self) -> Iterator[MPI.Comm]:
        return _ulfm.communicators_in(self.optimizer)

    def release(self) -> None:
        """Stop the watchdog (at exit, before MPI is finalized); local."""
        self.optimizer.reducer._instrument.close(write=False)

    def rebuild(self, comm: MPI.Intracomm) -> None:
        from .. import torch as mgr_torch

        opt = self.optimizer
        _, flagged = reducer_arguments(opt.reducer)
        options = flagged.replace(fusion=flagged.ids[1:], skip=flagged.skipped[1:])  # without the flags
        names = opt._names
        for hook in opt._hooks:
            hook.remove()
        opt._hooks = []
        try:
            opt._control.Free()
        except MPI.Exception:
            pass
        opt.reducer._abandon()
        mgr_torch.DistributedOptimizer.__init__(opt, opt.optimizer, opt.passes, comm, options=options)
        opt._names = names


def adapter_for(obj: Any) -> Rebuildable:
    """What rebuilds ``obj``: a reducer, a torch ``DistributedOptimizer``, or an object that rebuilds itself.

    Raises:
        TypeError: ``obj`` is none of these.
    """
    if isinstance(obj, DistributedGradReducer):
        return _Reducer(obj)
    torch_module = sys.modules.get("mpi_gradreducer.torch")
    if torch_module is not None and isinstance(obj, torch_module.DistributedOptimizer):
        return _Optimizer(obj)
    if callable(getattr(obj, "rebuild", None)) and callable(getattr(obj, "communicators", None)):
        return obj
    raise TypeError(f"reducers: expected a DistributedGradReducer, a torch DistributedOptimizer or an object with "
                    f"rebuild(comm) and communicators(), got {type(obj).__name__}")
