"""The host benchmark's torch methods: DDP-like gloo buckets, and torch tensors fed to the reducer.

torch is imported inside the functions only, and every decision to use it is
made collectively: a rank that goes on to a collective while another skips it
would hang the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..reducer import DistributedGradReducer
from .output import MIB, one_line

__all__ = ["DDP_BUCKET", "DDP_FIRST_BUCKET", "Gloo", "gloo_usable", "torch_ingestion"]

#: DDP's bucket caps: the first bucket, then every other.
DDP_FIRST_BUCKET = 1 * MIB
DDP_BUCKET = 25 * MIB


def _first_reason(comm: MPI.Comm, reason: str) -> str | None:
    """None when no rank has a reason, else the first rank's, named (collective)."""
    reasons = comm.allgather(reason)
    bad = [(r, why) for r, why in enumerate(reasons) if why]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def gloo_usable(comm: MPI.Comm) -> bool:
    """Whether every rank can import torch with gloo (collective: the same answer on all ranks)."""
    ok = 0
    try:
        import torch.distributed as dist

        ok = int(dist.is_available() and dist.is_gloo_available() and not dist.is_initialized())
    except Exception:  # torch missing or broken: skip the method everywhere
        ok = 0
    return bool(comm.allreduce(ok, op=MPI.MIN))


def torch_ingestion(comm: MPI.Comm) -> str | None:
    """Whether the reducer takes torch CPU tensors, decided on every rank alike (collective).

    Each rank tries, on its own (``MPI.COMM_SELF``, so that a refusal cannot
    leave another rank waiting), a reducer built from one torch tensor and
    called with another, with ``degree=2``; the call must halve the tensor in
    place. Then the ranks compare their answers.

    Returns:
        None when it works on every rank, else why not, naming the first rank
        where it does not: torch does not import there, or the reducer does
        not support torch tensors (with its error).
    """
    reason = ""
    try:
        import torch
    except Exception as exc:  # not installed, or broken: the method is left out
        reason = one_line(f"torch is not importable ({type(exc).__name__}: {exc})")
    else:
        try:
            with DistributedGradReducer([torch.zeros(3)], group=MPI.COMM_SELF, degree=2, timeout=None) as r:
                grad = torch.full((3,), 2.0)
                r([grad])
            if not bool(torch.all(grad == 1.0)):
                reason = "not supported by this reducer (a torch tensor was not averaged in place)"
        except Exception as exc:  # the reducer refuses torch tensors: reported, not fatal
            reason = one_line(f"not supported by this reducer ({type(exc).__name__}: {exc})")
    return _first_reason(comm, reason)


class Gloo:
    """A gloo process group over the ranks of ``comm`` (TCP on rank 0's address); collective.

    Args:
        comm: the ranks of the group.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        import torch
        import torch.distributed as dist

        from ..torch import init_gloo

        self.torch, self.dist = torch, dist
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)  # numpy's copies are single-threaded too; 4 ranks share 2 cores
        init_gloo(comm)
        self.size = comm.Get_size()
        self.version = torch.__version__
        self._comm = comm

    def close(self) -> None:
        """Destroy the process group once every rank is done with it, and restore torch's thread count.

        (A rank that destroys its group while another still reads the last messages closes that rank's
        sockets under gloo's threads.)
        """
        self.dist.barrier()
        self._comm.Barrier()
        self.dist.destroy_process_group()
        self.torch.set_num_threads(self._threads)

    def _buckets(self, tensors: Sequence[Any]) -> list[list[int]]:
        """DDP's bucket assignment: reverse parameter order, per dtype, capped at 1 MiB then 25 MiB."""
        buckets: list[list[int]] = []
        open_bucket: dict[Any, tuple[list[int], int]] = {}
        filled_count: dict[Any, int] = {}
        for i in reversed(range(len(tensors))):
            t = tensors[i]
            members, nbytes = open_bucket.get(t.dtype, ([], 0))
            members.append(i)
            nbytes += t.numel() * t.element_size()
            cap = DDP_FIRST_BUCKET if filled_count.get(t.dtype, 0) == 0 else DDP_BUCKET
            if nbytes >= cap:
                buckets.append(members)
                filled_count[t.dtype] = filled_count.get(t.dtype, 0) + 1
                open_bucket.pop(t.dtype, None)
            else:
                open_bucket[t.dtype] = (members, nbytes)
        buckets.extend(m for m, _ in open_bucket.values())
        return buckets

    def ddp_like(self, grads: Sequence[np.ndarray]) -> tuple[Callable[[], None], int]:
        """DDP's reduction of ``grads`` (shared with numpy), and its bucket count.

        Each bucket is copied into a flat buffer, all-reduced, divided by the
        world size and copied back.
        """
        torch, dist = self.torch, self.dist
        tensors = [torch.from_numpy(g) for g in grads]
        plan = []
        for members in self._buckets(tensors):
            flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=tensors[members[0]].dtype)
            views, offset = [], 0
            for i in members:
                n = tensors[i].numel()
                views.append((flat[offset : offset + n], tensors[i].view(-1)))
                offset += n
            plan.append((flat, views))
        size = self.size

        def run() -> None:
            for flat, views in plan:
                for v, t in views:
                    v.copy_(t)
                dist.all_reduce(flat)
                flat.div_(size)
                for v, t in views:
                    t.copy_(v)

        return run, len(plan)
