"""Data-parallel training of a small numpy MLP on scikit-learn's digits.

Every rank takes its own share of each global batch; the initial weights come
from rank 0 through ``broadcast_parameters`` and the gradients are averaged
with ``DistributedGradReducer``, so every rank takes the same step::

    mpiexec -n 4 python scripts/train_digits.py
    mpiexec -n 4 python scripts/train_digits.py --overlap --plot curves.png --timeline trace.json
    mpiexec -n 4 python scripts/train_digits.py --powersgd 1   # also with PowerSGD(rank=1): curves side by side

It reads top to bottom: data, model, reducer, training loop, report. The
data set and the model (a 64-128-10 perceptron, backward by hand) are in
``digits_model.py``, the progress bar and the curves in ``digits_report.py``;
``check_training.py`` checks that this training equals one process's, also
with a sharded optimizer and with uneven data. Needs the ``examples`` extra
(scikit-learn, tqdm, matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from digits_model import Data, Momentum, accuracy, forward_backward, init_params, load_data  # in scripts/
from digits_report import plot, progress_bar
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer, PowerSGD, broadcast_parameters
from mpi_gradreducer._core.timeline import Timeline

# -- data: each rank's share of every global batch -----------------------------------------


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The epoch's global batches of sample indices (same on every rank); a short last batch is dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def my_share(batch: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This rank's contiguous share of a global batch (sizes differ by at most one)."""
    return np.array_split(batch, size)[rank]


# -- reducer: one training step ----------------------------------------------------------


class Trainer:
    """One data-parallel step over the ranks of ``comm``: compute, reduce, update.

    The loss travels with the gradients, as one more entry of the reducer's
    fused message: no extra Allreduce. Each rank scales its sum by ``ranks /
    global batch``, so the reducer's mean over the ranks is exactly the mean
    over the global batch, whatever the shares' sizes. With ``overlap``, each
    layer's gradients start reducing as soon as backward has written them.
    """

    def __init__(self, comm: MPI.Intracomm, params: list[np.ndarray], lr: float, momentum: float,
                 overlap: bool = False, powersgd: int = 0) -> None:
        self.comm = comm
        self.params = params
        self.overlap = overlap
        self.optimizer = Momentum(params, lr, momentum)
        slots = params + [np.zeros(1, params[0].dtype)]  # the gradients, then the loss
        low_rank = PowerSGD(rank=powersgd, start_iter=POWERSGD_START) if powersgd else None  # 0: uncompressed
        self.reducer = DistributedGradReducer(slots, group=comm, compression=low_rank)
        self.grads = self.reducer.allocate_grads()  # views into the fusion buffer: reduced where they lie
        self._step: Any = None

    def compute(self, x: np.ndarray, y: np.ndarray, batch: int) -> None:
        """This rank's share of the gradient of the mean loss over a global batch of ``batch`` rows."""
        ready = None
        if self.overlap:
            self._step = self.reducer.begin(self.grads)
            ready = self._step.ready
        x = x.astype(self.params[0].dtype, copy=False)
        scale = self.comm.Get_size() / batch
        self.grads[-1][0] = forward_backward(self.params, x, y, scale, self.grads[:-1], ready)
        if ready is not None:
            ready(len(self.grads) - 1)  # the loss

    def reduce(self) -> None:
        """Average the gradients (and the loss) over the ranks, in place."""
        if self._step is not None:
            self._step.wait()
            self._step = None
        else:
            self.reducer(self.grads)

    def update(self) -> float:
        """Apply the averaged gradients; returns the global batch's mean loss."""
        self.optimizer.step(self.grads[:-1])
        return float(self.grads[-1][0])

    def step(self, x: np.ndarray, y: np.ndarray, batch: int) -> float:
        """compute, reduce and update; returns the global batch's mean loss."""
        self.compute(x, y, batch)
        self.reduce()
        return self.update()

    def free(self) -> None:
        """Release the reducer (collective)."""
        self.reducer.free()


# -- training loop ------------------------------------------------------------------------

