"""Unit tests of the watchdog's parts that need no second rank (single process)."""

from __future__ import annotations

import sys
import threading

import pytest
from mpi4py import MPI

from mpi_gradreducer._core.excepthook import UncaughtAbort
from mpi_gradreducer._core.stall import Report, StallInspector, missing_ranks
from mpi_gradreducer._core.watchdog import Watchdog


def test_missing_ranks_are_those_not_in_the_same_collective_of_the_same_call():
    mine = Report(4, "call 4, bucket 0 (64 bytes)", 61.0)
    replies = {
        0: Report(4, "call 4, bucket 0 (64 bytes)", 60.5),  # arrived
        1: Report(3, None, 0.0),  # computing
        3: Report(5, "call 5, bucket 0 (64 bytes)", 1.0),  # ahead, in another collective
        4: Report(0, None, 0.0, ("hvd.allreduce 'loss' in process set 0, submitted 2.0 s ago",)),  # elsewhere
    }
    found = missing_ranks(6, 2, mine, replies)
    assert found == {
        1: "rank 1: not in a collective since call 3",
        3: "rank 3: waiting in call 5, bucket 0 (64 bytes) for 1.0 s",
        4: "rank 4: not in a collective, before its first call, and in hvd.allreduce 'loss' in process set 0, "
           "submitted 2.0 s ago",
        5: "rank 5: no answer (exited, or stuck in native code)",
    }


def test_inspector_over_one_rank_has_every_answer_at_once():
    inspector = StallInspector(MPI.COMM_SELF)
    try:
        inspector.ask()
        inspector.serve(lambda: Report(1, None, 0.0))
        assert inspector.answered() and inspector.replies() == {}
    finally:
        inspector.close()
        inspector.close()  # idempotent


def test_watchdog_close_stops_its_thread_and_is_idempotent():
    before = {t.ident for t in threading.enumerate()}
    wd = Watchdog(MPI.COMM_SELF, timeout=None, stall_warning=None)
    wd.arm(lambda: "bucket 0 (8 bytes)", 1)
    wd.disarm()
    ours = [t for t in threading.enumerate() if t.ident not in before and t.name == "mpi_gradreducer-watchdog"]
    assert len(ours) == 1
    wd.close()
    wd.close()
    assert not ours[0].is_alive()


def test_watchdog_over_one_rank_leaves_the_excepthook_alone():
    hook = sys.excepthook
    wd = Watchdog(MPI.COMM_SELF, timeout=None, stall_warning=None)
    try:
        assert sys.excepthook is hook
    finally:
        wd.close()


def test_excepthook_is_counted_chained_and_restored(monkeypatch: pytest.MonkeyPatch):
    seen = []

    def previous(*exc_info):
        seen.append(exc_info[0])

    monkeypatch.setattr(sys, "excepthook", previous)
    uncaught = UncaughtAbort()
    assert uncaught.acquire() and uncaught.acquire()
    assert sys.excepthook is uncaught and uncaught.installed
    uncaught.release()
    assert sys.excepthook is uncaught, "released before the last reference"
    uncaught.release()
    assert sys.excepthook is previous and not uncaught.installed
    uncaught.release()  # one too many: harmless
    assert sys.excepthook is previous
    uncaught(KeyError, KeyError("k"), None)  # not installed: only chains, does not abort
    assert seen == [KeyError]
