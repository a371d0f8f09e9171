"""DDP over the ``mpi_gradreducer`` backend that survives a lost rank (Open MPI with ULFM).

Used by ``tests/test_torch_distributed.py``; runs as a whole MPI job::

    mpiexec --with-ft ulfm -n 4 python tests/jobs/elastic_ddp.py --out DIR

Every rank writes its pid to ``DIR/pid.R`` and a line per step to
``DIR/log.R``; after a rank is killed, the survivors' default process group
is made again over the shrunk communicator (``ElasticGroup``), DDP is made
again by the reset callback, the parameters go back to the last commit, and
training goes on. Each survivor saves its final parameters to
``DIR/final.R.npy``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel

from mpi_gradreducer import elastic
from mpi_gradreducer.torch.distributed import ElasticGroup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pace", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out, me = Path(args.out), MPI.COMM_WORLD.Get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    state = elastic.ArrayState([p.detach().numpy() for p in model.parameters()], step=0)  # views: committed in place
    ElasticGroup(state)
    trainer: dict[str, object] = {}

    def make_ddp() -> None:
        ddp = DistributedDataParallel(model)
        trainer["ddp"], trainer["opt"] = ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)

    make_ddp()
    state.register_reset_callbacks([make_ddp])
    (out / f"pid.{me}").write_text(str(os.getpid()))

    @elastic.run(failure=ElasticGroup.failed)
    def train(state: elastic.ArrayState) -> None:
        while state.step < args.steps:
            ddp, opt = trainer["ddp"], trainer["opt"]
            assert isinstance(ddp, DistributedDataParallel) and isinstance(opt, torch.optim.SGD)
            g = torch.Generator().manual_seed(1000 * state.step + state.rank)
            x = torch.randn(8, 8, generator=g, dtype=torch.float64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin()).backward()
            opt.step()
            state.step += 1
            state.commit()
            with open(out / f"log.{me}", "a") as log:
                log.write(f"step {state.step} size {state.size} backend {dist.get_backend()}\n")
            time.sleep(args.pace)

    train(state)
    np.save(out / f"final.{me}.npy", np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
