"""Horovod's PyTorch MNIST example, on scikit-learn's digits, with only the import changed.

Written as Horovod's ``examples/pytorch/pytorch_mnist.py`` is (``hvd.init()``,
a ``DistributedSampler`` per rank, the learning rate scaled by
``hvd.size()``, ``broadcast_parameters``, ``broadcast_optimizer_state``,
``DistributedOptimizer`` with ``named_parameters``, metrics averaged with
``hvd.allreduce``), on the 8x8 digits that ship with scikit-learn (nothing is
downloaded)::

    mpiexec -n 4 python -m mpi4py scripts/train_horovod.py
    mpiexec -n 4 python -m mpi4py scripts/train_horovod.py --fp16-allreduce --backward-passes-per-step 2

``--compare-ddp`` trains the same float64 model three times (``plain``,
``passes2``: ``backward_passes_per_step=2``, ``predivide2``:
``gradient_predivide_factor=2``), each once with ``hvd.DistributedOptimizer``
and once with ``torch.nn.parallel.DistributedDataParallel`` over gloo on the
same batches, and prints on rank 0, per case::

    case=NAME max_difference=D accuracy=A ddp_accuracy=B final_difference=F

``D``: the largest parameter difference between the two runs, over all
ranks, after ``--steps`` steps; ``A``, ``B``: test accuracy after
``--epochs`` epochs; ``F``: the difference at the end.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from torch import nn

import mpi_gradreducer.horovod as hvd  # was: import horovod.torch as hvd

CASES: dict[str, dict[str, Any]] = {"plain": {}, "passes2": {"backward_passes_per_step": 2},
                                    "predivide2": {"gradient_predivide_factor": 2.0}}


class Net(nn.Module):
    """A small MLP for the 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def datasets(dtype: torch.dtype) -> tuple[Any, Any]:
    """The digits, split 75/25 with a fixed permutation and standardised."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    cut = len(x) * 3 // 4
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    x = (x - mean) / std
    tensors = [torch.tensor(a, dtype=dtype) for a in (x[:cut], x[cut:])]
    labels = [torch.tensor(a, dtype=torch.long) for a in (y[:cut], y[cut:])]
    return (torch.utils.data.TensorDataset(tensors[0], labels[0]),
            torch.utils.data.TensorDataset(tensors[1], labels[1]))


def metric_average(val: float, name: str) -> float:
    """The mean of ``val`` over the ranks (Horovod's example's helper)."""
    avg_tensor = hvd.allreduce(torch.tensor(val, dtype=torch.float64), name=name)
    return avg_tensor.item()


def test(model: nn.Module, test_dataset: Any, args: argparse.Namespace) -> float:
    """Test accuracy, each rank on its share of the test set, averaged over the ranks."""
    sampler: Any = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank(), shuffle=False)
    loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=sampler)
    model.eval()
    correct = 0.0
    with torch.no_grad():
        for data, target in loader:
            correct += model(data).argmax(dim=1).eq(target).sum().item()
    model.train()
    return metric_average(correct / len(sampler), "avg_accuracy")


def run_steps(model: nn.Module, optimizer: Any, train_dataset: Any, args: argparse.Namespace, passes: int,
              no_sync: Any = None, on_step: Any = None) -> None:
    """Train for ``args.epochs`` epochs; each batch in ``passes`` backward passes (the loss divided by it)."""
    sampler: Any = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank(), seed=args.seed)
    loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size * passes, sampler=sampler,
                                         drop_last=True)
    step = 0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            chunks = list(zip(data.chunk(passes), target.chunk(passes), strict=True))
            for i, (sub_data, sub_target) in enumerate(chunks):
                loss = F.nll_loss(model(sub_data), sub_target) / len(chunks)
                if no_sync is not None and i < len(chunks) - 1:
                    with no_sync():
                        loss.backward()
                else:
                    loss.backward()
            optimizer.step()
            step += 1
            if on_step is not None:
                on_step(step, model)
            if args.log_interval and batch_idx % args.log_interval == 0 and hvd.rank() == 0 and not args.compare_ddp:
                print(f"epoch={epoch} batch={batch_idx} loss={loss.item() * len(chunks):.4f}", flush=True)


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed + hvd.rank())  # a different start per rank: broadcast_parameters must fix it
    return Net().to(args.dtype)


def train_horovod(args: argparse.Namespace, train_dataset: Any, options: dict[str, Any],
                  on_step: Any = None) -> tuple[nn.Module, Any]:
    """Horovod's recipe."""
    model = make_model(args)
    lr_scaler = hvd.size()
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         **options)
    run_steps(model, optimizer, train_dataset, args, options.get("backward_passes_per_step", 1), on_step=on_step)
    return model, optimizer


