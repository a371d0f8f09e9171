"""Horovod's ``hvd.elastic`` on :mod:`mpi_gradreducer.elastic`: ``run``, the states and ``ElasticSampler``.

::

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

Started with ``mpiexec --with-ft ulfm -n 4 python train.py`` (Open MPI 5):
when a rank is lost, the survivors restore the last commit, the Horovod
context is made again over them (``hvd.size()`` and ``hvd.rank()`` change),
the ``DistributedOptimizer`` is rebuilt on it, the state is synced from
the lowest rank with the newest commit, and the reset callbacks run. New
ranks started in the room a host discovery script lists
(``MPI_GRADREDUCER_ELASTIC_DISCOVERY``) join at a commit, which raises
``HostsUpdatedInterrupt`` there, as in Horovod. A process started as a
replacement runs the script from its top and joins in ``run``: from its
``hvd.init()`` on, ``hvd.size()`` and ``hvd.rank()`` already say the world
it joins (the running ranks first, then the new ones), so that samplers made
at the top partition the data as the running ranks' do; its collectives
before ``run`` go over the processes started with it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from mpi4py import MPI

from .. import elastic as _elastic, torch as mgr_torch
from ..torch.optimizer_state import fill, strip
from . import session
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run``: ``func(state, ...)`` survives lost ranks and takes in new ones.

    See :func:`mpi_gradreducer.elastic.run` (the discovery, minimum and
    maximum size come from the environment here).
    """
    return _elastic.run(func, failure=lambda exc: isinstance(exc, HorovodInternalError))


class _Context:
    """The Horovod context, made again over each new communicator (``hvd.size()``/``hvd.rank()`` follow)."""

    def communicators(self) -> Iterator[MPI.Comm]:
        ctx = session._Session.context
        if ctx is not None:
            yield from ctx.communicators()

    def rebuild(self, comm: MPI.Intracomm) -> None:
        ctx = session._Session.context
        optimizers = [] if ctx is None else list(ctx.optimizers)
        session.shutdown()  # frees the old communicators, locally after a revoke
        session.init(comm)
        # the same DistributedOptimizer objects go on (rebuilt after this): join() and the stall warnings serve them
        session.current("hvd.elastic").optimizers.extend(optimizers)

    def abandon(self) -> None:
        """At exit, before MPI is finalized: stop the engine's thread (no MPI call may follow the finalize)."""
        ctx = session._Session.context
        if ctx is not None:
            ctx.engine.close(limit=5.0)


def _world() -> _elastic.World:
    world = _elastic.World(session.current("hvd.elastic state").comm, interrupt=HostsUpdatedInterrupt)
    world.track(_Context())
    return world


class State(_elastic.State):
    """Horovod's base state: ``commit``, ``restore``, ``sync``, ``check_host_updates`` and reset callbacks.

    Args:
        bcast_object, get_rank: accepted for Horovod's signature; unused
            (the state uses the Horovod context's communicator).
    """

    def __init__(self, bcast_object: Any = None, get_rank: Any = None) -> None:
        super().__init__(_world())


