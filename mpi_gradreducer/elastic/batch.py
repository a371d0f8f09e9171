"""A global batch that stays the same when the number of ranks changes: each rank's share, in micro-batches.

With a fixed global batch, a job that loses a rank (or gains one) keeps its
optimisation unchanged: the other ranks take the lost rank's samples, in more
micro-batches (gradient accumulation) where a rank's share no longer fits in
one. The mean over the global batch comes out of the reducer when each rank's
gradient is the *sum* over its samples and the reducer divides by the global
batch (``degree=batch.size``), a divisor that a rebuild keeps::

    batch = elastic.GlobalBatch(size=256, micro=32)
    reducer = DistributedGradReducer(params, degree=batch.size)   # sums / 256
    ...
    for part in batch.share(state.rank, state.size):               # e.g. 2 micro-batches at 4 ranks, 3 at 3
        for g, s in zip(grads, gradient_sums(x[part], y[part])):   # summed over the part's samples
            g += s
    reducer(grads)                                                 # the mean over the 256 samples
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GlobalBatch"]


@dataclass(frozen=True)
class GlobalBatch:
    """``size`` samples a step over all the ranks, at most ``micro`` at a time on one rank.

    Args:
        size: the global batch: samples a step, whatever the number of ranks.
        micro: the most samples one rank processes at once (what fits in its memory).

    Raises:
        ValueError: ``size`` or ``micro`` is not a positive int.
    """

    size: int
    micro: int

    def __post_init__(self) -> None:
        for name in ("size", "micro"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")

    def share(self, rank: int, ranks: int) -> list[range]:
        """Rank ``rank``'s micro-batches of a step at ``ranks`` ranks, as ranges of the step's sample indices.

        The ranks take the samples in turn (sample ``i`` goes to rank ``i %
        ranks``), so the shares differ by one sample at most; each share is
        cut into :meth:`accumulation` micro-batches of at most ``micro``
        samples (the last ones may be shorter, or empty on a rank with fewer
        samples). Every sample is in exactly one micro-batch of one rank.

        Raises:
            ValueError: ``ranks`` is not positive, or ``rank`` is not in ``[0, ranks)``.
        """
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks: expected an int >= 1, got {ranks!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
            raise ValueError(f"rank: expected an int in [0, {ranks}), got {rank!r}")
        steps = self.accumulation(ranks)
        mine = range(rank, self.size, ranks)
        per = -(-len(mine) // steps) if len(mine) else 0
        return [mine[k * per:(k + 1) * per] for k in range(steps)]

    def accumulation(self, ranks: int) -> int:
        """Micro-batches a rank processes per step at ``ranks`` ranks (the same on every rank)."""
        most = -(-self.size // ranks)  # the largest share
        return max(1, -(-most // self.micro))
