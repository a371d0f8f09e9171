"""Checks of the digits demo's training: data-parallel equals one process, sharded and with uneven data.

Each check trains the demo's model (``digits_model.py``, in float64) from the
same weights in two ways and compares the parameters, which must agree to
:data:`EQUIVALENCE_TOLERANCE` on every rank::

    mpiexec -n 4 python scripts/check_training.py                     # all three
    mpiexec -n 4 python scripts/check_training.py --equivalence
    mpiexec -n 4 python scripts/check_training.py --shard --uneven --steps 12

``--equivalence``: the ranks sharing every global batch through the reducer,
against one process on the whole batch (each rank computes the latter by
itself, without communication). ``--shard``: a sharded optimizer
(``reduce_scatter``, momentum for this rank's pieces only, ``allgather``)
against the unsharded one. ``--uneven``: ranks with different numbers of
batches, ending with ``join()``, against one process. ``tests/test_training.py``
runs these functions. Needs the ``examples`` extra (scikit-learn).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import numpy as np
from digits_model import Data, Momentum, forward_backward, init_params, load_data  # scripts/, next to this file
from mpi4py import MPI
from train_digits import Trainer, global_batches, my_share

from mpi_gradreducer import DistributedGradReducer, broadcast_parameters

#: Agreement required between the two trainings (float64).
EQUIVALENCE_TOLERANCE = 1e-10


class Alone:
    """The demo's step in one process on the whole global batch, without communication."""

    def __init__(self, params: list[np.ndarray], lr: float, momentum: float) -> None:
        self.params = params
        self.optimizer = Momentum(params, lr, momentum)
        self.grads = [np.zeros_like(p) for p in params]

    def step(self, x: np.ndarray, y: np.ndarray, batch: int) -> float:
        """Compute the gradient of the mean loss over ``batch`` rows and update; returns that loss."""
        loss = forward_backward(self.params, x.astype(self.params[0].dtype, copy=False), y, 1 / batch, self.grads)
        self.optimizer.step(self.grads)
        return loss


def _max_difference(comm: MPI.Intracomm, a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest absolute difference between ``a`` and ``b`` over all parameters and ranks (collective)."""
    diff = np.array([max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))])
    comm.Allreduce(MPI.IN_PLACE, diff, op=MPI.MAX)
    return float(diff[0])


def _start(comm: MPI.Intracomm, data: Data, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The inputs in float64 and rank 0's initial weights, on every rank."""
    x = data.x_train.astype(np.float64)
    params = init_params(x.shape[1], 128, 10, seed + comm.Get_rank(), np.float64)
    broadcast_parameters(params, root=0, group=comm)
    return x, params


def _batches(n: int, steps: int, batch_size: int, seed: int) -> list[np.ndarray]:
    """The first ``steps`` global batches, over as many epochs as it takes."""
    per_epoch = len(global_batches(n, batch_size, seed, 0))
    return [b for e in range(-(-steps // per_epoch)) for b in global_batches(n, batch_size, seed, e)][:steps]


def check_equivalence(
    comm: MPI.Intracomm, data: Data, steps: int = 30, batch_size: int = 64, seed: int = 0,
    lr: float = 0.05, momentum: float = 0.9,
) -> float:
    """Data-parallel against single-process training, in float64 (collective).

    Every rank trains the same model twice for ``steps`` steps from the same
    weights: (a) with the ranks of ``comm`` each on its share of every global
    batch, gradients averaged by the reducer; (b) alone on the whole batch,
    with no communication.

    Returns:
        The largest absolute difference between (a) and (b) over all
        parameters and ranks (the same on every rank).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    x, params = _start(comm, data, seed)
    alone = Alone([p.copy() for p in params], lr, momentum)
    shared = Trainer(comm, params, lr, momentum)
    for batch in _batches(len(x), steps, batch_size, seed):
        mine = my_share(batch, rank, size)
        shared.step(x[mine], data.y_train[mine], len(batch))
        alone.step(x[batch], data.y_train[batch], len(batch))
    shared.free()
    return _max_difference(comm, shared.params, alone.params)


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
    x, params = _start(comm, data, seed)
    plain = Trainer(comm, [p.copy() for p in params], lr, momentum)
    reducer = DistributedGradReducer(params, group=comm)
    grads = reducer.allocate_grads()
    velocity: dict[tuple[int, int], np.ndarray] = {}  # (parameter, start) -> this rank's piece of momentum
    for batch in _batches(len(x), steps, batch_size, seed):
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
    diff = _max_difference(comm, plain.params, params)
    state = comm.allreduce(sum(v.nbytes for v in velocity.values()), op=MPI.MAX)
    return diff, state, sum(v.nbytes for v in plain.optimizer.velocity)


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
    x, params = _start(comm, data, seed)
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
    longest = int(np.argmax(counts))
    broadcast_parameters(params, root=longest, group=comm)
    return _max_difference(comm, params, alone.params), comm.bcast(contributors, root=longest)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (collective over ``MPI.COMM_WORLD``); returns 0 when every check passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--equivalence", action="store_true",
                        help="data-parallel against single-process training")
    parser.add_argument("--shard", action="store_true", help="a sharded optimizer against the unsharded one")
    parser.add_argument("--uneven", action="store_true",
                        help="ranks with different numbers of batches, ending with join(), against one process")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each check")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, shared by the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0, help="split, weights and batch order")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be positive")
    if not (args.equivalence or args.shard or args.uneven):
        args.equivalence = args.shard = args.uneven = True
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    say: Callable[..., None] = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    data = load_data(args.seed)
    if args.batch_size > len(data.x_train):
        parser.error(f"--batch-size: at most {len(data.x_train)} (the training set), got {args.batch_size}")
    common = (args.steps, args.batch_size, args.seed, args.lr, args.momentum)
    ok = True

    def verdict(diff: float) -> str:
        nonlocal ok
        ok = ok and diff <= EQUIVALENCE_TOLERANCE
        return f"({'ok' if diff <= EQUIVALENCE_TOLERANCE else 'FAILED'}, tolerance {EQUIVALENCE_TOLERANCE:g})"

    if args.equivalence:
        diff = check_equivalence(comm, data, *common)
        say(f"equivalence: {size} rank(s) x 1/{size} of each batch vs one process on the whole batch, "
            f"{args.steps} steps, float64: max |difference| = {diff:.3e} {verdict(diff)}")
    if args.shard:
        diff, state, full = check_shard(comm, data, *common)
        say(f"shard: optimizer state per rank {state} bytes (max over ranks) vs {full} unsharded = 1/"
            f"{full / state:.2f} ({size} ranks); max |difference| sharded vs unsharded = {diff:.3e} {verdict(diff)}")
    if args.uneven:
        diff, contributors = check_uneven(comm, data, *common)
        say(f"uneven: batches per rank {uneven_counts(size, args.steps)}, contributors per call "
            f"{contributors}; max |difference| vs one process = {diff:.3e} {verdict(diff)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
