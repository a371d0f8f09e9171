"""What a world rebuilds on each new communicator: any object with the three methods of :class:`Rebuildable`.

Reducers (:class:`~mpi_gradreducer.DistributedGradReducer`), the torch
``DistributedOptimizer`` (and Horovod's, a subclass) have them as documented
methods; so may any object of the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from mpi4py import MPI

__all__ = ["Rebuildable", "rebuildable"]


@runtime_checkable
class Rebuildable(Protocol):
    """What a world rebuilds: the communicators to revoke on a failure, an abandon and a rebuild."""

    def communicators(self) -> Iterable[MPI.Comm]:
        """Every communicator the object made and holds (revoked when a rank is lost)."""
        ...

    def abandon(self) -> None:
        """Release what the object holds with no collective (local): its peers may be gone, or MPI is ending."""
        ...

    def rebuild(self, comm: MPI.Intracomm) -> None:
        """Make the object again over ``comm`` (collective), releasing the old communicators locally first."""
        ...


def rebuildable(obj: Any) -> Rebuildable:
    """``obj``, checked to have the methods of :class:`Rebuildable`.

    Raises:
        TypeError: it lacks one.
    """
    if not isinstance(obj, Rebuildable):
        missing = [m for m in ("communicators", "abandon", "rebuild") if not callable(getattr(obj, m, None))]
        raise TypeError(f"reducers: expected a DistributedGradReducer, a torch DistributedOptimizer or an object "
                        f"with communicators(), abandon() and rebuild(comm); {type(obj).__name__} has no "
                        f"{', '.join(missing)}")
    return obj
