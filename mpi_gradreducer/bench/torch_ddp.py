"""DDP over the ``mpi_gradreducer`` backend, DDP over gloo and the package's ``DistributedOptimizer``, one model.

Run under MPI (every rank)::

    mpiexec -n 2 python -m mpi_gradreducer.bench.torch_ddp --width 1024 --depth 4 --batch 32

Each method trains the same float32 MLP on the same batches (DDP over this
backend as it comes, and with ``gradient_as_bucket_view=True``: ``_view``;
DDP over gloo; the package's ``DistributedOptimizer``); a repetition
times ``--steps`` steps of each method in turn (interleaved, so that a noisy
moment hurts all of them), after one untimed repetition. Rank 0 prints, per
method, the median over repetitions of the slowest rank's seconds per step,
and its ratios to DDP over gloo and to the ``DistributedOptimizer``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the comparison (collective over ``MPI.COMM_WORLD``); returns each method's median seconds per step."""
    parser = argparse.ArgumentParser(prog="python -m mpi_gradreducer.bench.torch_ddp", description=__doc__)
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=10, help="steps per method and repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .._core.rendezvous import tcp_rendezvous
    from ..torch import DistributedOptimizer
    from ..torch.distributed import BACKEND

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    dist.init_process_group(BACKEND, init_method="mpi://")
    interface = tcp_rendezvous(comm).interface  # gloo's own choice may be loopback (host names that resolve so)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers)

    def trainer(net: torch.nn.Module, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        return step

    ours, theirs, mine = DistributedDataParallel(model()), DistributedDataParallel(model(), process_group=gloo), model()
    viewed = DistributedDataParallel(model(), gradient_as_bucket_view=True)
    methods = {
        "ddp_mpi_gradreducer": trainer(ours, torch.optim.SGD(ours.parameters(), lr=0.01)),
        "ddp_mpi_gradreducer_view": trainer(viewed, torch.optim.SGD(viewed.parameters(), lr=0.01)),
        "ddp_gloo": trainer(theirs, torch.optim.SGD(theirs.parameters(), lr=0.01)),
        "distributed_optimizer": trainer(mine, DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.01))),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(args.reps + 1):
        for name, step in methods.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            seconds = comm.allreduce((time.perf_counter() - start) / args.steps, op=MPI.MAX)
            if rep:
                times[name].append(seconds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    if comm.Get_rank() == 0:
        grads = sum(p.numel() for p in mine.parameters()) * 4
        print(f"torch_ddp ranks={comm.Get_size()} width={args.width} depth={args.depth} batch={args.batch} "
              f"gradient_bytes={grads} steps={args.steps} reps={args.reps}")
        for name, seconds in medians.items():
            print(f"method={name} seconds_per_step={seconds:.5f} over_ddp_gloo={seconds / medians['ddp_gloo']:.3f} "
                  f"over_distributed_optimizer={seconds / medians['distributed_optimizer']:.3f}")
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    return medians


if __name__ == "__main__":
    main()
