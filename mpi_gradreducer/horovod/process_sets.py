"""Horovod's process sets: each a sub-communicator of the global one, added and removed collectively.

``hvd.add_process_set(ranks)`` is called by every rank (members or not),
with the same ranks, as in Horovod: the ranks first agree (an operation
without data that also names a rank whose list differs), then
``MPI_Comm_split`` makes the set's communicator on its members, and the
engine serves it from then on (its own duplicates: negotiation and data).
``process_set=`` on a collective or on ``DistributedOptimizer`` restricts
it to the set; a root rank stays a global rank (``hvd.rank()``), as in
Horovod. ``remove_process_set`` is collective too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from .._core import groups
from . import session
from .session import SetInfo, current

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "init"]


class ProcessSet:
    """A set of ranks that run collectives together: give it to ``add_process_set`` (or ``init``).

    Args:
        ranks_or_comm: global ranks (any order; kept sorted), or an mpi4py
            communicator (at ``init`` only: give it on its ranks and
            ``MPI.COMM_NULL`` on the others).

    Attributes:
        process_set_id: its id once added (None before, and after it is removed).
        ranks: its global ranks, sorted.
        mpi_comm: the communicator it was made from, if any.

    Raises:
        ValueError: neither a list of ints nor an mpi4py communicator.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        if isinstance(ranks_or_comm, (str, bytes)) or not isinstance(ranks_or_comm, Sequence) or \
                any(isinstance(r, bool) or not isinstance(r, int) for r in ranks_or_comm):
            raise ValueError(f"ProcessSet: expected a list of ranks (ints) or an mpi4py communicator, got "
                             f"{ranks_or_comm!r}")
        self.ranks = sorted(ranks_or_comm)

    def _info(self) -> SetInfo | None:
        if self.process_set_id is None:
            return None
        return current("ProcessSet").sets.get(self.process_set_id)

    def size(self) -> int | None:
        """The number of its ranks (None before it is added)."""
        info = self._info()
        return None if info is None else len(info.ranks)

    def rank(self) -> int | None:
        """This rank's rank in the set (None before it is added).

        Raises:
            ValueError: this rank is not in the set.
        """
        info = self._info()
        if info is None:
            return None
        me = current("ProcessSet.rank()").comm.Get_rank()
        if me not in info.ranks:
            raise ValueError(f"ProcessSet.rank(): rank {me} is not part of {self}")
        return info.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this rank is in the set (None before its ranks are known)."""
        ranks = self.ranks
        if ranks is None:
            return None
        return current("ProcessSet.included()").comm.Get_rank() in ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank given to ``init``: id 0, always there while initialized."""

    process_set_id = 0

    def __init__(self) -> None:
        pass

    def __getattribute__(self, name: str) -> Any:
        if name == "ranks":  # every rank, once initialized
            from .session import _Session

            ctx = _Session.context
            return None if ctx is None else list(ctx.sets[0].ranks)
        return super().__getattribute__(name)

    def __str__(self) -> str:
        return "global_process_set"

    __repr__ = __str__


#: Every rank given to ``init()``.
global_process_set: ProcessSet = _GlobalProcessSet()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Add a process set; collective: every rank calls it with the same ranks, members or not.

    Args:
        process_set: a ``ProcessSet`` made from a list of ranks, or the list.

    Returns:
        The process set, added (``process_set_id`` set).

    Raises:
        ValueError: on every rank: ranks out of range, no ranks, a set of these
            ranks exists already, or the ranks differ between ranks (naming two).
        NotImplementedError: a set made from a communicator (give its ranks;
            communicators are taken by ``init``), on every rank.
    """
    from .control import check

    ctx = current("hvd.add_process_set")
    what = "hvd.add_process_set"
    error: Exception | None = None
    ps: ProcessSet | None = None
    ranks: tuple[int, ...] = ()
    try:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.ranks is None:
            raise NotImplementedError(f"{what}: a process set made from a communicator can only be given to "
                                      "hvd.init(process_sets=...); build it from a list of ranks")
        ranks = tuple(ps.ranks)
        size = ctx.comm.Get_size()
        if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= size:
            raise ValueError(f"{what}: expected distinct ranks in [0, {size - 1}], got {list(ranks)}")
        if any(info.ranks == ranks for info in ctx.sets.values()):
            raise ValueError(f"{what}: a process set of ranks {list(ranks)} exists already (a duplicate)")
    except Exception as exc:  # raised on every rank, through the agreement
        error = exc
    check(what, [("ranks", ranks)], error)
    assert ps is not None
    return _register(ps, ranks)


def _register(ps: ProcessSet, ranks: tuple[int, ...]) -> ProcessSet:
    """Make the set's communicator (collective over the global set) and hand it to the engine."""
    ctx = current("hvd.add_process_set")
    made = groups.create_group(ranks, ctx.comm)  # the core's: the ranks in the set's (sorted) order
    comm = MPI.Intracomm(MPI.COMM_NULL) if made is None else made
    set_id = ctx.next_id
    ctx.next_id += 1
    if comm != MPI.COMM_NULL:
        ctx.engine.add_set(set_id, ranks, comm)  # collective over the members: they add sets in the same order
    ctx.sets[set_id] = SetInfo(set_id, ranks, comm)
    ps.process_set_id = set_id
    ps.ranks = list(ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set added before; collective: every rank calls it.

    Returns:
        Whether it was removed: False for the global set or a set not added
        (on every rank alike). Its operations still in flight fail.
    """
    from .control import check

    ctx = current("hvd.remove_process_set")
    given = getattr(process_set, "process_set_id", None)
    set_id = given if isinstance(given, int) and given != 0 and given in ctx.sets else -1
    check("hvd.remove_process_set", [("process_set_id", (set_id,))])
    if set_id < 0:
        return False
    info = ctx.sets.pop(set_id)
    if info.member:
        ctx.engine.remove_set(set_id)
        info.comm.Free()
    process_set.process_set_id = None
    return True


def init(comm: MPI.Intracomm | Sequence[int] | None = None, process_sets: Any = None) -> None:
    """Horovod's ``hvd.init``: the context over ``comm`` (:func:`.session.init`), then the process sets given.

    Args:
        comm: None (every rank of ``MPI.COMM_WORLD``), an mpi4py
            intracommunicator (duplicated), or a list of ranks of
            ``MPI.COMM_WORLD`` (see :func:`.session.init`).
        process_sets: None or ``"dynamic"`` (process sets are added later
            with ``add_process_set``), or the process sets to add now: a list
            of ``ProcessSet`` objects (or lists of ranks), the same on every
            rank; those made from an mpi4py communicator give it on their
            ranks and ``MPI.COMM_NULL`` elsewhere.

    Raises:
        TypeError, ValueError: as :func:`.session.init`; and for process sets
            that cannot be added (on every rank).
    """
    if session.is_initialized():
        return
    session.init(comm)
    if process_sets is not None and process_sets != "dynamic":
        _add_initial(process_sets)


def _add_initial(process_sets: Any) -> None:
    """``init(process_sets=...)``: add each (collective; communicators give their ranks to every rank)."""
    ctx = current("hvd.init")
    for ps in process_sets:
        ps = ps if isinstance(ps, ProcessSet) else ProcessSet(ps)
        if ps.ranks is None:
            comm = ps.mpi_comm
            mine = None
            if comm is not None and comm != MPI.COMM_NULL:
                mine = sorted(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                                        ctx.comm.Get_group()))
            known = [r for r in ctx.comm.allgather(mine) if r is not None]
            ps.ranks = known[0] if known else []
        add_process_set(ps)
