"""Horovod's stall inspector: which ranks have not submitted which tensors, and the shutdown after too long.

The first rank of each process set (its coordinator) knows which keys some
ranks have asked for and others have not (:meth:`.Coordinator.stalled`).
After ``HOROVOD_STALL_CHECK_TIME_SECONDS`` it prints, as Horovod does, the
ranks that are missing and the tensors they have not submitted; after
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (when set) the engine ends every
rank's operations with :class:`~.exceptions.HorovodInternalError` and
refuses new ones (:meth:`Engine <.engine.Engine>` sends the verdict to every
rank of the set). No MPI here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from .negotiation import Coordinator
from .settings import Settings

__all__ = ["StallInspector", "CHECK_EVERY"]

#: How often the coordinator looks for stalled keys (seconds), at most.
CHECK_EVERY = 1.0


class StallInspector:
    """Watches one coordinator's waiting keys: warns once per key, and says when to shut down.

    Args:
        settings: the stall limits (``stall_check``, ``stall_shutdown``).
        say: writes one message (default: stderr, in one system call).
    """

    def __init__(self, settings: Settings, say: Callable[[str], None] | None = None) -> None:
        self.check, self.shutdown = settings.stall_check, settings.stall_shutdown
        self.say = _say if say is None else say
        self._warned: set[str] = set()
        self._next = 0.0

    def inspect(self, coordinator: Coordinator, now: float | None = None) -> str | None:
        """Warn about keys stalled past the check time; the shutdown message when one is past the shutdown time.

        Cheap when called often: it looks at most every :data:`CHECK_EVERY` seconds.
        """
        now = time.monotonic() if now is None else now
        limits = [t for t in (self.check, self.shutdown) if t is not None]
        if not limits or now < self._next:
            return None
        self._next = now + min(CHECK_EVERY, min(limits) / 4)
        stalled = coordinator.stalled(min(limits), now)
        if not stalled:
            return None
        fresh = {k: v for k, v in stalled.items() if k not in self._warned}
        if self.check is not None and fresh:
            checked = {k: v for k, v in fresh.items() if now - coordinator.since[k] >= self.check}
            if checked:
                self._warned.update(checked)
                self.say(warning(checked, self.check))
        if self.shutdown is not None:
            over = {k: v for k, v in stalled.items() if now - coordinator.since[k] >= self.shutdown}
            if over:
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


def warning(stalled: dict[str, list[int]], seconds: float) -> str:
    """The stall warning: Horovod's content (the missing ranks, each with the tensors it has not submitted)."""
    lines = [f"[mpi_gradreducer.horovod] One or more tensors were submitted by some ranks of a process set and have "
             f"waited more than {seconds:g} s for the others (HOROVOD_STALL_CHECK_TIME_SECONDS): different ranks may "
             "be submitting different tensors, or only some of them submitting any, which deadlocks.",
             "Missing ranks:"]
    by_rank: dict[int, list[str]] = {}
    for key, ranks in stalled.items():
        for r in ranks:
            by_rank.setdefault(r, []).append(key)
    lines += [f"{r}: [{', '.join(keys)}]" for r, keys in sorted(by_rank.items())]
    return "\n".join(lines)


def _say(text: str) -> None:
    try:
        sys.stderr.flush()
    except Exception:  # a closed stderr must not kill the engine
        pass
    os.write(2, (text + "\n").encode())
