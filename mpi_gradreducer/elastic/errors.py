"""The errors of elastic mode: ranks lost, new ranks ready, and giving up."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ElasticError", "HostsUpdated", "RanksLost"]


class RanksLost(RuntimeError):
    """Ranks of the job were lost (their processes died); the survivors go on without them.

    Made on every survivor when it has caught the failure and the survivors
    have agreed who is left. :attr:`State.failure` holds the last one.

    Attributes:
        ranks: the lost ranks, numbered as they were before the loss.
        size: how many ranks there were before.
        survivors: how many are left.
        where: the MPI error this rank saw first.
    """

    def __init__(self, ranks: Sequence[int], size: int, survivors: int, where: str) -> None:
        self.ranks, self.size, self.survivors, self.where = list(ranks), size, survivors, where
        lost = ", ".join(map(str, self.ranks)) or "none (a revoked communicator)"
        super().__init__(f"lost rank{'s' if len(self.ranks) != 1 else ''} {lost} of {size} ({where}); "
                         f"{survivors} rank{'s' if survivors != 1 else ''} go on from the last commit")


class HostsUpdated(RuntimeError):
    """The ranks change at this commit: new ranks are ready to join, or ranks of removed hosts leave.

    Raised by ``commit()`` on every rank at the same commit. The run loop
    catches it, takes the new ranks in (and shares the state with them) or
    lets the drained ranks go, and calls the training function again on
    the ranks that go on (nothing is restored: the state was just committed).

    Attributes:
        skip_sync: Horovod's flag: whether the state needs no sync (when ranks only leave).
    """

    def __init__(self, message: str = "new ranks are ready to join", skip_sync: bool = False) -> None:
        super().__init__(message)
        self.skip_sync = skip_sync


class ElasticError(RuntimeError):
    """Elastic mode cannot go on: too few ranks are left and no replacement came in time."""
