"""The stall inspector: which ranks have not arrived at a collective.

A side channel on a duplicate of the reducer's communicator, used only when a
collective has already waited long (the watchdog's ``stall_warning``). The
healthy path sends nothing on it: each rank's watchdog thread merely looks
for a pending message (``MPI_Improbe``) at its poll interval.

A waiting rank sends a query to every other rank; each rank's watchdog thread
answers with a :class:`Report` of what its own rank is doing: the number of
the reducer call it is at, the collective it waits in, if any, and what else
its process waits in (the reducer's ``elsewhere`` option). A rank
that answers within the reply window and waits in the same collective of the
same call has arrived; every other rank is missing, and the report says what
it was doing instead, or that it did not answer (it has exited, or is stuck
in native code that holds the GIL, so its watchdog thread cannot run).

The side channel needs ``MPI_THREAD_MULTIPLE`` (the watchdog thread calls MPI
while another thread waits in the collective); mpi4py asks for it by default.
Without it, :attr:`StallInspector.available` is False and no message is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpi4py import MPI

__all__ = ["Report", "StallInspector", "missing_ranks"]

_QUERY = 1
_REPLY = 2


@dataclass(frozen=True)
class Report:
    """What one rank is doing, as its watchdog thread saw it.

    Attributes:
        call: the number of the reducer call the rank is at (0 before its
            first call).
        waiting: the collective the rank waits in (``"call 4, bucket 0 (4096
            bytes)"``), or None when it is not in a collective.
        seconds: how long it has waited there.
        elsewhere: what else the rank's process waits in, in words (a
            framework's own operations beside the reducer, e.g. ``hvd.allreduce
            'loss' in process set 0, submitted 61.0 s ago``): the reducer's
            ``elsewhere`` option.
    """

    call: int
    waiting: str | None
    seconds: float
    elsewhere: tuple[str, ...] = ()

    def describe(self, rank: int) -> str:
        """One clause for a diagnostic line, e.g. ``rank 3: not in a collective since call 7``."""
        if self.waiting is not None:
            text = f"rank {rank}: waiting in {self.waiting} for {self.seconds:.1f} s"
        elif self.call == 0:
            text = f"rank {rank}: not in a collective, before its first call"
        else:
            text = f"rank {rank}: not in a collective since call {self.call}"
        return text + "".join(f", and in {what}" for what in self.elsewhere)


class StallInspector:
    """Asks the other ranks what they are doing, over a communicator of its own.

    Every method except the constructor is meant for one thread only (the
    watchdog's) and never blocks: sends are ``isend`` of a few bytes, receives
    are matched probes of messages that have already arrived.

    Args:
        comm: the communicator whose ranks are inspected. Construction
            duplicates it, so it is collective over ``comm``; it is done on
            every rank whatever the MPI thread level, so that the ranks issue
            the same collectives.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm: MPI.Intracomm | None = comm.Dup()
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        #: Whether queries can be sent and answered (MPI_THREAD_MULTIPLE).
        self.available = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        #: Why the side channel cannot be used, when it cannot.
        self.unavailable_reason = "" if self.available else "MPI was not initialized with MPI_THREAD_MULTIPLE"
        self._inquiry = 0
        self._replies: dict[int, Report] = {}
        self._sends: list[MPI.Request] = []

    def serve(self, answer: Callable[[], Report]) -> None:
        """Answer every query that has arrived; keep the replies to :meth:`ask`.

        Args:
            answer: what this rank is doing now (called only when a query has arrived).
        """
        comm = self._comm
        if not self.available or comm is None:
            return
        try:
            status = MPI.Status()
            while True:
                message = comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                if message is None:
                    break
                source, tag = status.Get_source(), status.Get_tag()
                body = message.recv()
                if tag == _QUERY:
                    report = answer()
                    self._sends.append(comm.isend((body, report.call, report.waiting, report.seconds,
                                                   report.elsewhere), dest=source, tag=_REPLY))
                elif tag == _REPLY and body[0] == self._inquiry:
                    self._replies[source] = Report(*body[1:])
            self._sends = [r for r in self._sends if not r.Test()]
        except MPI.Exception as exc:
            self._fail(exc)

    def ask(self) -> None:
        """Send a query to every other rank; the replies arrive through :meth:`serve`."""
        self._inquiry += 1
        self._replies = {}
        if not self.available or self._comm is None:
            return
        try:
            for dest in range(self.size):
                if dest != self.rank:
                    self._sends.append(self._comm.isend(self._inquiry, dest=dest, tag=_QUERY))
        except MPI.Exception as exc:
            self._fail(exc)

    def answered(self) -> bool:
        """Whether every other rank has replied to the latest :meth:`ask`."""
        return len(self._replies) == self.size - 1

    def replies(self) -> dict[int, Report]:
        """The replies to the latest :meth:`ask`, by rank."""
        return dict(self._replies)

    def communicators(self) -> list[MPI.Intracomm]:
        """The side channel, while open (what a lost rank's recovery revokes)."""
        return [] if self._comm is None else [self._comm]

    def close(self) -> None:
        """Release the side channel; local (no collective) and idempotent.

        Sends still in flight are left to complete on their own
        (``MPI_Request_free``); queries that arrive later stay unread.
        """
        comm, self._comm = self._comm, None
        if comm is None or MPI.Is_finalized():
            return
        for request in self._sends:
            try:
                request.Free()
            except MPI.Exception:
                pass
        self._sends = []
        try:
            comm.Free()
        except MPI.Exception:
            pass

    def _fail(self, exc: MPI.Exception) -> None:
        self.available = False
        self.unavailable_reason = f"the side channel failed ({exc.Get_error_string()})"


def missing_ranks(size: int, rank: int, mine: Report, replies: dict[int, Report]) -> dict[int, str]:
    """The ranks that have not arrived at this rank's collective, each with what it is doing.

    Args:
        size: the number of ranks.
        rank: this rank.
        mine: what this rank is doing (waiting in a collective).
        replies: the other ranks' answers, by rank; a rank without one did
            not answer in time.

    Returns:
        For each missing rank, in rank order, a clause that says why.
    """
    missing = {}
    for r in range(size):
        if r == rank:
            continue
        theirs = replies.get(r)
        if theirs is None:
            missing[r] = f"rank {r}: no answer (exited, or stuck in native code)"
        elif (theirs.call, theirs.waiting) != (mine.call, mine.waiting):
            missing[r] = theirs.describe(r)
    return missing
