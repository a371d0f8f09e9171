"""``mpi_gradreducer.horovod``'s stall inspector and lost peers, in real 2-rank jobs (``tests/jobs/horovod_stall.py``).

Each job runs under ``mpiexec`` with a hard limit (:func:`conftest.run_job`):
a hang fails the test instead of the run. Run from a single process.
"""

from __future__ import annotations

import re

import pytest
from mpi4py import MPI

from conftest import run_job

LIMIT = 90.0
#: Farewells are sent under MPICH only (see ``Engine._farewell``): the same answer in every process.
FAREWELLS = pytest.mark.skipif(not MPI.Get_library_version().startswith("MPICH"),
                               reason="a leaving rank tells the others under MPICH only")


def _job(mode: str, ranks: int = 2, **env: str):
    return run_job("horovod_stall.py", mode, ranks=ranks, runner=False, limit=LIMIT, env=env)


def _seconds(job, pattern: str) -> float:
    found = re.search(pattern + r" after ([0-9.]+) s", job.stdout)
    assert found, str(job)
    return float(found.group(1))


def test_the_stall_warning_names_the_missing_rank_and_tensor():
    job = _job("warn", HOROVOD_STALL_CHECK_TIME_SECONDS="2")
    assert job.returncode == 0, str(job)
    assert "HOROVOD_STALL_CHECK_TIME_SECONDS" in job.stderr, str(job)
    assert re.search(r"Missing ranks:\n1: \[only_rank0\]", job.stderr), str(job)
    assert job.stdout.count("returned [2.0,") == 2, str(job)  # the late rank completes it: a warning only


def test_no_warning_when_the_stall_check_is_disabled():
    job = _job("warn", HOROVOD_STALL_CHECK_TIME_SECONDS="2", HOROVOD_STALL_CHECK_DISABLE="1")
    assert job.returncode == 0, str(job)
    assert "Missing ranks" not in job.stderr, str(job)


def test_the_stall_shutdown_ends_every_rank_with_an_error():
    job = _job("shutdown", HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="3")
    assert job.returncode == 0, str(job)
    waited = _seconds(job, r"rank 0: only_rank0 raised HorovodInternalError")
    assert 3.0 <= waited < 20.0, str(job)
    assert re.search(r"rank 1: later raised HorovodInternalError after [0-9.]+ s: .*HOROVOD_STALL_SHUTDOWN_TIME_"
                     r"SECONDS=3", job.stdout), str(job)
    assert "rank 1 has not submitted [only_rank0]" in job.stdout, str(job)


def test_ranks_in_different_operations_are_named_with_what_each_waits_in():
    """Rank 0 waits in ``hvd.allreduce`` of ``metric``, rank 1 in its optimizer's reduction: Horovod's warning (on
    rank 0) says where rank 1 is, the reducer's (on rank 1) where rank 0 is, each naming the process set."""
    job = _job("crossed", HOROVOD_STALL_CHECK_TIME_SECONDS="2", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="10",
               MPI_GRADREDUCER_STALL_WARNING="2")
    assert job.returncode == 0, str(job)
    assert re.search(r"submitted by some ranks of process set 0 .*\nMissing ranks:\n1: \[metric\] \(it waits in "
                     r"hvd\.DistributedOptimizer's reduction in process set 0: call 1, bucket 0 ", job.stderr), str(job)
    assert re.search(r"mpi_gradreducer: rank 1: call 1, bucket 0 .* has waited [0-9.]+ s \(stall_warning=2 s\); "
                     r"missing ranks: 0 \[rank 0: not in a collective, before its first call, and in hvd\.allreduce "
                     r"'metric' in process set 0, submitted [0-9.]+ s ago\]", job.stderr), str(job)
    # the stall shutdown ends it: rank 0's metric raises, its step then meets rank 1's, rank 1's metric raises
    assert re.search(r"rank 0: metric raised HorovodInternalError after", job.stdout), str(job)
    assert job.stdout.count("step returned") == 2, str(job)
    assert re.search(r"rank 1: metric raised HorovodInternalError", job.stdout), str(job)


@FAREWELLS
@pytest.mark.parametrize("mode", ["exit", "peer-shutdown"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_peer_that_leaves_makes_the_pending_operation_raise_on_every_other_rank(mode, ranks):
    """At 3 ranks the first rank's verdict fails the operation on the second too (a leaving rank's own
    farewell is not enough there: it can overtake the verdict on an operation it took part in)."""
    job = _job(mode, ranks)
    assert job.returncode == 0, str(job)
    last = ranks - 1
    for r in range(last):
        waited = _seconds(job, rf"rank {r}: only_rank0 raised HorovodInternalError")
        assert waited < 20.0, str(job)
    assert job.stdout.count(f"rank {last} left Horovod") == last, str(job)
    if mode == "peer-shutdown":
        assert f"rank {last}: shut down" in job.stdout, str(job)


@FAREWELLS
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_peer_that_leaves_ends_the_others_join_with_an_error(ranks):
    job = _job("join-left", ranks)
    assert job.returncode == 0, str(job)
    last = ranks - 1
    for r in range(last):
        waited = _seconds(job, rf"rank {r}: join raised HorovodInternalError")
        assert waited < 20.0, str(job)
    assert job.stdout.count(f"rank {last} left Horovod") == last, str(job)