def train_ddp(args: argparse.Namespace, train_dataset: Any, passes: int, on_step: Any) -> nn.Module:
    """The same training with torch's DistributedDataParallel over gloo."""
    import torch.distributed as dist

    model = make_model(args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    run_steps(ddp, optimizer, train_dataset, args, passes, no_sync=ddp.no_sync, on_step=on_step)
    dist.barrier()  # gloo's worker thread must be idle before DDP is dropped (see scripts/train_torch.py)
    time.sleep(0.2)
    del ddp, optimizer
    return model


def _snapshot(args: argparse.Namespace, snapshots: dict[str, list[torch.Tensor]], key: str) -> Any:
    """A callback that keeps the parameters after ``args.steps`` steps."""
    def keep(step: int, model: nn.Module) -> None:
        if step == args.steps:
            snapshots[key] = [p.detach().clone() for p in model.parameters()]

    return keep


def compare_ddp(args: argparse.Namespace, train_dataset: Any, test_dataset: Any) -> None:
    """Each case with hvd and with DDP; their parameters after ``args.steps`` steps and their accuracies."""
    import socket

    import torch.distributed as dist

    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())
    try:
        for case, options in CASES.items():
            snapshots: dict[str, list[torch.Tensor]] = {}
            ours, optimizer = train_horovod(args, train_dataset, options, on_step=_snapshot(args, snapshots, "ours"))
            accuracy = test(ours, test_dataset, args)
            optimizer.free()
            reference = train_ddp(args, train_dataset, options.get("backward_passes_per_step", 1),
                                  on_step=_snapshot(args, snapshots, "ddp"))
            ddp_accuracy = test(reference, test_dataset, args)

            def difference(a: Any, b: Any) -> float:
                local = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a, b, strict=True))
                return float(hvd.allreduce(torch.tensor(local), op=hvd.Max))

            at_steps = difference(snapshots["ours"], snapshots["ddp"])
            final = difference(ours.parameters(), reference.parameters())
            if hvd.rank() == 0:
                print(f"case={case} max_difference={at_steps:.3e} accuracy={accuracy:.4f} "
                      f"ddp_accuracy={ddp_accuracy:.4f} final_difference={final:.3e}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="Horovod's PyTorch MNIST example, on the digits")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size per rank")
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (scaled by hvd.size())")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--use-adasum", action="store_true", default=False)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    parser.add_argument("--backward-passes-per-step", type=int, default=1)
    parser.add_argument("--float64", action="store_true", help="train in float64")
    parser.add_argument("--compare-ddp", action="store_true", help="hold each case against DDP over gloo (float64)")
    parser.add_argument("--steps", type=int, default=20, help="--compare-ddp: compare the parameters after these")
    args = parser.parse_args()
    args.dtype = torch.float64 if args.float64 or args.compare_ddp else torch.float32

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = datasets(args.dtype)
    if args.compare_ddp:
        compare_ddp(args, train_dataset, test_dataset)
        return
    options = {"gradient_predivide_factor": args.gradient_predivide_factor,
               "backward_passes_per_step": args.backward_passes_per_step}
    model, _ = train_horovod(args, train_dataset, options)
    accuracy = test(model, test_dataset, args)
    if hvd.rank() == 0:
        print(f"ranks={hvd.size()} epochs={args.epochs} test_accuracy={accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
