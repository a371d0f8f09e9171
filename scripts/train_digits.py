"""Data-parallel training of a small numpy MLP on scikit-learn's digits.

A 64-128-10 perceptron (ReLU, softmax cross-entropy, SGD with momentum),
forward and backward written out in numpy. Every rank takes its own share of
each global batch; the initial weights come from rank 0 through
``broadcast_parameters`` and the gradients are averaged with
``DistributedGradReducer``, so every rank takes the same step::

    mpiexec -n 4 python scripts/train_digits.py
    mpiexec -n 4 python scripts/train_digits.py --plot curves.png --timeline trace.json
    mpiexec -n 4 python scripts/train_digits.py --check-equivalence
    mpiexec -n 4 python scripts/train_digits.py --shard --uneven

``--check-equivalence`` trains in float64 for a few steps twice: with the
ranks sharing every batch, and alone on the whole batch (each rank computes
the latter by itself, without communication); the parameters must agree to
1e-10. ``--shard`` does the same for a sharded optimizer (``reduce_scatter``,
momentum for this rank's pieces only, ``allgather``) against the unsharded one;
``--uneven`` gives the ranks different numbers of batches and ends the epoch
with ``join()``, against one process. Needs the ``examples`` extra (scikit-learn, tqdm, matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer, broadcast_parameters
from mpi_gradreducer.timeline import Timeline

#: Agreement required between data-parallel and single-process training (float64).
EQUIVALENCE_TOLERANCE = 1e-10


class Data(NamedTuple):
    """A fixed train/test split: standardised features, integer labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class Settings:
    """Hyper-parameters; the global batch is shared by the ranks."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 128
    seed: int = 0
    overlap: bool = False
    dtype: Any = np.float32


@dataclass
class Result:
    """What a training run measured (identical on every rank unless noted).

    Attributes:
        losses: mean loss of each global batch, one per step.
        accuracies: test accuracy after each epoch.
        steps: optimizer steps taken.
        seconds: wall time of the training loop on this rank.
        compute_seconds: forward, backward and update, summed over steps, mean over ranks.
        reduce_seconds: time in the reducer call, summed over steps, mean over ranks.
        allreduce_seconds, pack_seconds, unpack_seconds: the reducer's own
            counters (``reducer.stats``), mean over ranks.
        reduced_bytes: bytes handed to MPI per step.
        messages: Allreduce messages per step (the reducer's buckets).
    """

    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    compute_seconds: float = 0.0
    reduce_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    pack_seconds: float = 0.0
    unpack_seconds: float = 0.0
    reduced_bytes: int = 0
    messages: int = 0


# -- data and model ----------------------------------------------------------------------


def load_data(seed: int = 0, test_fraction: float = 0.25) -> Data:
    """scikit-learn's 8x8 digits (shipped with the package), split with a fixed seed.

    Pixels are standardised with the training set's mean and deviation.

    Args:
        seed: the split's random state.
        test_fraction: share of the 1797 images held out for testing.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(x_train)
    return Data(scaler.transform(x_train), y_train.astype(np.int64),
                scaler.transform(x_test), y_test.astype(np.int64))


def init_params(n_in: int, n_hidden: int, n_out: int, seed: int, dtype: Any) -> list[np.ndarray]:
    """He-initialised weights and zero biases: ``[w1, b1, w2, b2]``."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)
    w2 = rng.standard_normal((n_hidden, n_out)) * np.sqrt(1.0 / n_hidden)
    return [a.astype(dtype) for a in (w1, np.zeros(n_hidden), w2, np.zeros(n_out))]


def logits(params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The network's output before the softmax."""
    w1, b1, w2, b2 = params
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def accuracy(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Share of ``x`` classified as ``y``."""
    return float(np.mean(np.argmax(logits(params, x.astype(params[0].dtype)), axis=1) == y))


def forward_backward(
    params: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    scale: float,
    grads: Sequence[np.ndarray],
    ready: Callable[[int], None] | None = None,
) -> float:
    """``scale`` times the summed cross-entropy of the rows of ``x``, and its gradient.

    Args:
        params: ``[w1, b1, w2, b2]``.
        x: a batch of inputs (rows), in the parameters' dtype.
        y: their labels.
        scale: factor on the summed loss (``1 / batch`` gives the batch mean).
        grads: arrays shaped like ``params``; the gradient is written into them.
        ready: called with ``i`` as soon as ``grads[i]`` is final (backward
            order: the last layer first), e.g. ``step.ready`` of an overlapped
            reduction.

    Returns:
        The scaled loss.
    """
    w1, b1, w2, b2 = params
    g_w1, g_b1, g_w2, g_b2 = grads
    rows = np.arange(x.shape[0])
    pre = x @ w1 + b1
    hidden = np.maximum(pre, 0)
    z = hidden @ w2 + b2
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    total = e.sum(axis=1, keepdims=True)
    loss = float(np.sum(np.log(total[:, 0]) - z[rows, y])) * scale
    d_z = e / total  # softmax
    d_z[rows, y] -= 1
    d_z *= scale
    np.matmul(hidden.T, d_z, out=g_w2)
    np.sum(d_z, axis=0, out=g_b2)
    if ready is not None:
        ready(3)
        ready(2)
    d_pre = d_z @ w2.T
    d_pre[pre <= 0] = 0
    np.matmul(x.T, d_pre, out=g_w1)
    np.sum(d_pre, axis=0, out=g_b1)
    if ready is not None:
        ready(1)
        ready(0)
    return loss


class Momentum:
    """SGD with momentum: ``v = momentum * v + g; p -= lr * v``."""

    def __init__(self, params: Sequence[np.ndarray], lr: float, momentum: float) -> None:
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.velocity = [np.zeros_like(p) for p in params]

    def step(self, grads: Sequence[np.ndarray]) -> None:
        """Apply one update in place."""
        for p, v, g in zip(self.params, self.velocity, grads, strict=True):
            v *= self.momentum
            v += g
            p -= self.lr * v


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The epoch's global batches of sample indices (same on every rank); a short last batch is dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def my_share(batch: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This rank's contiguous share of a global batch (sizes differ by at most one)."""
    return np.array_split(batch, size)[rank]


class Trainer:
    """One data-parallel training step over the ranks of ``comm``.

    The loss of the batch travels with the gradients, as one more entry of
    the reducer's fused message, so reporting it costs no extra Allreduce.
    Each rank scales its summed loss by ``ranks / global batch``: the
    reducer's mean over the ranks then gives exactly the mean over the
    global batch, whatever the shares' sizes.

    Args:
        comm: the ranks that share each batch; None: train alone, no MPI.
        params: ``[w1, b1, w2, b2]``, the same on every rank.
        lr: learning rate.
        momentum: momentum factor.
        overlap: reduce each gradient's bucket as soon as backward has
            produced it (``reducer.begin`` / ``step.ready`` / ``step.wait``)
            instead of after the whole backward pass.
    """

    def __init__(
        self, comm: MPI.Intracomm | None, params: list[np.ndarray], lr: float, momentum: float,
        overlap: bool = False,
    ) -> None:
        self.comm = comm
        self.overlap = overlap and comm is not None
        self._step: Any = None
        self.params = params
        self.optimizer = Momentum(params, lr, momentum)
        slots = params + [np.zeros(1, params[0].dtype)]  # the gradients, then the loss
        if comm is None:
            self.reducer = None
            self.grads = [np.zeros_like(p) for p in slots]
        else:
            self.reducer = DistributedGradReducer(slots, group=comm)
            # Views into the reducer's fusion buffer: reduced where they lie, no copy.
            self.grads = self.reducer.allocate_grads()

    @property
    def ranks(self) -> int:
        """How many ranks share a batch."""
        return 1 if self.comm is None else self.comm.Get_size()

    def compute(self, x: np.ndarray, y: np.ndarray, batch: int) -> None:
        """This rank's share of the gradient of the mean loss over a global batch of ``batch`` rows.

        With ``overlap``, each gradient's bucket starts reducing as soon as
        backward has written it.
        """
        scale = self.ranks / batch
        ready = None
        if self.overlap:
            self._step = self.reducer.begin(self.grads)
            ready = self._step.ready
        self.grads[-1][0] = forward_backward(self.params, x.astype(self.params[0].dtype, copy=False), y,
                                             scale, self.grads[:-1], ready)
        if ready is not None:
            ready(len(self.grads) - 1)  # the loss

    def reduce(self) -> None:
        """Average the gradients (and the loss) over the ranks, in place."""
        if self._step is not None:
            self._step.wait()
            self._step = None
        elif self.reducer is not None:
            self.reducer(self.grads)

    def update(self) -> float:
        """Apply the averaged gradients; returns the batch's mean loss."""
        self.optimizer.step(self.grads[:-1])
        return float(self.grads[-1][0])

    def step(self, x: np.ndarray, y: np.ndarray, batch: int) -> float:
        """compute, reduce and update; returns the global batch's mean loss."""
        self.compute(x, y, batch)
        self.reduce()
        return self.update()

    def free(self) -> None:
        """Release the reducer (collective)."""
        if self.reducer is not None:
            self.reducer.free()


# -- the two jobs -------------------------------------------------------------------------


def train(
    comm: MPI.Intracomm,
    data: Data,
    settings: Settings,
    progress: bool = False,
    timeline: Timeline | None = None,
) -> Result:
    """Train data-parallel over ``comm`` (collective) and evaluate after every epoch.

    Args:
        comm: the ranks that share every global batch.
        data: the split, the same on every rank.
        settings: hyper-parameters, the same on every rank.
        progress: show a tqdm bar with the loss (give True on one rank only).
        timeline: if given, each step's phases are recorded in it.

    Returns:
        The losses, accuracies and timings.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    # Each rank draws different weights; rank 0's reach everyone.
    params = init_params(data.x_train.shape[1], settings.hidden, 10, settings.seed + rank, settings.dtype)
    broadcast_parameters(params, root=0, group=comm)
    trainer = Trainer(comm, params, settings.lr, settings.momentum, settings.overlap)
    x_train = data.x_train.astype(settings.dtype)
    epochs = [global_batches(len(x_train), settings.batch_size, settings.seed, e) for e in range(settings.epochs)]
    bar = _progress_bar(sum(len(b) for b in epochs)) if progress else None
    result = Result()
    shown: dict[str, Any] = {}
    compute = reduce = 0.0
    start = time.perf_counter()
    for epoch, batches in enumerate(epochs):
        for batch in batches:
            mine = my_share(batch, rank, size)
            t0 = time.perf_counter()
            trainer.compute(x_train[mine], data.y_train[mine], len(batch))
            t1 = time.perf_counter()
            trainer.reduce()
            t2 = time.perf_counter()
            loss = trainer.update()
            t3 = time.perf_counter()
            compute += (t1 - t0) + (t3 - t2)
            reduce += t2 - t1
            result.losses.append(loss)
            if timeline is not None:
                step = len(result.losses) - 1
                timeline.record("forward/backward", t0, t1, step=step, rows=len(mine))
                timeline.record("reduce", t1, t2, step=step)
                timeline.record("update", t2, t3, step=step)
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
    result.steps = len(result.losses)
    result.reduced_bytes = stats.bytes // max(1, stats.calls)
    result.messages = len(trainer.reducer.buckets)
    timings = np.array([compute, reduce, stats.allreduce_seconds, stats.pack_seconds, stats.unpack_seconds])
    comm.Allreduce(MPI.IN_PLACE, timings, op=MPI.SUM)
    timings /= size
    (result.compute_seconds, result.reduce_seconds, result.allreduce_seconds,
     result.pack_seconds, result.unpack_seconds) = (float(t) for t in timings)
    trainer.free()
    return result


def check_equivalence(
    comm: MPI.Intracomm, data: Data, steps: int = 30, batch_size: int = 64, seed: int = 0,
    lr: float = 0.05, momentum: float = 0.9,
) -> float:
    """Data-parallel against single-process training, in float64 (collective).

    Every rank trains the same model twice for ``steps`` steps from the same
    weights: (a) with the ranks of ``comm`` each on its share of every global
    batch, gradients averaged by the reducer; (b) alone on the whole batch,
    with no communication.

    Args:
        comm: the ranks that share the batches in (a).
        data: the training data (its test part is not used).
        steps: optimizer steps.
        batch_size: the global batch.
        seed: weights and batch order.
        lr: learning rate.
        momentum: momentum factor.

    Returns:
        The largest absolute difference between (a) and (b) over all
        parameters and ranks (the same on every rank).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    x = data.x_train.astype(np.float64)
    params = init_params(x.shape[1], 128, 10, seed + rank, np.float64)
    broadcast_parameters(params, root=0, group=comm)
    alone = Trainer(None, [p.copy() for p in params], lr, momentum)
    shared = Trainer(comm, params, lr, momentum)
    per_epoch = len(global_batches(len(x), batch_size, seed, 0))
    epochs = -(-steps // per_epoch)
    batches = [b for e in range(epochs) for b in global_batches(len(x), batch_size, seed, e)][:steps]
    for batch in batches:
        mine = my_share(batch, rank, size)
        shared.step(x[mine], data.y_train[mine], len(batch))
        alone.step(x[batch], data.y_train[batch], len(batch))
    shared.free()
    diff = np.array([max(float(np.max(np.abs(a - b))) for a, b in zip(shared.params, alone.params, strict=True))])
    comm.Allreduce(MPI.IN_PLACE, diff, op=MPI.MAX)
    return float(diff[0])


def check_shard(
    comm: MPI.Intracomm, data: Data, steps: int = 30, batch_size: int = 64, seed: int = 0,
    lr: float = 0.05, momentum: float = 0.9,
) -> tuple[float, int, int]:
    """A sharded optimizer against the unsharded one, in float64 (collective).

    Both train the same model from the same weights on the same global batches
    (each rank on its share). The unsharded one averages with ``reducer(grads)``
    and keeps momentum for every parameter; the sharded one calls
    ``reducer.reduce_scatter(grads)``, keeps momentum only for this rank's
    pieces, updates those elements and shares them with ``shard.allgather``.

    Returns:
        The largest absolute difference between their parameters over all
        ranks, the largest optimizer state of a rank with sharding and the
        state without it, in bytes (the same on every rank).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    x = data.x_train.astype(np.float64)
    params = init_params(x.shape[1], 128, 10, seed + rank, np.float64)
    broadcast_parameters(params, root=0, group=comm)
    plain = Trainer(comm, [p.copy() for p in params], lr, momentum)
    reducer = DistributedGradReducer(params, group=comm)
    grads = reducer.allocate_grads()
    velocity: dict[tuple[int, int], np.ndarray] = {}  # (parameter, start) -> this rank's piece of momentum
    per_epoch = len(global_batches(len(x), batch_size, seed, 0))
    batches = [b for e in range(-(-steps // per_epoch)) for b in global_batches(len(x), batch_size, seed, e)][:steps]
    for batch in batches:
        mine = my_share(batch, rank, size)
        plain.step(x[mine], data.y_train[mine], len(batch))
        forward_backward(params, x[mine], data.y_train[mine], size / len(batch), grads)
        shard = reducer.reduce_scatter(grads)
        for piece in shard:
            v = velocity.setdefault((piece.index, piece.start), np.zeros_like(piece.grad))
            v *= momentum
            v += piece.grad
            params[piece.index].reshape(-1)[piece.start : piece.stop] -= lr * v
        shard.allgather(params)
    reducer.free()
    plain.free()
    out = np.array([max(float(np.max(np.abs(a - b))) for a, b in zip(plain.params, params, strict=True)),
                    sum(v.nbytes for v in velocity.values())])
    comm.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
    return float(out[0]), int(out[1]), sum(v.nbytes for v in plain.optimizer.velocity)


def uneven_counts(size: int, steps: int) -> list[int]:
    """Batches of each rank in ``--uneven``: rank r has ``steps - r`` (and at least none)."""
    return [max(0, steps - r) for r in range(size)]


def check_uneven(
    comm: MPI.Intracomm, data: Data, steps: int = 30, batch_size: int = 64, seed: int = 0,
    lr: float = 0.05, momentum: float = 0.9,
) -> tuple[float, list[int]]:
    """Ranks with different numbers of batches, ``join()`` at the end, against one process (collective).

    Rank r trains on ``uneven_counts(size, steps)[r]`` batches of its own, then
    joins; each call averages over the ranks that still have data. Every rank
    also computes the same steps alone (every contributing rank's gradient,
    averaged), without communication. After the epoch the parameters of the
    rank that trained longest are broadcast (a joined rank's stopped changing).

    Returns:
        The largest absolute difference to the single-process result over all
        ranks, and the number of contributors of each call (the same on every rank).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = uneven_counts(size, steps)
    x = data.x_train.astype(np.float64)
    params = init_params(x.shape[1], 128, 10, seed + rank, np.float64)
    broadcast_parameters(params, root=0, group=comm)
    alone = Momentum([p.copy() for p in params], lr, momentum)
    optimizer = Momentum(params, lr, momentum)
    reducer = DistributedGradReducer(params, group=comm)
    batches = global_batches(len(x), batch_size // size or 1, seed, 0)
    own = [batches[(c * size + r) % len(batches)] for c in range(steps) for r in range(size)]
    contributors = []
    for c in range(max(counts)):
        active = [r for r in range(size) if counts[r] > c]
        summed = [np.zeros_like(p) for p in params]
        for r in active:  # the single-process reference
            g = [np.zeros_like(p) for p in params]
            b = own[c * size + r]
            forward_backward(alone.params, x[b], data.y_train[b], 1 / len(b), g)
            for s, gi in zip(summed, g, strict=True):
                s += gi / len(active)
        alone.step(summed)
        if rank in active:
            grads = [np.zeros_like(p) for p in params]
            b = own[c * size + rank]
            forward_backward(params, x[b], data.y_train[b], 1 / len(b), grads)
            reducer(grads)
            contributors.append(reducer.contributors)
            optimizer.step(grads)
    reducer.join()
    reducer.free()
    broadcast_parameters(params, root=int(np.argmax(counts)), group=comm)
    diff = np.array([max(float(np.max(np.abs(a - b))) for a, b in zip(params, alone.params, strict=True))])
    comm.Allreduce(MPI.IN_PLACE, diff, op=MPI.MAX)
    return float(diff[0]), comm.bcast(contributors, root=int(np.argmax(counts)))


# -- command line -------------------------------------------------------------------------


def _progress_bar(total: int) -> Any:
    """A tqdm bar, or None when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", desc="training", dynamic_ncols=True)


def plot(result: Result, steps_per_epoch: int, path: str, ranks: int) -> None:
    """Loss per step and test accuracy per epoch, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    steps = np.arange(1, len(result.losses) + 1)
    left.plot(steps, result.losses, color="#1f77b4", lw=0.8, alpha=0.45, label="global batch")
    window = max(1, steps_per_epoch // 2)
    if len(result.losses) >= window:
        smooth = np.convolve(result.losses, np.ones(window) / window, mode="valid")
        left.plot(steps[window - 1 :], smooth, color="#1f77b4", lw=2, label=f"mean of {window} steps")
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy loss")
    left.set_title("training loss")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    epochs = np.arange(1, len(result.accuracies) + 1)
    right.plot(epochs, result.accuracies, "o-", color="#d62728", lw=2)
    right.axhline(0.95, color="gray", ls="--", lw=1, label="0.95")
    right.set_ylim(min(0.9, min(result.accuracies) - 0.01), 1.0)
    right.set_xlabel("epoch")
    right.set_ylabel("accuracy")
    right.set_title("test accuracy")
    right.grid(True, alpha=0.3)
    right.legend(loc="lower right")
    fig.suptitle(f"digits, 64-128-10 MLP, {ranks} MPI ranks sharing each batch")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (collective over ``MPI.COMM_WORLD``); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=Settings.epochs)
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size, help="global batch, shared by the ranks")
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--momentum", type=float, default=Settings.momentum)
    parser.add_argument("--seed", type=int, default=Settings.seed, help="split, weights and batch order")
    parser.add_argument("--plot", metavar="PNG", help="write loss and accuracy curves")
    parser.add_argument("--timeline", metavar="JSON", help="write a Chrome trace of every rank's phases")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--overlap", action="store_true",
                        help="start reducing each layer's gradients during backward (begin/ready/wait)")
    parser.add_argument("--check-equivalence", action="store_true",
                        help="compare data-parallel with single-process training (float64) and exit")
    parser.add_argument("--steps", type=int, default=30, help="steps of --check-equivalence, --shard, --uneven")
    parser.add_argument("--shard", action="store_true",
                        help="a sharded optimizer (reduce_scatter/allgather) against the unsharded one, and exit")
    parser.add_argument("--uneven", action="store_true",
                        help="ranks with different numbers of batches, ending with join(), and exit")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.steps < 1:
        parser.error("--epochs, --batch-size and --steps must be positive")

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    data = load_data(args.seed)
    if args.batch_size > len(data.x_train):
        parser.error(f"--batch-size: at most {len(data.x_train)} (the training set), got {args.batch_size}")

    if args.shard or args.uneven:
        ok = True
        if args.shard:
            diff, state, full = check_shard(comm, data, args.steps, args.batch_size, args.seed, args.lr,
                                            args.momentum)
            ok = ok and diff <= EQUIVALENCE_TOLERANCE
            say(f"shard: optimizer state per rank {state} bytes (max over ranks) vs {full} unsharded = 1/"
                f"{full / state:.2f} ({size} ranks); max |difference| sharded vs unsharded = {diff:.3e} "
                f"({'ok' if diff <= EQUIVALENCE_TOLERANCE else 'FAILED'}, tolerance {EQUIVALENCE_TOLERANCE:g})")
        if args.uneven:
            diff, contributors = check_uneven(comm, data, args.steps, args.batch_size, args.seed, args.lr,
                                              args.momentum)
            ok = ok and diff <= EQUIVALENCE_TOLERANCE
            say(f"uneven: batches per rank {uneven_counts(size, args.steps)}, contributors per call "
                f"{contributors}; max |difference| vs one process = {diff:.3e} "
                f"({'ok' if diff <= EQUIVALENCE_TOLERANCE else 'FAILED'}, tolerance {EQUIVALENCE_TOLERANCE:g})")
        return 0 if ok else 1

    if args.check_equivalence:
        diff = check_equivalence(comm, data, args.steps, args.batch_size, args.seed, args.lr, args.momentum)
        ok = diff <= EQUIVALENCE_TOLERANCE
        say(f"equivalence: {size} rank(s) x 1/{size} of each batch vs one process on the whole batch, "
            f"{args.steps} steps, float64: max |difference| = {diff:.3e} "
            f"({'ok' if ok else 'FAILED'}, tolerance {EQUIVALENCE_TOLERANCE:g})")
        return 0 if ok else 1

    settings = Settings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                        momentum=args.momentum, seed=args.seed, overlap=args.overlap)
    say(f"digits: {len(data.x_train)} training and {len(data.x_test)} test images; "
        f"{size} rank(s), global batch {settings.batch_size} "
        f"(~{settings.batch_size / size:g} per rank), {settings.epochs} epochs")
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
    moving = result.pack_seconds + result.allreduce_seconds + result.unpack_seconds
    say(f"  reduction: {moving * ms:.3f} ms moving data (reducer.stats: pack {result.pack_seconds * ms:.3f}, "
        f"Allreduce {result.allreduce_seconds * ms:.3f}, unpack {result.unpack_seconds * ms:.3f} ms), "
        f"{(result.reduce_seconds - moving) * ms:.3f} ms checking the gradients across ranks")
    say(f"  {result.reduced_bytes} bytes per step in {result.messages} fused message(s)")
    if args.plot and rank == 0:
        plot(result, len(global_batches(len(data.x_train), settings.batch_size, settings.seed, 0)), args.plot, size)
        say(f"curves: {args.plot}")
    if timeline is not None:
        say(f"timeline: {args.timeline} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
