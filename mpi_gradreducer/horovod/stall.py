"""Horovod's stall inspector: which ranks have not submitted which tensors, and the shutdown after too long.

The first rank of each process set (its coordinator) knows which keys some
ranks have asked for and others have not (:meth:`.Coordinator.stalled`).
After ``HOROVOD_STALL_CHECK_TIME_SECONDS`` it prints, as Horovod does, the
ranks that are missing and the tensors they have not submitted, and with each
what its process waits in instead (the reducer of a ``DistributedOptimizer``,
another process set's operation): the engine asks the missing ranks first
(:meth:`StallInspector.told` takes their answers) and the warning waits for
them for at most :data:`REPLY_WINDOW` seconds (said sooner, with the answers
come so far, when the set is lost or the engine stops: :meth:`flush`); after
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (when set) the engine ends every
rank's operations with :class:`~.exceptions.HorovodInternalError` and
refuses new ones (:meth:`Engine <.engine.Engine>` sends the verdict to every
rank of the set). No MPI here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence

from .negotiation import Coordinator
from .settings import Settings

__all__ = ["StallInspector", "CHECK_EVERY", "REPLY_WINDOW"]

#: How often the coordinator looks for stalled keys (seconds), at most.
CHECK_EVERY = 1.0
#: How long the warning waits for the missing ranks to say what they are doing (an idle engine looks at its
#: messages every second).
REPLY_WINDOW = 2.5


class StallInspector:
    """Watches one coordinator's waiting keys: warns once per key, and says when to shut down.

    Args:
        settings: the stall limits (``stall_check``, ``stall_shutdown``).
        say: writes one message (default: stderr, in one system call).
        ask: ``ask(ranks, inquiry)`` asks these ranks (global) what their
            processes wait in; their answers come through :meth:`told`, with
            the inquiry's number. None: the warning says it at once, without.
        set_id: the process set, for the warning.
    """

    def __init__(self, settings: Settings, say: Callable[[str], None] | None = None,
                 ask: Callable[[list[int], int], None] | None = None, set_id: int = 0) -> None:
        self.check, self.shutdown = settings.stall_check, settings.stall_shutdown
        self.say = _say if say is None else say
        self.ask, self.set_id = ask, set_id
        self._warned: set[str] = set()
        self._next = 0.0
        #: The warning that waits for answers: its stalled keys, its deadline and the ranks asked.
        self._inquiry: tuple[dict[str, list[int]], float, set[int]] | None = None
        self._told: dict[int, tuple[str, ...]] = {}
        self._inquiries = 0  # the number of the latest inquiry (a late answer to an earlier one is dropped)

    def told(self, rank: int, inquiry: int, what: Sequence[str]) -> None:
        """Take rank ``rank``'s answer to inquiry ``inquiry``: what its process waits in (nothing: no operation
        that Horovod knows of)."""
        if self._inquiry is not None and inquiry == self._inquiries and rank in self._inquiry[2]:
            self._told[rank] = tuple(what)

    def flush(self) -> None:
        """Say the warning that waits for answers now, with those come so far (the set is lost, or the engine
        stops: no more answers will be heard)."""
        inquiry, self._inquiry = self._inquiry, None
        if inquiry is not None:
            assert self.check is not None
            self.say(warning(inquiry[0], self.check, self.set_id, self._told))

    def inspect(self, coordinator: Coordinator, now: float | None = None) -> str | None:
        """Warn about keys stalled past the check time; the shutdown message when one is past the shutdown time.

        Cheap when called often: it looks at most every :data:`CHECK_EVERY` seconds.
        """
        now = time.monotonic() if now is None else now
        limits = [t for t in (self.check, self.shutdown) if t is not None]
        inquiry = self._inquiry
        if inquiry is not None and (now >= inquiry[1] or set(self._told) >= inquiry[2]):
            self.flush()
        if not limits or now < self._next:
            return None
        self._next = now + min(CHECK_EVERY, min(limits) / 4)
        stalled = coordinator.stalled(min(limits), now)
        if not stalled:
            return None
        fresh = {k: v for k, v in stalled.items() if k not in self._warned}
        if self.check is not None and fresh and self._inquiry is None:
            checked = {k: v for k, v in fresh.items() if now - coordinator.since[k] >= self.check}
            if checked:
                self._warned.update(checked)
                if self.ask is None:
                    self.say(warning(checked, self.check, self.set_id))
                else:
                    ranks = {r for missing_ranks in checked.values() for r in missing_ranks}
                    self._inquiries += 1
                    self._inquiry, self._told = (checked, now + REPLY_WINDOW, ranks), {}
                    self.ask(sorted(ranks), self._inquiries)
        if self.shutdown is not None:
            over = {k: v for k, v in stalled.items() if now - coordinator.since[k] >= self.shutdown}
            if over:
                self.flush()  # the warning first, with the answers come so far
                return (f"Horovod has been shut down: {missing(over)} after "
                        f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown:g}; every operation of every rank "
                        "fails from now on")
        return None


def missing(stalled: dict[str, list[int]]) -> str:
    """``rank 1 has not submitted [a, b]; rank 2 has not submitted [a]``."""
    by_rank: dict[int, list[str]] = {}
    for key, ranks in stalled.items():
        for r in ranks:
            by_rank.setdefault(r, []).append(key)
    return "; ".join(f"rank {r} has not submitted [{', '.join(keys)}]" for r, keys in sorted(by_rank.items()))


def warning(stalled: dict[str, list[int]], seconds: float, set_id: int = 0,
            told: dict[int, tuple[str, ...]] | None = None) -> str:
    """The stall warning: Horovod's content (the missing ranks, each with the tensors it has not submitted), and
    what each missing rank's process waits in instead, where it told (``told``, by rank)."""
    lines = [f"[mpi_gradreducer.horovod] One or more tensors were submitted by some ranks of process set {set_id} and "
             f"have waited more than {seconds:g} s for the others (HOROVOD_STALL_CHECK_TIME_SECONDS): different ranks "
             "may be submitting different tensors, or only some of them submitting any, which deadlocks.",
             "Missing ranks:"]
    by_rank: dict[int, list[str]] = {}
    for key, ranks in stalled.items():
        for r in ranks:
            by_rank.setdefault(r, []).append(key)
    for r, keys in sorted(by_rank.items()):
        line = f"{r}: [{', '.join(keys)}]"
        if told is not None:
            what = told.get(r)
            line += (" (no answer to what it waits in)" if what is None else
                     f" (it waits in {'; and in '.join(what)})" if what else
                     " (it waits in no operation that Horovod knows of)")
        lines.append(line)
    return "\n".join(lines)


def _say(text: str) -> None:
    try:
        sys.stderr.flush()
    except Exception:  # a closed stderr must not kill the engine
        pass
    os.write(2, (text + "\n").encode())
