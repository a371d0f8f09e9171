"""The backend and the ``mpi://`` rendezvous registered with torch, and a default group over any communicator."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from mpi4py import MPI

from ..._core.options import Options
from ..._core.rendezvous import tcp_rendezvous
from ..._core.singleton import check_not_singleton
from .basics import BACKEND, RENDEZVOUS
from .group import MPIProcessGroup


def register() -> None:
    """Register the backend ``"mpi_gradreducer"`` (CPU and CUDA) and the rendezvous ``mpi://`` with torch.

    Idempotent; ``import mpi_gradreducer.torch`` calls it.
    """
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    try:
        dist.register_rendezvous_handler(RENDEZVOUS, _mpi_rendezvous)
    except RuntimeError:  # registered already
        pass


def _mpi_rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                    **_: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """``mpi://``: rank and size from ``MPI.COMM_WORLD``, a ``TCPStore`` on rank 0 (collective)."""
    check_not_singleton()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    query = parse_qs(urlparse(url).query)
    for key, mine in (("rank", rank), ("world_size", size)):
        given = int(query.get(key, ["-1"])[0])
        if given not in (-1, mine):
            raise ValueError(f"init_process_group: {key}={given} was given, but MPI says {mine} (rank {rank}); "
                             f"with init_method='{RENDEZVOUS}://' leave rank and world_size out")
    meet = tcp_rendezvous(world)
    store = dist.TCPStore(meet.address, meet.port, size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    yield store, rank, size
    raise RuntimeError(f"the {RENDEZVOUS}:// rendezvous cannot be repeated")


def init_process_group(comm: MPI.Intracomm | None = None, options: Options | None = None,
                       timeout: datetime.timedelta | None = None) -> None:
    """Make ``torch.distributed``'s default process group over the ranks of ``comm`` (collective).

    ``init_process_group("mpi_gradreducer", init_method="mpi://")`` does the
    same over ``MPI.COMM_WORLD``; this one takes any intracommunicator, such
    as the survivors' after a lost rank (:class:`ElasticGroup`). Rank ``r`` of
    ``comm`` is rank ``r`` of the group; the store is a ``TCPStore`` on an
    address of ``comm``'s rank 0 that every rank reaches.

    Args:
        comm: the ranks; default ``MPI.COMM_WORLD``.
        options: the group's options (see :class:`MPIProcessGroup`).
        timeout: torch's timeout for the group (default 30 minutes).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    timeout = datetime.timedelta(minutes=30) if timeout is None else timeout
    meet = tcp_rendezvous(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    store = dist.TCPStore(meet.address, meet.port, size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=size, timeout=timeout,
                            pg_options=_Over(comm, options))


class _Over:
    """``pg_options`` that carry the communicator a default group is made over (:func:`init_process_group`)."""

    def __init__(self, comm: MPI.Intracomm, options: Options | None) -> None:
        self.comm, self.options = comm, options


def _create(opts: Any, options: Any) -> MPIProcessGroup:
    """The backend's creator (torch's extended API): the process group of ``opts.global_ranks_in_group``."""
    check_not_singleton()
    rank, size = int(opts.group_rank), int(opts.group_size)
    members = [int(r) for r in opts.global_ranks_in_group]
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(f"{BACKEND}: needs MPI_THREAD_MULTIPLE (its communication thread), which MPI did not "
                           "grant; leave mpi4py.rc.thread_level at its default")
    world = MPI.COMM_WORLD
    if isinstance(options, _Over):
        world, options = options.comm, options.options
        members = []
    if not members or members == list(range(world.Get_size())) and not _is_ours(dist.group.WORLD):
        if world.Get_size() != size:
            raise RuntimeError(
                f"{BACKEND}: torch.distributed says world size {size} (rank {rank}), but the MPI communicator has "
                f"{world.Get_size()} processes: start every rank with mpiexec (or srun --mpi=pmi2), not torchrun")
        comm = world.Split(0, rank)  # our own duplicate, ranked as torch ranks them
    else:
        parent = dist.group.WORLD
        if _is_ours(parent):
            spawner = parent._spawner  # type: ignore[union-attr]
        else:  # the default group is another backend's: its ranks must be MPI's
            spawner = world
            if dist.get_rank() != world.Get_rank():
                raise RuntimeError(f"new_group(backend={BACKEND!r}): the default group's rank {dist.get_rank()} "
                                   f"is not MPI's rank {world.Get_rank()}; start the job with mpiexec")
        made = spawner.Create_group(spawner.Get_group().Incl(members))
        assert isinstance(made, MPI.Intracomm)
        comm = made
    if comm.Get_rank() != rank or comm.Get_size() != size:
        raise RuntimeError(f"{BACKEND}: the communicator has rank {comm.Get_rank()} of {comm.Get_size()} where "
                           f"torch expects rank {rank} of {size}")
    assert isinstance(comm, MPI.Intracomm)
    return MPIProcessGroup(comm, options, timeout=opts.timeout)


def _is_ours(pg: Any) -> bool:
    return isinstance(pg, MPIProcessGroup)


# -- work -----------------------------------------------------------------------------------------