#: With ``--powersgd``, the steps before this one are reduced uncompressed.
POWERSGD_START = 10


@dataclass
class Settings:
    """Hyper-parameters, the same on every rank; the global batch is shared by the ranks."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 128
    seed: int = 0
    overlap: bool = False
    dtype: Any = np.float32
    powersgd: int = 0  # the rank of PowerSGD's approximation; 0: uncompressed


@dataclass
class Result:
    """What a run measured; seconds are summed over the steps, mean over the ranks."""

    losses: list[float] = field(default_factory=list)  # mean loss of each global batch
    accuracies: list[float] = field(default_factory=list)  # test accuracy after each epoch
    seconds: float = 0.0  # wall time of the loop, on this rank
    compute_seconds: float = 0.0  # forward, backward and update
    reduce_seconds: float = 0.0  # the reducer calls
    moving: dict[str, float] = field(default_factory=dict)  # reducer.stats: pack, Allreduce, unpack seconds
    reduced_bytes: int = 0  # handed to MPI per step
    last_step_bytes: int = 0  # handed to MPI by the last step (with PowerSGD: a compressed one)
    messages: int = 0  # Allreduce messages per step (the reducer's buckets)

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return len(self.losses)


def train(comm: MPI.Intracomm, data: Data, settings: Settings, progress: bool = False,
          timeline: Timeline | None = None) -> Result:
    """Train over ``comm`` (collective), evaluating after every epoch.

    ``progress`` shows a tqdm bar (give True on one rank only); ``timeline``
    records each step's phases.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    params = init_params(data.x_train.shape[1], settings.hidden, 10, settings.seed + rank, settings.dtype)
    broadcast_parameters(params, root=0, group=comm)  # each rank drew different weights: rank 0's win
    trainer = Trainer(comm, params, settings.lr, settings.momentum, settings.overlap, settings.powersgd)
    x_train = data.x_train.astype(settings.dtype)
    epochs = [global_batches(len(x_train), settings.batch_size, settings.seed, e) for e in range(settings.epochs)]
    bar = progress_bar(sum(len(b) for b in epochs)) if progress else None
    result = Result()
    shown: dict[str, Any] = {}  # what the bar shows after each step
    start = time.perf_counter()
    for epoch, batches in enumerate(epochs):
        for batch in batches:
            mine = my_share(batch, rank, size)
            t0 = time.perf_counter()
            trainer.compute(x_train[mine], data.y_train[mine], len(batch))
            t1 = time.perf_counter()
            sent = trainer.reducer.stats.bytes
            trainer.reduce()
            t2 = time.perf_counter()
            result.last_step_bytes = trainer.reducer.stats.bytes - sent
            loss = trainer.update()
            t3 = time.perf_counter()
            result.compute_seconds += (t1 - t0) + (t3 - t2)
            result.reduce_seconds += t2 - t1
            result.losses.append(loss)
            if timeline is not None:
                timeline.record("forward/backward", t0, t1, step=result.steps - 1, rows=len(mine))
                timeline.record("reduce", t1, t2, step=result.steps - 1)
                timeline.record("update", t2, t3, step=result.steps - 1)
            if bar is not None:
                shown.update(epoch=epoch + 1, loss=f"{loss:.4f}")
                bar.set_postfix(shown, refresh=False)
                bar.update(1)
        result.accuracies.append(accuracy(params, data.x_test, data.y_test))
        if bar is not None:
            shown["test_acc"] = f"{result.accuracies[-1]:.3f}"
            bar.set_postfix(shown)
    result.seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    stats = trainer.reducer.stats
    result.reduced_bytes = stats.bytes // max(1, stats.calls)
    result.messages = len(trainer.reducer.buckets)
    seconds = np.array([result.compute_seconds, result.reduce_seconds,
                        stats.pack_seconds, stats.allreduce_seconds, stats.unpack_seconds])
    comm.Allreduce(MPI.IN_PLACE, seconds, op=MPI.SUM)
    result.compute_seconds, result.reduce_seconds, *moving = (float(s) / size for s in seconds)
    result.moving = dict(zip(("pack", "Allreduce", "unpack"), moving, strict=True))
    trainer.free()
    return result


