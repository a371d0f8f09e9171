"""``ElasticGroup``: the default process group made again over the survivors of a lost rank."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from mpi4py import MPI

from ..._core.options import Options
from .group import MPIProcessGroup
from .registry import init_process_group


class ElasticGroup:
    """``torch.distributed``'s default group of this backend, made again over each new communicator of
    :mod:`mpi_gradreducer.elastic` (Open MPI with ULFM: ``mpiexec --with-ft ulfm``)::

        state = elastic.ArrayState([p.detach().numpy() for p in model.parameters()], step=0)
        group = ElasticGroup(state)          # makes the default group over state.comm, tracked by its world
        state.register_reset_callbacks([make_ddp])  # DDP made again over the new group

        @elastic.run(failure=group.failed)
        def train(state): ...

    Construction is collective over ``state.comm``. Only the default group is
    made again; groups made with ``new_group`` must be made again by a reset
    callback.

    Args:
        state: the elastic state whose world's communicator the group follows.
        options: the group's options (see :class:`MPIProcessGroup`).
        timeout: torch's timeout for the group.
    """

    def __init__(self, state: Any, options: Options | None = None,
                 timeout: datetime.timedelta | None = None) -> None:
        self.options, self.timeout = options, timeout
        init_process_group(state.comm, options, timeout)
        state.world.track(self)

    def communicators(self) -> Iterator[MPI.Comm]:
        """The default group's communicators (revoked by the world after a lost rank)."""
        pg = dist.group.WORLD if dist.is_initialized() else None
        if isinstance(pg, MPIProcessGroup):
            yield from pg.communicators()

    def abandon(self) -> None:
        """Drop the default group: its threads stopped, its communicators freed, no collective (local)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def rebuild(self, comm: MPI.Intracomm) -> None:
        """Drop the default group (:meth:`abandon`) and make it again over ``comm`` (collective)."""
        self.abandon()
        init_process_group(comm, self.options, self.timeout)

    @staticmethod
    def failed(exc: BaseException) -> bool:
        """For ``elastic.run(failure=...)``: whether the default group's calls met an MPI error.

        DDP hands the backend's errors on as ``RuntimeError`` with their text
        only; the group keeps the MPI error itself.
        """
        pg = dist.group.WORLD if dist.is_initialized() else None
        return isinstance(pg, MPIProcessGroup) and pg.mpi_error is not None
