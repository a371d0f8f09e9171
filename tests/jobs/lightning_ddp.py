"""Lightning's ``Trainer`` with DDP over the ``mpi_gradreducer`` backend, started by ``mpiexec``.

Run as a whole MPI job (Lightning installed)::

    mpiexec -n 2 python tests/jobs/lightning_ddp.py

Lightning's ``MPIEnvironment`` takes the ranks from MPI and sets the
``env://`` variables; ``DDPStrategy(process_group_backend="mpi_gradreducer")``
makes the process group over this package's backend. Every rank trains on its
own shard of a small regression set and prints the sum of its final weights;
they must agree.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy
from mpi4py import MPI

import mpi_gradreducer.torch  # noqa: F401 (registers the backend)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=16)  # Lightning gives each rank its shard
    hosts = len(set(MPI.COMM_WORLD.allgather(MPI.Get_processor_name())))
    trainer = L.Trainer(accelerator="cpu", devices=MPI.COMM_WORLD.Get_size() // hosts, num_nodes=hosts,
                        strategy=DDPStrategy(process_group_backend="mpi_gradreducer",
                                             cluster_environment=MPIEnvironment()),
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Regression()
    trainer.fit(model, loader)
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {trainer.global_rank}: backend {torch.distributed.get_backend()} weights {total:.12f}", flush=True)


if __name__ == "__main__":
    main()
