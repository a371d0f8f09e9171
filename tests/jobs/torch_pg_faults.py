"""DDP over the ``mpi_gradreducer`` backend, with one rank that raises, stalls or is killed.

Used by ``tests/test_torch_distributed.py``; runs as a whole MPI job::

    mpiexec -n 3 python tests/jobs/torch_pg_faults.py --fault stall --rank 2 --step 3 --timeout 2

Every rank trains a small model with DDP for ``--steps`` steps; with
``--fault`` rank ``--rank`` raises, sleeps ``--sleep`` seconds or kills
itself with SIGKILL before the backward pass of step ``--step``. A rank
that completes every step prints ``rank R: finished``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import mpi_gradreducer.torch  # noqa: F401 (registers the backend)
from mpi_gradreducer import Options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fault", choices=["none", "raise", "stall", "kill"], default="none")
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=300.0)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("mpi_gradreducer", init_method="mpi://",
                            pg_options=Options(timeout=args.timeout, stall_warning=None))
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        x = torch.randn(4, 8)
        opt.zero_grad()
        loss = ddp(x).square().mean()
        if rank == args.rank and step == args.step:
            print(f"rank {rank}: {args.fault} at step {step}", flush=True)
            if args.fault == "raise":
                raise RuntimeError(f"injected failure on rank {rank} at step {step}")
            if args.fault == "stall":
                time.sleep(args.sleep)
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
    print(f"rank {rank}: finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
