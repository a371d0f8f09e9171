"""Elastic torch training in Horovod's style: the digits perceptron, surviving lost ranks.

Written as Horovod's elastic examples are (``hvd.elastic.run``,
``TorchState``, ``ElasticSampler``, a reset callback that rescales the
learning rate), on ``mpi_gradreducer.horovod``. Run it under Open MPI 5
with fault tolerance, and kill a rank while it trains::

    mpiexec --with-ft ulfm -n 4 python scripts/elastic_digits.py --epochs 8

``scripts/elastic_demo.sh`` does that and compares the accuracy with a run
that lost nothing. With ``--out DIR`` each process writes ``DIR/pid.R``
(``pid.new.PID`` for a replacement), appends ``epoch E size N`` lines to
``DIR/log.PID`` and, at the end, its parameters to ``DIR/final.PID.npy``.
Rank 0 prints the test accuracy at the end: ``accuracy 0.9644``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

import mpi_gradreducer.horovod as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_model import load_data  # noqa: E402 (the script's own folder)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=16, help="per rank")
parser.add_argument("--lr", type=float, default=0.02, help="per rank: scaled by the number of ranks")
parser.add_argument("--batches-per-commit", type=int, default=1)
parser.add_argument("--out", default="")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
out = Path(args.out) if args.out else None
from mpi4py import MPI  # noqa: E402 (initialised by the import of the package above)

if out is not None:
    replacement = MPI.Comm.Get_parent() != MPI.COMM_NULL
    (out / (f"pid.new.{os.getpid()}" if replacement else f"pid.{hvd.rank()}")).write_text(str(os.getpid()))

data = load_data()
train_set = torch.utils.data.TensorDataset(torch.tensor(data.x_train, dtype=torch.float32),
                                           torch.tensor(data.y_train))
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), deterministic=True)
sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)


def log(line: str) -> None:
    if out is not None:
        with open(out / f"log.{os.getpid()}", "a") as f:
            f.write(line + "\n")


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 (Horovod's idiom: the state is the counter)
        log(f"epoch {state.epoch} size {hvd.size()} rank {hvd.rank()}")
        for state.batch, (x, y) in enumerate(loader, start=state.batch):  # noqa: B020
            state.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(state.model(x), y)
            loss.backward()
            state.optimizer.step()
            sampler.record_batch(state.batch, args.batch_size)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.batch = 0
        sampler.set_epoch(state.epoch + 1)
        state.commit()


def on_state_reset() -> None:
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()  # the same total batch per rank: a larger or smaller step
    log(f"reset size {hvd.size()} rank {hvd.rank()}")


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)

with torch.no_grad():
    predicted = model(torch.tensor(data.x_test, dtype=torch.float32)).argmax(dim=1).numpy()
accuracy = float(np.mean(predicted == data.y_test))
if out is not None:
    np.save(out / f"final.{os.getpid()}.npy", torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
if hvd.rank() == 0:
    print(f"accuracy {accuracy:.4f} ranks {hvd.size()}", flush=True)
optimizer.free()
