"""The flags that a ``DistributedOptimizer`` reduces with its gradients: who used what, and who misused it.

The reducer gets one more gradient before the parameters: a small vector,
written at ``step()``, that rides in the last bucket. It holds, in order:

- one slot per parameter: non-zero where this rank has a gradient for it;
- one slot per kind of misuse (:data:`MISUSES`) and rank: non-zero in this
  rank's own slot for each kind it saw;
- a subclass's side values (the Horovod optimizer's), averaged like the rest.

After the reduction every rank reads from the same sums which parameters
some rank used and which rank misused what. :func:`with_flags` and
:func:`without_flags` turn the caller's options into the reducer's (the flags
take the first parameter's bucket) and back.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .._core import planning
from .._core.options import Options

__all__ = ["CHANGED", "MISUSES", "NOT_DENSE", "NO_BACKWARD", "WRITTEN", "ZERO_GRAD", "Flags", "with_flags",
           "without_flags"]

#: The kinds of misuse a rank reports in the flags, by slot (one slot per kind and rank).
MISUSES = (
    "step() or synchronize() was called without a backward pass since the last step()",
    "a gradient was written after its hook fired (it had been handed to the reduction)",
    "the optimizer's parameters changed after DistributedOptimizer was made",
    "a gradient is not a dense (strided) tensor",
    "zero_grad() was called after backward() and before step() or synchronize()",
)
NO_BACKWARD, WRITTEN, CHANGED, NOT_DENSE, ZERO_GRAD = range(len(MISUSES))


class Flags:
    """The layout of the flags of ``params`` parameters over ``size`` ranks, with ``side`` side values.

    Args:
        params: the parameters that require grad.
        size: the number of ranks.
        rank: this rank.
        side: the subclass's side values.
    """

    def __init__(self, params: int, size: int, rank: int, side: int = 0) -> None:
        self.params, self.size, self.rank = params, size, rank
        #: Where the side values begin.
        self.side_start = params + len(MISUSES) * size
        #: The number of values in all.
        self.length = self.side_start + side

    def encode(self, used: Iterable[bool], misused: Iterable[int]) -> np.ndarray:
        """This rank's flags: the parameters it ``used``, the kinds of misuse it saw; side values zero."""
        local = np.zeros(self.length, dtype=np.float32)
        local[:self.params] = np.fromiter(used, dtype=bool, count=self.params)
        for kind in misused:
            local[self.params + kind * self.size + self.rank] = 1.0
        return local

    def side(self, flags: np.ndarray) -> np.ndarray:
        """The side values of ``flags`` (a view)."""
        return flags[self.side_start:]

    def used(self, flags: np.ndarray) -> np.ndarray:
        """Per parameter: whether some rank used it, read from the reduced ``flags``."""
        return flags[:self.params] != 0

    def misuse(self, flags: np.ndarray) -> tuple[int, int] | None:
        """The first kind of misuse and the lowest rank that saw it, read from the reduced ``flags``; or None."""
        table = flags[self.params:self.side_start].reshape(len(MISUSES), self.size)
        if not table.any():
            return None
        kind, rank = (int(k[0]) for k in np.nonzero(table))
        return kind, rank


def with_flags(count: int, options: Options) -> Options:
    """The reducer's options for the flags followed by ``count`` parameters (local; raises on bad options).

    The flags take the fusion id of the first parameter, so that they ride
    in its bucket (the last one launched), and are never skipped.

    Raises:
        ValueError: ``skip`` does not have one entry per parameter, or a bad fusion option.
    """
    ids = planning.fusion_ids(count, options.fusion_type, options.fusion, options.split_indices)
    skip = None if options.skip is None else list(options.skip)
    if skip is not None and len(skip) != count:
        raise ValueError(f"skip: expected {count} bools (one per parameter that requires grad), got {len(skip)}")
    return options.replace(fusion_type=1, fusion=(ids[0], *ids), split_indices=None,
                           skip=None if skip is None else (False, *skip))


def without_flags(options: Options) -> Options:
    """The caller's options back from the reducer's resolved ``options`` (the inverse of :func:`with_flags`)."""
    return options.replace(fusion=options.ids[1:], skip=options.skipped[1:])
