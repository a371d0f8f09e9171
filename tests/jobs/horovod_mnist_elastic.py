"""Horovod's ``examples/elastic/pytorch/pytorch_mnist_elastic.py`` (v0.28.1), as its users run it, on this package.

Its structure is kept line for line where it matters to elastic training:
``hvd.init()``, then ``DistributedSampler(num_replicas=hvd.size(),
rank=hvd.rank())`` made once at the top, the learning rate scaled by
``hvd.size()``, ``hvd.DistributedOptimizer``, a ``TorchState`` committed
every batch, ``steps_remaining = len(train_loader) - state.batch``, a reset
callback that rescales the learning rate, and ``metric_average`` through
``hvd.allreduce`` at the end. The samplers are fixed at the top, so every
rank, a replacement too, must see the full world's size there: else a
replacement's epoch has more batches than the others' and the ranks part.

Changed: the import; MNIST and its convolutional net (nothing may be
downloaded) are scikit-learn's digits and a small perceptron; CUDA, Adasum
and fp16 are left out; ``--out DIR``: each process writes ``DIR/pid.R``
(``pid.new.PID`` for a replacement), ``init size N rank R local_rank L
local_size S``, ``reset ...`` (the same) and ``epoch E size N`` lines to ``DIR/log.PID`` and its parameters to
``DIR/final.PID.npy``.
"""

# ruff: noqa: B020, UP032  (Horovod's example as it is: the state as the loop counter, str.format)

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import mpi_gradreducer.horovod as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from digits_model import load_data  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch digits example, Horovod's elastic MNIST example")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--test-batch-size", type=int, default=100)
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=20)
parser.add_argument("--out", default="")
args = parser.parse_args()

# Horovod: initialize library.
hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)
out = Path(args.out) if args.out else None


def log(line: str) -> None:
    if out is not None:
        with open(out / f"log.{os.getpid()}", "a") as f:
            f.write(line + "\n")


if out is not None:
    from mpi4py import MPI

    new = MPI.Comm.Get_parent() != MPI.COMM_NULL
    (out / (f"pid.new.{os.getpid()}" if new else f"pid.{hvd.rank()}")).write_text(str(os.getpid()))
log(f"init size {hvd.size()} rank {hvd.rank()} local_rank {hvd.local_rank()} local_size {hvd.local_size()}")

data = load_data()
train_dataset = torch.utils.data.TensorDataset(torch.tensor(data.x_train, dtype=torch.float32),
                                               torch.tensor(data.y_train))
# Horovod: use DistributedSampler to partition the training data.
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

test_dataset = torch.utils.data.TensorDataset(torch.tensor(data.x_test, dtype=torch.float32),
                                              torch.tensor(data.y_test))
# Horovod: use DistributedSampler to partition the test data.
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10), nn.LogSoftmax(dim=1))

# Horovod: scale learning rate by the number of GPUs.
lr_scaler = hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


@hvd.elastic.run
def train(state):
    # post synchronization event (worker added, worker removed) init ...
    for state.epoch in range(state.epoch, args.epochs + 1):
        log(f"epoch {state.epoch} size {hvd.size()} rank {hvd.rank()}")
        state.model.train()

        train_sampler.set_epoch(state.epoch)
        steps_remaining = len(train_loader) - state.batch

        for state.batch, (data, target) in enumerate(train_loader):
            if state.batch >= steps_remaining:
                break

            state.optimizer.zero_grad()
            output = state.model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            state.optimizer.step()
            if state.batch % args.log_interval == 0 and hvd.rank() == 0:
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                    state.epoch, state.batch * len(data), len(train_sampler),
                    100.0 * state.batch / len(train_loader), loss.item()), flush=True)
            state.commit()
        state.batch = 0


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    for data, target in test_loader:
        output = model(data)
        # sum up batch loss
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        # get the index of the max log-probability
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()

    # Horovod: use test_sampler to determine the number of examples in
    # this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, 'avg_loss')
    test_accuracy = metric_average(test_accuracy, 'avg_accuracy')

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print('\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}% ranks {}\n'.format(
            test_loss, 100. * test_accuracy, hvd.size()), flush=True)


# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


# adjust learning rate on reset
def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group['lr'] = args.lr * hvd.size()
    log(f"reset size {hvd.size()} rank {hvd.rank()} local_rank {hvd.local_rank()} local_size {hvd.local_size()}")


state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
test()
if out is not None:
    np.save(out / f"final.{os.getpid()}.npy", torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
