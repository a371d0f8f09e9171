"""What a training loop keeps across a lost rank: its state, committed, restored and shared.

A state is committed (copied aside) every few steps. When a rank is lost,
every survivor restores the last commit, the ranks take the newest commit
from the lowest rank that holds it (:meth:`State.sync`), and the loop goes
on from there. :class:`ArrayState` keeps arrays (numpy or cupy, changed in
place by the loop) and plain Python values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core import backend, groups
from .world import World

__all__ = ["ArrayState", "State"]


class State:
    """The base of elastic states: commit, restore, sync and reset callbacks, over one :class:`World`.

    Subclasses define :meth:`save`, :meth:`restore` and :meth:`sync_from`.

    Args:
        world: the ranks this state lives on and the objects rebuilt when they change.
    """

    def __init__(self, world: World) -> None:
        self._world = world
        self._reset_callbacks: list[Callable[[], Any]] = []
        #: How many commits this state has had (the same on every rank after :meth:`sync`).
        self.commits = 0
        self._saved_commits = 0  # the count that belongs to the state saved aside
        #: The last loss of ranks this process survived (a :class:`~.errors.RanksLost`), or None.
        self.failure: BaseException | None = None

    @property
    def world(self) -> World:
        """The ranks and the rebuilt objects."""
        return self._world

    @property
    def comm(self) -> MPI.Intracomm:
        """The communicator of the ranks training now (it changes when ranks are lost or join)."""
        return self._world.comm

    @property
    def rank(self) -> int:
        """This rank in ``comm``; in a replacement before it joins, the rank it will have (see :attr:`World.rank`)."""
        return self._world.rank

    @property
    def size(self) -> int:
        """The number of ranks training now; in a replacement before it joins, the number it joins."""
        return self._world.size

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call each of ``callbacks`` (no arguments) after the ranks changed and the state was synced.

        For what depends on the number of ranks or on this rank: the learning
        rate's scaling, the shard of the data each rank reads.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run :meth:`reset`, then the reset callbacks in the order registered."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """What a subclass does after the ranks changed, before the callbacks (nothing here)."""

    def commit(self) -> None:
        """Copy the state aside (local), then :meth:`check_host_updates`.

        Raises:
            HostsUpdated: (on every rank at the same commit) new ranks are ready to join.
        """
        self.save()
        self.commits += 1
        self._saved_commits = self.commits
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`~.errors.HostsUpdated` on every rank once new ranks are ready to join.

        Costs nothing unless a host discovery script or host file is set,
        then one small nonblocking reduction per call.
        """
        self._world.check_host_updates()

    def sync(self) -> None:
        """Every rank takes the newest commit, from the lowest rank that holds it (collective), and commits it."""
        root = self._world.newest(self.commits)
        commits = self._world.comm.bcast(self.commits, root=root)
        self.sync_from(root)
        self.commits = commits  # only once the state it counts has arrived: a root lost meanwhile leaves the old
        self.save()
        self._saved_commits = self.commits

    def rollback(self) -> None:
        """Go back to the last commit, its count included (local): :meth:`restore`, then :attr:`commits`.

        What the run loop does after a lost rank. A sync cut short by the
        loss of its root leaves neither the half-sent state nor its count.
        """
        self.restore()
        self.commits = self._saved_commits

    def save(self) -> None:
        """Copy the state aside (local)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last commit (local)."""
        raise NotImplementedError

    def sync_from(self, root: int) -> None:
        """Take rank ``root``'s state (collective over ``comm``)."""
        raise NotImplementedError


class ArrayState(State):
    """Arrays changed in place and plain values, committed into buffers made once.

    The arrays are the caller's own (parameters, optimizer moments): a
    commit copies each into a buffer of the same shape, dtype and device,
    made at construction; a restore copies it back, in place, so that every
    reference to them (a reducer's, the training loop's) stays valid. The
    plain values (step and epoch counters, a data position, small lists)
    become attributes and are deep-copied: keep large data in arrays.

    Construction is collective over ``comm`` (the world's duplicate).

    Args:
        arrays: numpy or cupy arrays, as a sequence or a mapping of names.
        reducers: objects rebuilt on the new communicator after a change of
            ranks: :class:`~mpi_gradreducer.DistributedGradReducer`, the torch
            ``DistributedOptimizer``, or any object with ``communicators()``,
            ``abandon()`` and ``rebuild(comm)``.
        comm: the ranks; default ``MPI.COMM_WORLD`` (a replacement's own
            world until it joins).
        **values: the plain values, as attributes.

    Raises:
        TypeError: an entry of ``arrays`` is not an array, or a value name is taken.
    """

    def __init__(self, arrays: Sequence[Any] | Mapping[str, Any] = (), *, reducers: Iterable[Any] = (),
                 comm: MPI.Intracomm | None = None, **values: Any) -> None:
        named = dict(arrays) if isinstance(arrays, Mapping) else {str(i): a for i, a in enumerate(arrays)}
        for name, a in named.items():
            if backend.device_of(a) is None:
                raise TypeError(f"arrays[{name!r}]: expected a numpy or cupy array, got {type(a).__name__}")
        taken = sorted(set(values) & set(dir(ArrayState)))
        if taken:
            raise TypeError(f"values: these names belong to the state itself: {', '.join(taken)}")
        super().__init__(World(comm))
        self._arrays = named
        self._buffers = {k: backend.empty(max(1, a.size), a.dtype, backend.device_of(a) or "cpu")[:a.size]
                         .reshape(a.shape) for k, a in named.items()}
        self._names = tuple(values)
        self._saved: dict[str, Any] = {}
        for k, v in values.items():
            setattr(self, k, v)
        for r in reducers:
            self._world.track(r)
        self.save()

    @property
    def arrays(self) -> dict[str, Any]:
        """The arrays, by name (``"0"``, ``"1"``, ... when given as a sequence)."""
        return dict(self._arrays)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (what a commit copies)."""
        return sum(int(a.nbytes) for a in self._arrays.values())

    def save(self) -> None:
        for k, a in self._arrays.items():
            _copy(self._buffers[k], a)
        self._saved = {k: _plain_copy(getattr(self, k)) for k in self._names}

    def restore(self) -> None:
        for k, a in self._arrays.items():
            _copy(a, self._buffers[k])
        for k, v in self._saved.items():
            setattr(self, k, _plain_copy(v))

    def sync_from(self, root: int) -> None:
        comm = self._world.comm
        if self._arrays:
            groups.broadcast_parameters(list(self._arrays.values()), root=root, group=comm)
        values = comm.bcast({k: getattr(self, k) for k in self._names}, root=root)
        for k, v in values.items():
            setattr(self, k, v)


def _copy(dst: Any, src: Any) -> None:
    """One copy of ``src`` into ``dst`` (same shape, dtype and device)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src, casting="no")
    else:
        dst[...] = src


def _plain_copy(value: Any) -> Any:
    """``value`` itself when it cannot change (numbers, text, None), else a deep copy."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    return copy.deepcopy(value)
