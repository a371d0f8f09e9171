"""What a torch training script needs beside the optimizer: broadcasts, gloo's process group, clipping."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable

import numpy as np
import torch
from mpi4py import MPI

from .._core import backend, groups
from .._core.rendezvous import tcp_rendezvous
from .._core.shard import Shard
from .._core.singleton import check_not_singleton
from .optimizer import DistributedOptimizer
from .optimizer_state import send_state
from .tensors import bytes_of, check_same_tensors

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "clip_grad_norm_", "init_gloo"]


def broadcast_parameters(model: torch.nn.Module | Iterable[torch.Tensor], root: int = 0,
                         group: MPI.Intracomm | None = None) -> None:
    """Copy rank ``root``'s parameters and buffers into every rank's, in place (collective).

    Args:
        model: a ``torch.nn.Module`` (its parameters, then its buffers), or
            tensors (the same on every rank).
        root: the rank whose values everyone takes.
        group: the communicator; default ``MPI.COMM_WORLD``.

    Raises:
        ValueError: on every rank, when the models differ (naming the first
            parameter or buffer that does, and both ranks).
    """
    comm = MPI.COMM_WORLD if group is None else group
    named: list[tuple[str, torch.Tensor]]
    if isinstance(model, torch.nn.Module):
        named = [(f"parameter {n!r}", t) for n, t in model.named_parameters()]
        named += [(f"buffer {n!r}", t) for n, t in model.named_buffers()]
    else:
        named = [(f"tensors[{i}]", t) for i, t in enumerate(model)]
    tensors = [t.detach() for _, t in named]
    check_same_tensors(comm, tensors, [n for n, _ in named])
    with torch.no_grad():
        groups.broadcast_parameters([bytes_of(t) for t in tensors], root=root, group=comm)


def init_gloo(comm: MPI.Intracomm | None = None, timeout: float = 300.0) -> None:
    """Start ``torch.distributed``'s default process group over gloo, with the ranks of ``comm`` (collective).

    For a comparison with DDP, or torch code that needs a process group
    beside the reducer: rank ``r`` of ``comm`` is rank ``r`` of the group.
    The ranks meet at an address of rank 0 that every rank can reach
    (``tcp_rendezvous``; ``127.0.0.1`` where
    they share one host), and gloo binds to the interface that leads there,
    unless ``GLOO_SOCKET_IFNAME`` is set already. Across hosts whose host
    names resolve to a loopback address, torch's own defaults would leave
    the ranks waiting for each other until ``timeout``.

    Args:
        comm: the ranks; default ``MPI.COMM_WORLD``.
        timeout: seconds gloo waits for the other ranks, at the rendezvous and in each collective.

    Raises:
        RuntimeError: on every rank, when no address of rank 0 is routable from every rank.
    """
    import torch.distributed as dist

    check_not_singleton()
    comm = MPI.COMM_WORLD if comm is None else comm
    meet = tcp_rendezvous(comm)
    if meet.interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", meet.interface)
    dist.init_process_group("gloo", init_method=meet.url, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            timeout=datetime.timedelta(seconds=timeout))


def broadcast_optimizer_state(optimizer: DistributedOptimizer | torch.optim.Optimizer, root: int = 0,
                              group: MPI.Intracomm | None = None) -> None:
    """Copy rank ``root``'s optimizer state (and hyper-parameters) into every rank's optimizer (collective).

    The state's layout travels pickled, its tensors as raw bytes; every rank
    other than ``root`` loads the result with ``load_state_dict``.

    Args:
        optimizer: a :class:`DistributedOptimizer` (its communicator is used)
            or a torch optimizer.
        root: the rank whose state everyone takes.
        group: the communicator for a torch optimizer; default ``MPI.COMM_WORLD``.

    Raises:
        ValueError: on every rank, when some rank's optimizer cannot take
            ``root``'s state (other param groups), naming that rank.
    """
    if isinstance(optimizer, DistributedOptimizer):
        comm, inner = optimizer.comm, optimizer.optimizer
    else:
        comm, inner = (MPI.COMM_WORLD if group is None else group), optimizer
    send_state(comm, inner, root)


def clip_grad_norm_(target: DistributedOptimizer | Shard, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale the averaged gradients in place so that their total norm is at most ``max_norm``.

    For a :class:`DistributedOptimizer`, call it between ``synchronize()``
    and ``step()`` (inside ``skip_synchronize()``): every rank then holds the
    same averaged gradients, and this is ``torch.nn.utils.clip_grad_norm_``
    over them. For a sharded step (a :class:`~mpi_gradreducer.Shard`
    from ``reducer.reduce_scatter``), each rank holds only its pieces: their
    norms are combined across the ranks (one small Allreduce), and every
    rank scales its pieces by the same factor.

    Args:
        target: the optimizer, synchronized, or a shard.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``math.inf`` for the largest magnitude).

    Returns:
        The total norm before clipping (the same on every rank).

    Raises:
        RuntimeError: for an optimizer that is not synchronized.
    """
    if isinstance(target, DistributedOptimizer):
        if not target.synchronized:
            raise RuntimeError("clip_grad_norm_: call opt.synchronize() first, then step() inside "
                               "opt.skip_synchronize()")
        grads = [p for p in target._params if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type))
    if not isinstance(target, Shard):
        raise TypeError(f"clip_grad_norm_: expected a DistributedOptimizer or a Shard, got {type(target).__name__}")
    p = float(norm_type)
    local = np.zeros(1, dtype=np.float64)
    for piece in target:
        grad = piece.grad if isinstance(piece.grad, np.ndarray) else backend.to_numpy(piece.grad)  # device pieces
        g = np.abs(grad.astype(np.float64, copy=False))
        if g.size:
            local[0] = max(local[0], float(g.max())) if math.isinf(p) else local[0] + float(np.sum(g ** p))
    target.comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX if math.isinf(p) else MPI.SUM)
    total = float(local[0]) if math.isinf(p) else float(local[0]) ** (1.0 / p)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for piece in target:
            piece.grad[...] *= coef
    return total
