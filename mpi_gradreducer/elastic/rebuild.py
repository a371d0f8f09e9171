"""Rebuilding reducers and optimizers on a new communicator, with the options they were made with.

:func:`reducer_arguments` is the one place that knows how to make a reducer
again from a live one: its parameters' shapes and its resolved options, read
back as constructor arguments.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any, Protocol

from mpi4py import MPI

from .._core import backend
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


def reducer_arguments(reducer: DistributedGradReducer) -> tuple[list[Any], dict[str, Any]]:
    """Parameters and keyword arguments that make a reducer like ``reducer`` (local).

    The parameters are fresh arrays of the same shapes, dtypes and devices
    (never written; host ones take no memory until touched). ``degree`` is
    passed only when it was given: otherwise the new reducer divides by its
    own number of ranks.
    """
    o = reducer.options
    params = [backend.empty(max(1, math.prod(s.shape)), s.dtype, s.device)[:math.prod(s.shape)].reshape(s.shape)
              for s in reducer._specs]
    kwargs: dict[str, Any] = dict(
        mean=o.mean, degree=o.degree if o.fixed_degree else None, fusion=list(o.ids), skip=list(o.skip),
        bucket_bytes="auto" if o.bucket_bytes is None else o.bucket_bytes, validate=o.validate, timeout=o.timeout,
        stall_warning=o.stall_warning, check_finite=o.check_finite, cuda_aware=o.cuda_aware, timeline=o.timeline,
        compression=o.powersgd if o.powersgd is not None else o.compression, predivide=o.predivide,
        coalesce=o.coalesce, progress=o.progress, deterministic=o.deterministic)
    return params, kwargs


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
        params, kwargs = reducer_arguments(self.reducer)
        self.reducer._abandon()
        DistributedGradReducer.__init__(self.reducer, params, group=comm, **kwargs)


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
        _, kwargs = reducer_arguments(opt.reducer)
        kwargs["fusion"], kwargs["skip"] = kwargs["fusion"][1:], kwargs["skip"][1:]  # without the flags
        names = opt._names
        for hook in opt._hooks:
            hook.remove()
        opt._hooks = []
        try:
            opt._control.Free()
        except MPI.Exception:
            pass
        opt.reducer._abandon()
        mgr_torch.DistributedOptimizer.__init__(opt, opt.optimizer, opt.passes, group=comm, **kwargs)
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
