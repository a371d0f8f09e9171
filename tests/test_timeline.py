"""``Timeline``: every rank's events in one Chrome trace-event file, written by rank 0."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from mpi_gradreducer._core.timeline import Timeline, _clock_offset

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


@pytest.fixture
def trace_path() -> Iterator[str]:
    """A path in a fresh directory made by rank 0 (the only rank that writes)."""
    directory = tempfile.mkdtemp(prefix="timeline-") if WORLD.Get_rank() == 0 else ""
    directory = WORLD.bcast(directory, root=0)
    yield os.path.join(directory, "trace.json")
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


def _load_on_root(path: str) -> Any:
    """Rank 0's parsed trace, or None on the other ranks."""
    if WORLD.Get_rank() != 0:
        return None
    with open(path) as f:
        return json.load(f)


def _problems(doc: Any, size: int) -> list[str]:
    """What is wrong with a trace-event document (empty: nothing)."""
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
    else:
        events = doc
    if not isinstance(events, list):
        return ["no list of events"]
    problems = []
    for e in events:
        missing = {"name", "ph", "pid", "tid"} - set(e)
        if missing:
            problems.append(f"event {e} lacks {sorted(missing)}")
        if e.get("ph") == "X":
            if not {"ts", "dur"} <= set(e):
                problems.append(f"complete event {e} lacks ts or dur")
            elif not (isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))):
                problems.append(f"event {e}: ts and dur must be numbers")
            elif e["dur"] < 0 or e["ts"] < 0:
                problems.append(f"event {e}: negative ts or dur")
            if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
                problems.append(f"event {e}: pid and tid must be ints")
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    if names != {r: f"rank {r}" for r in range(size)}:
        problems.append(f"process names {names}, expected rank 0 .. rank {size - 1}")
    return problems


def _agree(verdict: Any) -> Any:
    """Rank 0's verdict on every rank, so that all ranks assert the same."""
    return WORLD.bcast(verdict, root=0)


def test_every_rank_every_phase_in_one_valid_trace(trace_path: str) -> None:
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    timeline = Timeline(WORLD, trace_path)
    for call in range(3):
        t0 = time.perf_counter()
        t1 = t0 + 0.001 * (rank + 1)
        timeline.record("compute", t0, t1, call=call)
        timeline.record("reduce", t1, t1 + 0.0005, call=np.int64(call), bytes=np.int32(1024), bucket=2)
    timeline.close()
    doc = _load_on_root(trace_path)
    verdict = None
    if rank == 0:
        verdict = _problems(doc, size)
        xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        if sorted({e["pid"] for e in xs}) != list(range(size)):
            verdict.append(f"ranks with events: {sorted({e['pid'] for e in xs})}")
        if len(xs) != 6 * size:
            verdict.append(f"{len(xs)} events, expected {6 * size}")
        for r in range(size):
            mine = [e for e in xs if e["pid"] == r and e["name"] == "compute"]
            if [e["args"]["call"] for e in mine] != [0, 1, 2]:
                verdict.append(f"rank {r}: compute calls {[e['args'] for e in mine]}")
            if any(abs(e["dur"] - 1000.0 * (r + 1)) > 1e-3 for e in mine):
                verdict.append(f"rank {r}: compute durations {[e['dur'] for e in mine]} us")
        reduce = [e for e in xs if e["name"] == "reduce"]
        if any(e["args"] != {"call": e["args"]["call"], "bytes": 1024, "bucket": 2} for e in reduce):
            verdict.append(f"reduce args {[e['args'] for e in reduce][:3]}")
        tids = {(e["name"], e["tid"]) for e in xs}
        if len({t for _, t in tids}) != 2 or len(tids) != 2:
            verdict.append(f"expected one track per phase, got {sorted(tids)}")
        if min(e["ts"] for e in xs) != 0:
            verdict.append("the earliest event should start at 0")
    assert _agree(verdict) == []


def test_a_barrier_orders_events_across_ranks(trace_path: str) -> None:
    """Clocks are aligned: whatever ends before a barrier precedes whatever starts after it."""
    timeline = Timeline(WORLD, trace_path)
    time.sleep(0.01 * WORLD.Get_rank())
    t0 = time.perf_counter()
    time.sleep(0.002)
    timeline.record("before", t0, time.perf_counter())
    WORLD.Barrier()
    t1 = time.perf_counter()
    timeline.record("after", t1, t1 + 0.001)
    timeline.close()
    doc = _load_on_root(trace_path)
    verdict = None
    if WORLD.Get_rank() == 0:
        xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        last_end = max(e["ts"] + e["dur"] for e in xs if e["name"] == "before")
        first_start = min(e["ts"] for e in xs if e["name"] == "after")
        verdict = (last_end, first_start)
    last_end, first_start = _agree(verdict)
    assert last_end <= first_start + 1.0  # microseconds: rounding only


def test_ranks_without_events_and_close_twice(trace_path: str) -> None:
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    timeline = Timeline(WORLD, trace_path)
    if rank % 2 == 0:
        t = time.perf_counter()
        timeline.record("even only", t, t + 1e-4, note=object())  # not JSON: written as text
        timeline.record("even only", t, t + 1e-4, table={(1, 2): 3})  # not even valid keys
    timeline.close()
    timeline.close()  # idempotent: no second collective
    assert timeline.closed
    with pytest.raises(RuntimeError, match="after close"):
        timeline.record("late", 0.0, 1.0)
    doc = _load_on_root(trace_path)
    verdict = None
    if rank == 0:
        verdict = _problems(doc, size)
        pids = sorted(e["pid"] for e in doc["traceEvents"] if e["ph"] == "X")
        if pids != sorted(2 * list(range(0, size, 2))):
            verdict.append(f"events from ranks {pids}")
    assert _agree(verdict) == []


def test_sub_communicator_ranks_are_numbered_within_it(trace_path: str) -> None:
    rank = WORLD.Get_rank()
    sub = WORLD.Split(rank % 2, rank)
    try:
        path = trace_path if rank % 2 == 0 else trace_path + ".odd"
        timeline = Timeline(sub, path)
        t = time.perf_counter()
        timeline.record("step", t, t + 1e-3, world_rank=rank)
        timeline.close()
        verdict = None
        if sub.Get_rank() == 0:
            with open(path) as f:
                doc = json.load(f)
            verdict = _problems(doc, sub.Get_size())
            got = sorted(e["args"]["world_rank"] for e in doc["traceEvents"] if e["ph"] == "X")
            if got != list(range(rank % 2, WORLD.Get_size(), 2)):
                verdict.append(f"world ranks {got}")
        assert sub.bcast(verdict, root=0) == []
    finally:
        sub.Free()


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="comm"):
        Timeline(None, "x.json")  # type: ignore[arg-type]
    timeline = Timeline(MPI.COMM_SELF, os.devnull)
    with pytest.raises(ValueError, match="end"):
        timeline.record("backwards", 2.0, 1.0)


def test_offset_estimate_by_ping_pong_is_near_zero_on_one_host() -> None:
    """The cross-host path, forced by giving every rank a host of its own."""
    comm = WORLD.Dup()
    try:
        offset = _clock_offset(comm, range(comm.Get_size()), rounds=8)  # every rank a host of its own
        same = _clock_offset(comm, [0] * comm.Get_size(), rounds=8)
    finally:
        comm.Free()
    assert same == 0.0
    # perf_counter is one clock on one host: the estimate is off by at most
    # half the shortest round trip (generous bound for an oversubscribed machine).
    assert abs(offset) < 0.05