# -- command line and report -------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    """The command line; each option has the default of its :class:`Settings` field."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=Settings.epochs)
    p.add_argument("--batch-size", type=int, default=Settings.batch_size, help="global batch, shared by the ranks")
    p.add_argument("--lr", type=float, default=Settings.lr)
    p.add_argument("--momentum", type=float, default=Settings.momentum)
    p.add_argument("--seed", type=int, default=Settings.seed, help="split, weights and batch order")
    p.add_argument("--overlap", action="store_true",
                   help="start reducing each layer's gradients during backward (begin/ready/wait)")
    p.add_argument("--plot", metavar="PNG", help="write loss and accuracy curves")
    p.add_argument("--timeline", metavar="JSON", help="write a Chrome trace of every rank's phases")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--powersgd", type=int, default=0, metavar="RANK",
                   help=f"then train again with PowerSGD(rank=RANK, start_iter={POWERSGD_START}) and compare")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Train and report (collective over ``MPI.COMM_WORLD``); rank 0 prints. Returns the exit status."""
    parser = make_parser()
    args = parser.parse_args(argv)
    data = load_data(args.seed)
    if not 1 <= args.batch_size <= len(data.x_train) or args.epochs < 1:
        parser.error(f"--epochs: at least 1, --batch-size: 1 to {len(data.x_train)} (the training set)")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    settings = Settings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                        seed=args.seed, overlap=args.overlap)
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    say(f"digits: {len(data.x_train)} training and {len(data.x_test)} test images; {size} rank(s), "
        f"global batch {settings.batch_size} (~{settings.batch_size / size:g} per rank), {settings.epochs} epochs")
    timeline = Timeline(comm, args.timeline) if args.timeline else None
    result = train(comm, data, settings, progress=rank == 0 and not args.no_progress, timeline=timeline)
    if timeline is not None:
        timeline.close()
    ms = 1e3 / result.steps
    say(f"test accuracy: {result.accuracies[-1]:.4f} (after {settings.epochs} epochs, {result.steps} steps, "
        f"{result.seconds:.2f} s)")
    say(f"time per step: {(result.compute_seconds + result.reduce_seconds) * ms:.3f} ms = "
        f"compute {result.compute_seconds * ms:.3f} ms + reduction {result.reduce_seconds * ms:.3f} ms "
        f"(mean over ranks)")
    moving = sum(result.moving.values())
    say(f"  reduction: {moving * ms:.3f} ms moving data (reducer.stats: "
        + ", ".join(f"{name} {s * ms:.3f}" for name, s in result.moving.items())
        + f" ms), {(result.reduce_seconds - moving) * ms:.3f} ms in the rest of the call (checks, Python steps)")
    say(f"  {result.reduced_bytes} bytes per step in {result.messages} fused message(s)")
    if args.plot and rank == 0:
        plot(result, len(global_batches(len(data.x_train), settings.batch_size, settings.seed, 0)), args.plot, size)
        say(f"curves: {args.plot}")
    if timeline is not None:
        say(f"timeline: {args.timeline} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.powersgd > 0:
        low = train(comm, data, replace(settings, powersgd=args.powersgd), progress=rank == 0 and not args.no_progress)
        say(f"PowerSGD(rank={args.powersgd}, start_iter={POWERSGD_START}): test accuracy {low.accuracies[-1]:.4f}; "
            f"{low.last_step_bytes} bytes per compressed step against {result.last_step_bytes} "
            f"(1/{result.last_step_bytes / max(1, low.last_step_bytes):.1f}; reducer.stats.bytes)")
        say("test accuracy by epoch, uncompressed / PowerSGD: "
            + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(result.accuracies, low.accuracies, strict=True)))
        say("training loss by epoch, uncompressed / PowerSGD: " + ", ".join(
            f"{np.mean(a):.3f}/{np.mean(b):.3f}" for a, b in zip(*(np.array_split(r.losses, settings.epochs)
                                                                   for r in (result, low)), strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
