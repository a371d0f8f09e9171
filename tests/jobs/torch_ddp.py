"""``mpi_gradreducer.torch.DistributedOptimizer`` held against torch's ``DistributedDataParallel`` over gloo.

Used by ``tests/test_torch_optimizer.py``; runs as a whole MPI job::

    mpiexec -n 4 python -m mpi4py tests/jobs/torch_ddp.py

Each case trains the same float64 model from the same start on the same
per-rank data for ``--steps`` steps twice, once with the optimizer and once
with DDP, and prints one line on rank 0::

    case=NAME max_difference=D moved=M

``D``: the largest absolute difference between the two runs' parameters
over all ranks; ``M``: how far the parameters moved from their start (so
that agreement is not that of two runs which did nothing). Cases:

``overlap``
    ``progress="thread"``: buckets reduced on a communication thread while
    backward runs.
``unused``
    A layer used on even ranks only (DDP: ``find_unused_parameters=True``),
    and one used on no rank (its ``.grad`` stays None in both, so that
    momentum does not move it: ``never_moved`` is 0).
``accumulate``
    ``backward_passes_per_step=2`` (DDP: the first of two backward passes in
    ``no_sync()``).
``no_sync``
    ``opt.no_sync()`` around the first of two backward passes.
``clip``
    ``synchronize()``, ``clip_grad_norm_``, then ``step()`` in
    ``skip_synchronize()``, with Adam (DDP: clipping after backward).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpi_gradreducer.torch import DistributedOptimizer, broadcast_parameters, clip_grad_norm_, init_gloo

CASES = ("overlap", "unused", "accumulate", "no_sync", "clip")
MAX_NORM = 0.05


class Net(torch.nn.Module):
    """An MLP with a side layer that only some ranks use, and one that no rank uses."""

    def __init__(self, use_side: bool, never: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.side = torch.nn.Linear(16, 16)
        if never:
            self.never = torch.nn.Linear(3, 3)
        self.fc2 = torch.nn.Linear(16, 3)
        self.use_side = use_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.use_side:
            h = h + torch.tanh(self.side(h))
        return self.fc2(h)


def model(case: str, rank: int) -> Net:
    torch.manual_seed(7)
    return Net(use_side=case != "unused" or rank % 2 == 0, never=case == "unused").double()


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)


def loss_of(net: Callable[[torch.Tensor], torch.Tensor], step: int, micro: int, rank: int) -> torch.Tensor:
    x, y = batch(step, micro, rank)
    return torch.nn.functional.mse_loss(net(x), y)


def make_optimizer(case: str, params: Any) -> torch.optim.Optimizer:
    if case == "clip":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_ours(case: str, steps: int, rank: int) -> Net:
    net = model(case, rank)
    broadcast_parameters(net)
    options = {"progress": "thread"} if case == "overlap" else {}
    passes = 2 if case == "accumulate" else 1
    with DistributedOptimizer(make_optimizer(case, net.parameters()), backward_passes_per_step=passes,
                              **options) as opt:
        for step in range(steps):
            opt.zero_grad()
            if case in ("accumulate", "no_sync"):
                with opt.no_sync() if case == "no_sync" else contextlib.nullcontext():
                    loss_of(net, step, 0, rank).backward()
                loss_of(net, step, 1, rank).backward()
                opt.step()
            elif case == "clip":
                loss_of(net, step, 0, rank).backward()
                opt.synchronize()
                clip_grad_norm_(opt, MAX_NORM)
                with opt.skip_synchronize():
                    opt.step()
            else:
                loss_of(net, step, 0, rank).backward()
                opt.step()
    return net


def train_ddp(case: str, steps: int, rank: int) -> Net:
    net = model(case, rank)
    ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=case == "unused")
    opt = make_optimizer(case, ddp.parameters())
    for step in range(steps):
        opt.zero_grad()
        if case in ("accumulate", "no_sync"):
            with ddp.no_sync():
                loss_of(ddp, step, 0, rank).backward()
            loss_of(ddp, step, 1, rank).backward()
        else:
            loss_of(ddp, step, 0, rank).backward()
            if case == "clip":
                torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.grad is not None], MAX_NORM)
        opt.step()
    # gloo's worker thread must be idle before DDP is dropped (torch 2.13 deadlocks otherwise; see train_torch.py)
    dist.barrier()
    time.sleep(0.2)
    del ddp, opt
    return net


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    init_gloo(comm)
    try:
        for case in args.cases:
            ours = train_ours(case, args.steps, rank)
            reference = train_ddp(case, args.steps, rank)
            start = model(case, rank)
            with torch.no_grad():
                pairs = zip(ours.parameters(), reference.parameters(), strict=True)
                diff = max(float((p - q).abs().max()) for p, q in pairs)
                moved = min(float((p - q).abs().max()) for (n, p), q in zip(ours.named_parameters(),
                            start.parameters(), strict=True) if not n.startswith("never"))
                never = max((float((p - q).abs().max()) for (n, p), q in zip(ours.named_parameters(),
                            start.parameters(), strict=True) if n.startswith("never")), default=0.0)
            diff = comm.allreduce(diff, op=MPI.MAX)
            moved = comm.allreduce(moved, op=MPI.MIN)
            never = comm.allreduce(never, op=MPI.MAX)
            if rank == 0:
                print(f"case={case} max_difference={diff:.3e} moved={moved:.3e} never_moved={never:.3e}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
