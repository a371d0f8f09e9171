"""Data-parallel training of a torch MLP on scikit-learn's digits with ``mpi_gradreducer.torch``.

``DistributedOptimizer`` wraps torch's SGD: each gradient is handed to the
reduction by a hook as soon as backward has finished it, and ``step()`` waits
for the average, then steps. Every rank trains on its share of each global
batch::

    mpiexec -n 4 python scripts/train_torch.py
    mpiexec -n 4 python scripts/train_torch.py --overlap
    mpiexec -n 4 python scripts/train_torch.py --check-ddp --overlap

``--overlap`` reduces the buckets on a communication thread while backward
goes on (``progress="thread"``); without it the reducer's ``progress="auto"``
decides (on a machine with fewer cores than ranks: in ``step()``).

``--check-ddp`` trains the same model in float64 a second time with
``torch.nn.parallel.DistributedDataParallel`` over gloo (``init_gloo``:
rendezvous at an address of rank 0 that every rank reaches) and requires the parameters of the two
runs to agree to 1e-9. Output lines are ``key=value`` pairs, for parsing.
Needs torch and scikit-learn (the digits data ship with it: nothing is
downloaded).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from train_digits import (
    Settings as DigitsSettings,  # scripts/, next to this file
    load_data as load_digits,
)

from mpi_gradreducer.torch import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters, init_gloo

#: Required agreement of the reducer's and DDP's parameters (float64).
DDP_TOLERANCE = 1e-9


@dataclass
class Settings(DigitsSettings):
    """The numpy demo's hyper-parameters, with fewer epochs and a torch dtype."""

    epochs: int = 8
    dtype: Any = torch.float32


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The numpy demo's digits (``train_digits.load_data``: split 75/25, standardised), as torch tensors."""
    return tuple(torch.from_numpy(a) for a in load_digits(seed))


def make_model(settings: Settings, comm: MPI.Comm) -> torch.nn.Module:
    """The 64-hidden-10 MLP, with rank 0's initial weights on every rank."""
    torch.manual_seed(settings.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, settings.hidden), torch.nn.ReLU(), torch.nn.Linear(settings.hidden, 10)
    ).to(settings.dtype)
    broadcast_parameters(model, group=comm)
    return model


def batches(n: int, settings: Settings, epoch: int, rank: int, size: int) -> list[torch.Tensor]:
    """This rank's share of every full global batch of one epoch (the same permutation on every rank)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed * 1000 + epoch))
    step = settings.batch_size
    return [order[i : i + step][rank::size] for i in range(0, n - step + 1, step)]


def train_with_reducer(settings: Settings, data: Sequence[torch.Tensor], comm: MPI.Comm,
                       report: Callable[[str], None]) -> torch.nn.Module:
    """Train with ``mpi_gradreducer.torch.DistributedOptimizer``; returns the model."""
    x_train, y_train, x_test, y_test = data
    x_train, x_test = x_train.to(settings.dtype), x_test.to(settings.dtype)
    model = make_model(settings, comm)
    progress = "thread" if settings.overlap else "auto"
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum),
                              group=comm, progress=progress) as optimizer:
        broadcast_optimizer_state(optimizer)
        for epoch in range(settings.epochs):
            total, count = 0.0, 0
            for idx in batches(len(x_train), settings, epoch, comm.Get_rank(), comm.Get_size()):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()  # each gradient is handed to the reduction as soon as autograd finishes it
                optimizer.step()  # waits for the reduction, then steps
                total, count = total + loss.item() * len(idx), count + len(idx)
            sums = np.array([total, count], dtype=np.float64)
            comm.Allreduce(MPI.IN_PLACE, sums)
            report(f"epoch={epoch + 1} loss={sums[0] / sums[1]:.4f} accuracy={accuracy(model, x_test, y_test):.4f}")
    return model


def train_with_ddp(settings: Settings, data: Sequence[torch.Tensor], comm: MPI.Comm) -> torch.nn.Module:
    """The same training with ``DistributedDataParallel`` over gloo; returns the inner model."""
    import torch.distributed as dist

    x_train, y_train = data[0].to(settings.dtype), data[1]
    init_gloo(comm)
    try:
        model = make_model(settings, comm)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=settings.lr, momentum=settings.momentum)
        for epoch in range(settings.epochs):
            for idx in batches(len(x_train), settings, epoch, comm.Get_rank(), comm.Get_size()):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x_train[idx]), y_train[idx]).backward()
                optimizer.step()
        # gloo's worker thread takes the GIL to destroy its last work item; if DDP's reducer (and with it
        # the process group) is destroyed meanwhile, the main thread joins that thread holding the GIL and
        # both wait forever (seen with torch 2.13). So let the worker go idle first, then drop DDP.
        dist.barrier()
        time.sleep(0.2)
        del ddp, optimizer
        return model
    finally:
        dist.destroy_process_group()


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of ``x`` classified as ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).double().mean())


def max_difference(a: torch.nn.Module, b: torch.nn.Module, comm: MPI.Comm) -> float:
    """Largest absolute difference between the two models' parameters, over all ranks."""
    with torch.no_grad():
        local = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    return comm.allreduce(local, op=MPI.MAX)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=Settings.epochs)
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size)
    parser.add_argument("--overlap", action="store_true", help="declare readiness from backward hooks")
    parser.add_argument("--check-ddp", action="store_true", help="compare with DistributedDataParallel (float64)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    settings = Settings(epochs=args.epochs, batch_size=args.batch_size, overlap=args.overlap,
                        dtype=torch.float64 if args.check_ddp else torch.float32)
    torch.set_num_threads(1)  # one core per rank

    def report(line: str) -> None:
        if comm.Get_rank() == 0:
            print(line, flush=True)

    data = load_data(settings.seed)
    report(f"ranks={comm.Get_size()} overlap={settings.overlap} dtype={str(settings.dtype).split('.')[-1]}")
    model = train_with_reducer(settings, data, comm, report)
    report(f"test_accuracy={accuracy(model, data[2].to(settings.dtype), data[3]):.4f}")
    if args.check_ddp:
        reference = train_with_ddp(settings, data, comm)
        diff = max_difference(model, reference, comm)
        report(f"max_difference_vs_ddp={diff:.3e} tolerance={DDP_TOLERANCE:.0e}")
        if not diff <= DDP_TOLERANCE:
            report("FAILED: the reducer and DDP disagree")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