class ObjectState(State):
    """Plain Python values as attributes, deep-copied at each commit (Horovod's ``ObjectState``).

    Args:
        bcast_object, get_rank: unused (Horovod's signature).
        **kwargs: the values.
    """

    def __init__(self, bcast_object: Any = None, get_rank: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self._values = tuple(kwargs)
        self._saved: dict[str, Any] = {}
        for k, v in kwargs.items():
            setattr(self, k, v)
        self.save()

    def save(self) -> None:
        self._saved = {k: copy.deepcopy(getattr(self, k)) for k in self._values}

    def restore(self) -> None:
        for k, v in self._saved.items():
            setattr(self, k, copy.deepcopy(v))

    def sync_from(self, root: int) -> None:
        values = self.comm.bcast({k: getattr(self, k) for k in self._values}, root=root)
        for k, v in values.items():
            setattr(self, k, v)


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain values (Horovod's ``TorchState``).

    A commit copies the model's ``state_dict`` and the optimizer's state
    tensors into tensors made once (again only when their shapes change,
    e.g. at the optimizer's first step), the rest deep-copied. A
    :class:`~mpi_gradreducer.torch.DistributedOptimizer` among the values
    is rebuilt on each new communicator.

    Args:
        model: a ``torch.nn.Module``, or None.
        optimizer: a torch optimizer or ``DistributedOptimizer``, or None.
        **kwargs: more values: modules, optimizers and :class:`ElasticSampler` are handled as such, the rest
            as plain values.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {k: _handler(v) for k, v in kwargs.items()}
        self._handlers = {k: h for k, h in handlers.items() if h is not None}
        plain = {k: v for k, v in kwargs.items() if k not in self._handlers}
        super().__init__(**plain)
        for k, h in self._handlers.items():
            object.__setattr__(self, k, h.value)
            if isinstance(h.value, mgr_torch.DistributedOptimizer):
                self.world.track(h.value)
        self.save()

    def save(self) -> None:
        for h in getattr(self, "_handlers", {}).values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync_from(self, root: int) -> None:
        for h in self._handlers.values():
            h.sync(self.comm, root)
        super().sync_from(root)


class _Tensors:
    """Tensors copied into tensors made once (made again when the shapes change)."""

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] = []

    def save(self, tensors: list[torch.Tensor]) -> None:
        if [(t.shape, t.dtype, t.device) for t in tensors] != [(s.shape, s.dtype, s.device) for s in self.saved]:
            self.saved = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        with torch.no_grad():
            for s, t in zip(self.saved, tensors, strict=True):
                s.copy_(t)


class _Model:
    def __init__(self, model: torch.nn.Module) -> None:
        self.value = model
        self._tensors = _Tensors()

    def save(self) -> None:
        self._tensors.save(list(self.value.state_dict().values()))

    def restore(self) -> None:
        with torch.no_grad():
            for t, s in zip(self.value.state_dict().values(), self._tensors.saved, strict=True):
                t.copy_(s)

    def sync(self, comm: MPI.Intracomm, root: int) -> None:
        mgr_torch.broadcast_parameters(list(self.value.state_dict().values()), root=root, group=comm)


class _Optimizer:
    def __init__(self, optimizer: Any) -> None:
        self.value = optimizer
        self._tensors = _Tensors()
        self._layout: Any = None

    def save(self) -> None:
        tensors: list[torch.Tensor] = []
        self._layout = strip(self.value.state_dict(), tensors, keep=lambda t: t)  # copied by save()
        self._tensors.save(tensors)

    def restore(self) -> None:
        copies = [t.clone() for t in self._tensors.saved]  # the optimizer may keep what it loads
        self.value.load_state_dict(fill(self._layout, copies))

    def sync(self, comm: MPI.Intracomm, root: int) -> None:
        mgr_torch.broadcast_optimizer_state(self.value, root=root, group=comm)


class _Sampler:
    def __init__(self, sampler: ElasticSampler) -> None:
        self.value = sampler
        self._saved = sampler.state_dict()

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, comm: MPI.Intracomm, root: int) -> None:
        self.value.load_state_dict(comm.bcast(self.value.state_dict(), root=root))


def _handler(value: Any) -> Any:
    if isinstance(value, torch.nn.Module):
        return _Model(value)
    if isinstance(value, (torch.optim.Optimizer, mgr_torch.DistributedOptimizer)):
        return _Optimizer(value)
    if isinstance(value, ElasticSampler):
        return _Sampler(value)
    return None


class ElasticSampler(torch.utils.data.Sampler):
    """Shares a dataset's indices among the ranks training now, skipping those already processed this epoch.

    Horovod's ``ElasticSampler``: put it in the :class:`TorchState`, call
    :meth:`record_batch` after each batch and :meth:`set_epoch` at the end
    of each epoch. After a change of ranks, the indices not yet processed
    are shared among the new ranks.

    Args:
        dataset: a dataset of fixed length.
        shuffle: shuffle the indices, the same way on every rank (by ``seed + epoch``).
        seed: the shuffle's seed (the same on every rank).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list[int] = []
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet (call it at the end of the previous epoch)."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """The epoch and the number of samples processed in it."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Take ``state_dict``'s epoch and progress, and share the rest among the ranks training now."""
        self.epoch, self.processed_num = int(state_dict["epoch"]), int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Share the indices not yet processed this epoch among ``hvd.size()`` ranks."""
        self.num_replicas, self.rank = session.size(), session.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        indices += indices[:self.total_size - len(indices)]  # padded to a multiple of the ranks
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
