"""Horovod's timeline: ``start_timeline`` and ``stop_timeline`` record every operation into a Chrome trace.

The engine records, per operation, its negotiation (``NEGOTIATE_ALLREDUCE``:
from the call until every rank of its process set had asked for it) and
its data movement (``ALLREDUCE``), each with the operation's name
(``allreduce.<name>``) as the ``tensor`` argument (and the call's wall-clock
time as ``start_time_since_epoch_in_micros``, as Horovod's); with ``mark_cycles``
also a ``CYCLE_START`` mark for each round of the engine that did work.
The file is the package's timeline (:class:`mpi_gradreducer._core.timeline.Timeline`):
one process per rank, one track per phase, clocks aligned to rank 0's;
Perfetto and ``chrome://tracing`` open it. Rank 0 writes it when
``stop_timeline`` is called.
"""

from __future__ import annotations

import os
from typing import Any

from .._core.timeline import Timeline
from .control import check
from .session import current

__all__ = ["start_timeline", "stop_timeline"]


def start_timeline(file_path: Any, mark_cycles: bool = False) -> None:
    """Start recording every operation into ``file_path`` (written by rank 0; collective: every rank calls it).

    Starting again with the same path only changes ``mark_cycles``; with
    another path, the timeline so far is written first.

    Args:
        file_path: where rank 0 writes the trace (JSON).
        mark_cycles: also mark each round of the engine that did work.

    Raises:
        TypeError: ``file_path`` is not a path (on every rank).
    """
    what = "hvd.start_timeline"
    ctx = current(what)
    error = None if isinstance(file_path, (str, os.PathLike)) else \
        TypeError(f"{what}: file_path: expected a path, got {type(file_path).__name__}")
    check(what, (), error)
    if ctx.timeline is not None and ctx.timeline.path == os.fspath(file_path):
        ctx.engine.timeline(ctx.timeline, bool(mark_cycles))
        return
    if ctx.timeline is not None:
        _stop(ctx)
    ctx.timeline = Timeline(ctx.comm, os.fspath(file_path))
    ctx.engine.timeline(ctx.timeline, bool(mark_cycles))


def stop_timeline() -> None:
    """Stop recording; rank 0 writes the file (collective: every rank calls it). Does nothing when not started."""
    what = "hvd.stop_timeline"
    ctx = current(what)
    check(what, [("started", (int(ctx.timeline is not None),))])
    if ctx.timeline is not None:
        _stop(ctx)


def _stop(ctx: Any) -> None:
    timeline, ctx.timeline = ctx.timeline, None
    ctx.engine.timeline(None)
    timeline.close()
