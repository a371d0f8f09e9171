"""What a reducer records about itself and how it is watched: counters, timeline spans, the watchdog."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from .options import Options
from .timeline import Timeline
from .watchdog import Watchdog

__all__ = ["Instrument", "ReducerStats"]


@dataclass
class ReducerStats:
    """Always-on counters of a reducer (cheap: a few clock reads per bucket).

    Attributes:
        calls: completed reductions.
        messages: collective calls made with gradient data (buckets are sent
            in chunks of ``transport.CHUNK_BYTES``, adjacent buckets as one
            run; compressed and row-sparse collectives count too).
        bytes: bytes of the summed data in the format it is sent, summed over
            calls (16 bits a value where compression casts it, also where
            only what crosses hosts is cast).
        pack_seconds: time spent copying gradients into fusion buffers.
        allreduce_seconds: time spent in MPI (including in-place scaling).
        unpack_seconds: time spent copying results back (including scaling).
        launches: kernel launches made by device packs and unpacks.
    """

    calls: int = 0
    messages: int = 0
    bytes: int = 0
    pack_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    unpack_seconds: float = 0.0
    launches: int = 0


class Instrument:
    """A reducer's counters, its optional timeline and its optional watchdog.

    Construction is collective (the watchdog's side channel).

    Args:
        comm: the reducer's communicator (the timeline gathers over it at :meth:`close`).
        options: the reducer's options (``timeline``, ``timeout``, ``stall_warning``,
            ``abort_on_exception``, ``elsewhere``).
    """

    def __init__(self, comm: MPI.Intracomm, options: Options) -> None:
        self.stats = ReducerStats()
        self._timeline = Timeline(comm, options.timeline) if options.timeline else None
        timeout, stall, abort = options.timeout, options.stall_warning, options.abort_on_exception
        assert not isinstance(timeout, str) and not isinstance(stall, str) and not isinstance(abort, str), \
            "options not resolved"
        #: The watchdog that times each collective (None once closed).
        self.watchdog: Watchdog | None = Watchdog(comm, timeout, stall, hook=abort, elsewhere=options.elsewhere)
        #: False while :meth:`unwatched`: collectives are then reported but never timed.
        self.watching = True

    @contextmanager
    def unwatched(self) -> Iterator[None]:
        """Collectives made inside are reported to the other ranks' questions, but never timed.

        For a rank in ``join()`` waiting for the others' next call: however
        long they compute, that wait is no stall (a stall inside the call is
        still found by the ranks that wait in it, this one included).
        """
        self.watching = False
        try:
            yield
        finally:
            self.watching = True

    def collective(self, what: Callable[[], str], call: int, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under the watchdog; ``what()`` describes it, as part of call ``call``."""
        wd = self.watchdog
        if wd is None:
            return fn(*args, **kwargs)
        wd.arm(what, call, self.watching)
        try:
            return fn(*args, **kwargs)
        finally:
            wd.disarm()

    def waiting(self) -> str | None:
        """The collective in progress, in words (``call 4, bucket 0 (4096 bytes)``); None when none is."""
        wd = self.watchdog  # read once: close() may drop it meanwhile (another thread asks)
        return None if wd is None else wd.waiting()

    def phases(self, call: int, ks: Sequence[int], nbytes: int, t0: float, t1: float, t2: float,
               t3: float) -> None:
        """Count and trace buckets ``ks``: packed in [t0, t1], reduced in [t1, t2], unpacked in [t2, t3]."""
        if self._timeline is not None:
            args = {"call": call, "bucket": ks[0] if len(ks) == 1 else list(ks), "bytes": nbytes}
            for name, start, end in (("pack", t0, t1), ("allreduce", t1, t2), ("unpack", t2, t3)):
                if end > start:
                    self._timeline.record(name, start, end, **args)
        stats = self.stats
        stats.bytes += nbytes
        stats.pack_seconds += t1 - t0
        stats.allreduce_seconds += t2 - t1
        stats.unpack_seconds += t3 - t2

    def event(self, name: str, start: float, end: float, **args: Any) -> None:
        """Trace one more interval (no counter)."""
        if self._timeline is not None:
            self._timeline.record(name, start, end, **args)

    def communicators(self) -> list[MPI.Intracomm]:
        """The watchdog's side channel, while it runs."""
        return [] if self.watchdog is None else self.watchdog.communicators()

    def close(self, write: bool = True) -> None:
        """Write the timeline (collective; ``write=False`` drops it) and stop the watchdog (local)."""
        if self._timeline is not None:
            if write:
                self._timeline.close()
            self._timeline = None
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
