"""A watchdog that names the ranks a collective waits for, and ends the job when it waits too long.

One :class:`Watchdog` per reducer. The reducer arms it with a description of
each collective and the call number, and disarms it afterwards: two attribute
writes, nothing sent. A daemon thread looks at the armed collective a few
times per second:

- after ``stall_warning`` seconds it asks the other ranks, over the
  :class:`~mpi_gradreducer._core.stall.StallInspector` side channel, what they are
  doing, and prints one line naming the ranks that have not arrived
  (``missing ranks: 2``), then goes on waiting;
- after ``timeout`` seconds it asks again, prints the diagnosis and ends the
  job with :func:`~mpi_gradreducer._core.abort.abort_job`.

The thread also answers the other ranks' questions, so it runs for the whole
life of the reducer, even with both limits disabled.

While a watchdog over more than one rank exists, an uncaught exception ends
the job too (:mod:`mpi_gradreducer._core.excepthook`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from mpi4py import MPI

from .abort import abort_job
from .excepthook import UNCAUGHT
from .stall import Report, StallInspector, missing_ranks

__all__ = ["Watchdog", "REPLY_WINDOW"]

#: How long a waiting rank collects the other ranks' answers before it names the missing ones.
REPLY_WINDOW = 3.0
#: The longest pause between two looks of the watchdog thread (and so the
#: longest delay before a rank answers a query).
MAX_POLL = 0.25


class Watchdog:
    """Names the missing ranks of a slow collective, and aborts the job when it is too slow.

    Construction is collective over ``comm`` (it duplicates it for the side
    channel) and starts the watchdog thread; :meth:`close` is local.

    Args:
        comm: the reducer's communicator.
        timeout: seconds an armed collective may take before the job is
            aborted; None never aborts.
        stall_warning: seconds after which the missing ranks are named, once
            per collective; None never warns.
        hook: while this watchdog lives, an uncaught exception aborts the job
            (:mod:`mpi_gradreducer._core.excepthook`; only over more than one rank).
        rank: the rank named in the messages (default: the rank in ``comm``).
        elsewhere: what else this process waits in, in words, for the other
            ranks' diagnoses (:attr:`Report.elsewhere <.stall.Report>`);
            called on the watchdog's thread when a rank asks.
    """

    def __init__(self, comm: MPI.Intracomm, timeout: float | None, stall_warning: float | None,
                 hook: bool = True, rank: int | None = None,
                 elsewhere: Callable[[], Sequence[str]] | None = None) -> None:
        self.timeout = None if timeout is None else float(timeout)
        self.stall_warning = None if stall_warning is None else float(stall_warning)
        inspector = StallInspector(comm)
        self._guard = _Guard(inspector, self.timeout, self.stall_warning,
                             inspector.rank if rank is None else rank, elsewhere)
        hooked = hook and inspector.size > 1 and UNCAUGHT.acquire()
        thread = threading.Thread(target=self._guard.run, name="mpi_gradreducer-watchdog", daemon=True)
        thread.start()
        # Also run at interpreter exit (before mpi4py finalizes MPI) and when the reducer is dropped unfreed.
        self._finalizer = weakref.finalize(self, _stop, self._guard, thread, hooked)

    def arm(self, what: Callable[[], str], call: int, watch: bool = True) -> None:
        """Start timing a collective.

        Args:
            what: describes the collective, e.g. ``"bucket 0 (4096 bytes)"``;
                called only when a diagnostic or another rank asks.
            call: the number of the reducer call it belongs to (from 1).
            watch: False for a wait that is no stall however long it lasts
                (a rank in ``join()`` waiting for the others' next call): the
                collective is reported to the other ranks' questions, but
                never warned about nor aborted.
        """
        guard = self._guard
        guard.call = call
        guard.armed = (time.monotonic(), what, call, watch)

    def disarm(self) -> None:
        """Stop timing: the collective finished."""
        self._guard.armed = None

    def waiting(self) -> str | None:
        """The collective armed now, in words (``call 4, bucket 0 (4096 bytes)``); None when none is."""
        return self._guard.report().waiting

    def communicators(self) -> list[MPI.Intracomm]:
        """The side channel, while open."""
        return self._guard.inspector.communicators()

    def close(self) -> None:
        """Stop the thread and release the side channel; local and idempotent."""
        self._finalizer()


def _stop(guard: _Guard, thread: threading.Thread, hooked: bool) -> None:
    guard.stop.set()
    if thread is not threading.current_thread():
        thread.join()
    guard.inspector.close()
    if hooked:
        UNCAUGHT.release()


class _Guard:
    """The watchdog thread's state and loop (kept apart from :class:`Watchdog` so that it can be collected)."""

    def __init__(self, inspector: StallInspector, timeout: float | None, stall_warning: float | None,
                 rank: int, elsewhere: Callable[[], Sequence[str]] | None = None) -> None:
        self.inspector = inspector
        self.elsewhere = elsewhere
        self.timeout = timeout
        self.stall_warning = stall_warning
        self.rank = rank
        #: (armed at, description, call, watched) of the collective in progress, or None.
        self.armed: tuple[float, Callable[[], str], int, bool] | None = None
        self.stop = threading.Event()
        limits = [s for s in (timeout, stall_warning) if s is not None]
        self.poll = min(MAX_POLL, max(min(limits, default=MAX_POLL) / 8, 0.01))
        #: The number of the latest call armed.
        self.call = 0

    def report(self) -> Report:
        """What this rank is doing now (without :attr:`elsewhere`: see :meth:`answer`)."""
        armed = self.armed
        if armed is None:
            return Report(self.call, None, 0.0)
        since, what, call, _ = armed
        return Report(call, _describe(what, call), time.monotonic() - since)

    def answer(self) -> Report:
        """What this rank is doing now, and what else its process waits in: the answer to another rank."""
        report = self.report()
        if self.elsewhere is None:
            return report
        try:
            said = self.elsewhere()
            elsewhere = (said,) if isinstance(said, str) else tuple(str(what) for what in said)
        except Exception as exc:  # a description must never kill the watchdog
            elsewhere = (f"(undescribable: {exc!r})",)
        return dataclasses.replace(report, elsewhere=elsewhere)

    def run(self) -> None:
        warned: object = None  # the arming already warned about
        inquiry: tuple[object, bool, float] | None = None  # (arming, final, deadline)
        while not self.stop.wait(self._pause(inquiry)):
            self.inspector.serve(self.answer)
            armed = self.armed
            if armed is None or (inquiry is not None and inquiry[0] is not armed):
                inquiry = None  # the collective finished meanwhile
                if armed is None:
                    continue
            if not armed[3]:
                continue  # reported when asked, never timed
            waited = time.monotonic() - armed[0]
            if inquiry is None:
                final = self.timeout is not None and waited >= self.timeout
                if final or (self.stall_warning is not None and waited >= self.stall_warning
                             and warned is not armed):
                    self.inspector.ask()
                    inquiry = (armed, final, time.monotonic() + REPLY_WINDOW)
                continue
            if not (self.inspector.answered() or time.monotonic() >= inquiry[2]
                    or not self.inspector.available):
                continue
            warning = not inquiry[1]
            inquiry, warned = None, armed
            self._diagnose(armed, waited, warning)

    def _pause(self, inquiry: tuple[object, bool, float] | None) -> float:
        """Seconds until the next look: the poll, or less where a limit or the inquiry's reply window ends
        sooner, so that ranks armed together diagnose together (a rank's abort leaves the others
        :data:`~.abort.ABORT_GRACE` to say theirs)."""
        now = time.monotonic()
        pause = self.poll
        armed = self.armed
        if armed is not None and armed[3]:
            waited = now - armed[0]
            for limit in (self.stall_warning, self.timeout):
                if limit is not None and limit > waited:
                    pause = min(pause, limit - waited)
        if inquiry is not None:
            pause = min(pause, inquiry[2] - now)
        return max(pause, 1e-3)

    def _diagnose(self, armed: tuple[float, Callable[[], str], int, bool], waited: float, warning: bool) -> None:
        """Print the warning (when ``warning``) and, past the timeout, the final diagnosis, and abort.

        When the replies to a warning's inquiry come in after the timeout (a
        rank that does not answer costs the whole reply window), the same
        replies serve for the final diagnosis, which follows at once.
        """
        _, what, call, _ = armed
        mine = Report(call, _describe(what, call), waited)
        inspector = self.inspector
        if not inspector.available:
            missing = f"missing ranks: unknown ({inspector.unavailable_reason})"
        else:
            found = missing_ranks(inspector.size, inspector.rank, mine, inspector.replies())
            missing = ("missing ranks: " + ", ".join(map(str, found)) + " [" + "; ".join(found.values()) + "]"
                       if found else "missing ranks: none (every rank waits in this collective)")
        if warning:
            limit = "" if self.timeout is None else f" until timeout={self.timeout:g} s"
            _say(f"mpi_gradreducer: rank {self.rank}: {mine.waiting} has waited {waited:.1f} s "
                 f"(stall_warning={self.stall_warning:g} s); {missing}; still waiting{limit}.")
        if self.timeout is not None and waited >= self.timeout and self.armed is armed:
            _say(f"mpi_gradreducer: rank {self.rank}: {mine.waiting} has not completed after {waited:.1f} s "
                 f"(timeout={self.timeout:g} s); {missing}. Aborting the job.")
            abort_job(1)


def _describe(what: Callable[[], str], call: int) -> str:
    try:
        return f"call {call}, {what()}"
    except Exception as exc:  # a description must never kill the watchdog
        return f"call {call}, (undescribable collective: {exc!r})"


def _say(line: str) -> None:
    """Write one line to stderr with a single system call, so that ranks' lines never interleave."""
    try:
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, (line + "\n").encode())
