"""A per-rank record of timed phases, written as one Chrome trace-event file.

Every rank records ``(name, start, end)`` intervals measured with
``time.perf_counter()``; :meth:`Timeline.close` gathers them on rank 0, which
writes a JSON file in the trace-event format that Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open: one process per rank,
one track per phase name.

Clocks: ranks on the same host share ``perf_counter`` (a system-wide monotonic
clock), so their times are used as they are. For a rank on another host,
``close`` estimates the offset of its clock from rank 0's with a few
ping-pong exchanges (Cristian's method: the exchange with the shortest round
trip wins, and its error is at most half that round trip).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .topology import Topology

__all__ = ["Timeline"]

#: Ping-pong exchanges per remote rank when estimating clock offsets.
_SYNC_ROUNDS = 8


class Timeline:
    """Timed phases of every rank of a communicator, for a trace viewer.

    Construction and :meth:`record` are local; :meth:`close` is collective.

    Example::

        timeline = Timeline(MPI.COMM_WORLD, "trace.json")
        t0 = time.perf_counter()
        ...
        timeline.record("reduce", t0, time.perf_counter(), step=3, bytes=4096)
        timeline.close()  # every rank; rank 0 writes trace.json

    Args:
        comm: the ranks whose events go into the file. It is only used by
            :meth:`close` (which works on its own duplicate of it), so it
            must not be freed before then.
        path: the file rank 0 writes (other ranks ignore it).
    """

    def __init__(self, comm: MPI.Intracomm, path: str) -> None:
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm: expected an mpi4py intracommunicator, got {comm!r}")
        self._comm = comm
        self._path = os.fspath(path)
        self._rank = comm.Get_rank()
        self._events: list[tuple[str, float, float, dict[str, Any]]] = []
        self._closed = False

    @property
    def path(self) -> str:
        """The file rank 0 writes on :meth:`close`."""
        return self._path

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def record(self, name: str, start: float, end: float, **args: Any) -> None:
        """Add one interval of this rank (local, cheap: appends a tuple).

        Args:
            name: the phase, e.g. ``"reduce"``; each name gets its own track.
            start: ``time.perf_counter()`` when the phase began.
            end: ``time.perf_counter()`` when it ended.
            **args: details shown with the event, e.g. ``bucket=3, bytes=1024``.

        Raises:
            RuntimeError: after :meth:`close`.
            ValueError: if ``end`` is before ``start``.
        """
        if self._closed:
            raise RuntimeError("timeline: record() after close()")
        if end < start:
            raise ValueError(f"end: expected a time not before start={start!r}, got {end!r}")
        self._events.append((str(name), float(start), float(end), args))

    def close(self) -> None:
        """Gather every rank's events; rank 0 writes the trace (collective).

        All traffic is buffer-based: the byte counts with ``Gather``, the
        events as UTF-8 JSON with ``Gatherv``. A second call does nothing.

        Raises:
            OSError: on rank 0, if the file cannot be written (after the
                collective part, so the other ranks are not left waiting).
        """
        if self._closed:
            return
        self._closed = True
        comm = self._comm.Dup()
        try:
            topology = Topology.of(comm)
            offset = _clock_offset(comm, topology.host_of, _SYNC_ROUNDS)
            mine: dict[str, Any] = {
                "offset_us": offset * 1e6,
                "events": [[name, (start - offset) * 1e6, (end - start) * 1e6, args]
                           for name, start, end, args in self._events],
            }
            self._events = []
            try:
                text = json.dumps(mine, default=_jsonable, separators=(",", ":")).encode()
            except (TypeError, ValueError):  # e.g. a dict with non-string keys: never strand the others
                for event in mine["events"]:
                    event[3] = {k: str(v) for k, v in event[3].items()}
                text = json.dumps(mine, separators=(",", ":")).encode()
            parts = _gather_bytes(comm, np.frombuffer(text, dtype=np.uint8))
        finally:
            comm.Free()
        if parts is not None:
            _write(self._path, _trace([json.loads(p) for p in parts], list(topology.names)))


def _clock_offset(comm: MPI.Intracomm, host_of: Sequence[int], rounds: int) -> float:
    """This rank's ``perf_counter`` minus rank 0's, in seconds (collective).

    Zero for ranks on rank 0's host; estimated by ping-pong for the others.

    Args:
        comm: a communicator with no other traffic in flight.
        host_of: the host of every rank (:attr:`.Topology.host_of`).
        rounds: exchanges per remote rank; the shortest round trip wins.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    remote = [r for r in range(1, size) if host_of[r] != host_of[0]]
    buf = np.zeros(1, dtype=np.float64)
    best = (np.inf, 0.0)
    for r in remote:
        for _ in range(rounds):
            if rank == 0:
                comm.Recv(buf, source=r, tag=1)
                buf[0] = time.perf_counter()
                comm.Send(buf, dest=r, tag=2)
            elif rank == r:
                t0 = time.perf_counter()
                comm.Send(buf, dest=0, tag=1)
                comm.Recv(buf, source=0, tag=2)
                t1 = time.perf_counter()
                if t1 - t0 < best[0]:
                    best = (t1 - t0, (t0 + t1) / 2 - float(buf[0]))
    return best[1]


def _gather_bytes(comm: MPI.Intracomm, blob: np.ndarray) -> list[bytes] | None:
    """Every rank's bytes on rank 0 (None elsewhere), with Gather + Gatherv."""
    rank, size = comm.Get_rank(), comm.Get_size()
    count = np.array([blob.size], dtype=np.int64)
    counts = np.empty(size, dtype=np.int64) if rank == 0 else None
    comm.Gather(count, counts, root=0)
    if rank != 0:
        comm.Gatherv(blob, None, root=0)
        return None
    assert counts is not None
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty(int(counts.sum()), dtype=np.uint8)
    comm.Gatherv(blob, [out, counts, displs, MPI.BYTE], root=0)
    return [out[d : d + c].tobytes() for d, c in zip(displs, counts, strict=True)]


def _trace(ranks: list[dict[str, Any]], hosts: list[str]) -> dict[str, Any]:
    """The trace-event document: times from 0 at the earliest event, in microseconds."""
    per_rank = [r["events"] for r in ranks]
    starts = [e[1] for events in per_rank for e in events]
    origin = min(starts) if starts else 0.0
    phases: dict[str, int] = {}
    for events in per_rank:
        for e in events:
            phases.setdefault(e[0], len(phases))
    out: list[dict[str, Any]] = []
    for rank, events in enumerate(per_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        used = sorted({phases[e[0]] for e in events})
        names = {v: k for k, v in phases.items()}
        for tid in used:
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": names[tid]}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"sort_index": tid}})
        for name, ts, dur, args in events:
            out.append({"name": name, "cat": "mpi_gradreducer", "ph": "X", "pid": rank,
                        "tid": phases[name], "ts": round(ts - origin, 3),
                        "dur": round(max(dur, 0.0), 3), "args": args})
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"ranks": len(per_rank), "hosts": hosts,
                      "clock": "time.perf_counter, aligned to rank 0's",
                      "clock_offsets_us": [r["offset_us"] for r in ranks]},
    }


def _write(path: str, doc: dict[str, Any]) -> None:
    """Write JSON to ``path`` atomically (a reader never sees half a file)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays as plain JSON values; anything else as text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
