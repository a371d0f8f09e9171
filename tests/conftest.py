"""Shared fixtures, and the rule that a failure on one rank ends the whole job.

Collective tests are marked ``mpi`` and run under ``mpiexec -n N python -m
pytest --only-mpi`` (and at size 1 with ``--with-mpi``). When a test fails on
one rank while the others go on to the next collective, the job would hang:
instead the failing rank prints its report to stderr and aborts the job. A
test that hangs (a rank that never arrives, a job that never ends) is ended
by its time limit: each rank prints the test's name and its threads' stacks,
and aborts the job.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.util
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpi_gradreducer import jobs
from mpi_gradreducer.launch import Launcher, find_mpiexec

WORLD = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"


#: The tests this rank skipped (each skip must be decided alike on every rank: see ``pytest_sessionfinish``).
_SKIPPED = pytest.StashKey[list[str]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        item.config.stash.setdefault(_SKIPPED, []).append(item.nodeid)
    if report.failed and WORLD.Get_size() > 1:
        sys.stderr.write(
            f"\n=== rank {WORLD.Get_rank()} of {WORLD.Get_size()}: {item.nodeid} failed "
            f"({report.when}); aborting the job so that no rank hangs ===\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        WORLD.Abort(1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under mpiexec, fail the run when the ranks skipped different tests.

    A skip decided on one rank alone leaves the other ranks waiting in any collective that follows; where
    none followed, the run passed all the same. Every skip must be decided alike on every rank.
    """
    if WORLD.Get_size() == 1:
        return
    mine = sorted(set(session.config.stash.get(_SKIPPED, [])))
    every = WORLD.allgather(mine)
    if all(skips == every[0] for skips in every):
        return
    union = sorted(set().union(*every))
    lines = [f"  {nodeid}: skipped on rank(s) {[r for r, s in enumerate(every) if nodeid in s]}"
             for nodeid in union if any(nodeid not in s for s in every)]
    sys.stderr.write(f"\n=== rank {WORLD.Get_rank()}: the ranks skipped different tests (every skip must be "
                     "decided alike on every rank) ===\n" + "\n".join(lines) + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


#: Seconds a collective test (marked ``mpi``) may take, setup and teardown included, before the job is ended
#: with its name: five times the slowest on this 2-core machine loaded by other jobs (35 s at 2 hosts x 2 ranks).
COLLECTIVE_LIMIT = 180.0
#: The same for every other test: those that launch whole jobs hold each job to a shorter limit of their own.
TEST_LIMIT = 600.0
#: After the limit, the grace for a test whose thread holds the interpreter (no Python runs to report it):
#: then only the stacks are printed, and the process exits.
_BACKSTOP = 30.0
#: Seconds a rank past a test's limit waits for the others' reports before it aborts the job.
_REPORTS = 2.0


def _limit(item: pytest.Item) -> float:
    """The test's time limit: ``@pytest.mark.limit(seconds)``, else by kind."""
    marker = item.get_closest_marker("limit")
    if marker is not None:
        return float(marker.args[0])
    return COLLECTIVE_LIMIT if item.get_closest_marker("mpi") is not None else TEST_LIMIT


#: A descriptor of this process's stderr as it was before pytest captured it (see ``pytest_configure``).
_STDERR = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Keep this process's own stderr: what a test prints is captured, but its time limit is reported there."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture()
    try:
        config.stash[_STDERR] = os.dup(2)
    finally:
        if capman is not None:
            capman.resume_global_capture()


def _expire(nodeid: str, seconds: float, stderr: int) -> None:
    """Test ``nodeid`` ran past its limit: write its name and every thread's stack to ``stderr`` (in one
    write, so that ranks' reports do not interleave), and end the job once the other ranks, whose limits
    pass at about the same time, have written theirs."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        stacks = f.read().decode(errors="replace")
    os.write(stderr, (f"\n=== rank {WORLD.Get_rank()} of {WORLD.Get_size()}: {nodeid} ran past its time limit of "
                      f"{seconds:g} s; aborting the job ===\n{stacks}").encode())
    time.sleep(_REPORTS)
    WORLD.Abort(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Every test runs under a time limit (see ``_limit``): past it, the test is named and the job ended."""
    seconds, stderr = _limit(item), item.config.stash[_STDERR]
    timer = threading.Timer(seconds, _expire, (item.nodeid, seconds, stderr))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + _BACKSTOP, exit=True, file=stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        timer.cancel()


@pytest.fixture(params=["world", "self", "dup"])
def comm(request: pytest.FixtureRequest):
    """The same test body over several communicators (mpi4py's habit)."""
    if request.param == "world":
        yield WORLD
    elif request.param == "self":
        yield MPI.COMM_SELF
    else:
        c = WORLD.Dup()
        yield c
        c.Free()


def rank_value(comm: MPI.Comm, k: float = 0.0) -> float:
    """ChainerMN's oracle: rank r contributes r + k."""
    return comm.Get_rank() + k


def expected_mean(comm: MPI.Comm, k: float = 0.0) -> float:
    """The mean of r + k over the ranks of ``comm``."""
    return (comm.Get_size() - 1) / 2 + k


def assert_same_on_all_ranks(comm: MPI.Comm, arrays) -> None:
    """Every rank holds bitwise the same bytes (checked by rank 0's copy)."""
    blob = (np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays]) if arrays
            else np.zeros(0, np.uint8))
    root = blob.copy()
    comm.Bcast(root, root=0)
    same = np.array([int(np.array_equal(root, blob))], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, same, op=MPI.MIN)
    assert same[0] == 1, "results differ between ranks"


def everywhere(flag: bool) -> bool:
    """True only when ``flag`` holds on every rank (a decision, such as a skip, that all ranks share); collective."""
    value = np.array([int(flag)], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
    return bool(value[0])


def lockstep_settings(max_examples: int):
    """Hypothesis settings under which every rank draws the same examples in the same order.

    Derandomized, no example database, no deadline or health check that one
    rank could trip alone, and no report of several bugs (each would need
    more examples on some ranks than on others).
    """
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    report_multiple_bugs=False, print_blob=False)


#: Bytes of a failure report shared by :func:`agree_on_failures`.
_REPORT_BYTES = 4096


def agree_on_failures(failures: list[str]) -> None:
    """Raise the same AssertionError on every rank when any rank has failures (the lowest such rank's)."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    first = np.array([rank if failures else size], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, first, op=MPI.MIN)
    who = int(first[0])
    if who == size:
        return
    message = np.zeros(_REPORT_BYTES, dtype=np.uint8)
    if rank == who:
        text = "\n".join(failures).encode()[:_REPORT_BYTES]
        message[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    WORLD.Bcast(message, root=who)
    raise AssertionError(f"rank {who}: " + bytes(message).rstrip(b"\0").decode(errors="replace"))


#: Whether torch can be imported in this process.
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def torch():
    """torch (one thread), when every rank has it; else the test skips on every rank."""
    if not everywhere(HAS_TORCH):
        pytest.skip("needs torch on every rank")
    import torch as th

    th.set_num_threads(1)
    return th


@pytest.fixture(scope="module")
def hvd(torch):
    """``mpi_gradreducer.horovod``, initialized (shut down after the module's tests)."""
    import mpi_gradreducer.horovod as module

    module.init()
    yield module
    module.shutdown()


#: Hard limit on one job that :func:`run_job` starts, unless the test gives its own.
JOB_LIMIT = 60.0
#: The environment variable that marks every process of a job that :func:`run_job` starts (its value
#: is unique to the job): how the processes that outlive ``mpiexec`` are found, whatever their session.
JOB_MARK = "MPI_GRADREDUCER_TEST_JOB"
#: Variables of this process that a job does not get: an enclosing launch's, the library's own settings,
#: mpi4py's runtime options, and unbuffered output (what a test parses must be flushed by the code).
JOB_STRIPPED = ("PMI_", "PMIX_", "HYDRA_", "PRTE_", "MPIR_", "OMPI_", "I_MPI_", "MPI_GRADREDUCER_", "MPI4PY_",
                "PYTHONUNBUFFERED")


@dataclass
class Job:
    """What a finished job left behind."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    command: list[str]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines(self, pattern: str) -> list[re.Match]:
        """The stdout lines that match ``pattern`` in full."""
        return [m for m in map(re.compile(pattern).fullmatch, self.stdout.splitlines()) if m]

    def __str__(self) -> str:
        return (f"`{' '.join(self.command)}`: exit status {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")


@functools.cache
def job_launcher() -> Launcher | None:
    """The launcher that jobs start with: the ``mpiexec`` beside this Python, else on ``PATH``; None if none."""
    path = find_mpiexec()
    return None if path is None else Launcher.detect(path)


def run_job(script: str, *args: str, ranks: int = 4, runner: bool = True, module: bool = False,
            limit: float = JOB_LIMIT, env: dict[str, str] | None = None, fault_tolerance: bool = False,
            tag_output: bool = False) -> Job:
    """Run ``mpiexec -n RANKS python [-m mpi4py] SCRIPT ARGS`` from the repository, to its end.

    The one way the tests start a whole MPI job, under whichever MPI this
    Python has (:mod:`mpi_gradreducer.launch` writes each launcher's command
    line; more ranks than cores are allowed). The job runs in a session of
    its own, with none of this process's :data:`JOB_STRIPPED` variables, one
    OpenMP thread per rank and the repository on ``PYTHONPATH``; ``env`` adds
    to that. Every process of the job carries :data:`JOB_MARK` in its
    environment. Past ``limit`` seconds, the whole job is ended (its process
    group and every process below ``mpiexec``: :func:`mpi_gradreducer.jobs.run`),
    every marked process, in whatever session the launcher put it, is killed,
    and the test fails; it also fails
    when any process of the job outlives ``mpiexec`` (named, then killed), or
    survives the kill. Skipped, on every rank alike, where there is no
    ``mpiexec`` or pytest itself runs on several ranks.

    Args:
        script: a path (relative ones from ``tests/jobs``), or a module name with ``module=True``.
        args: the script's arguments.
        ranks: the job's size.
        runner: start it under mpi4py's runner (``-m mpi4py``: an exception on any rank aborts the job).
        module: ``script`` is a module to run as ``python -m``.
        limit: seconds the job may take.
        env: more environment variables for the job.
        fault_tolerance: start it with ULFM (``--with-ft ulfm``; skipped where the MPI has none).
        tag_output: every output line prefixed with its rank (the launcher's way; see ``Launcher.untag``).
    """
    if WORLD.Get_size() > 1:
        pytest.skip("launches its own MPI jobs: run from a single process")
    launcher = job_launcher()
    if launcher is None:
        pytest.skip("no mpiexec beside this Python or on PATH")
    if fault_tolerance and not launcher.supports_ulfm:
        pytest.skip(f"needs ULFM: {launcher.vendor}'s mpiexec has none")
    target = ["-m", script] if module else [str(JOBS / script)]
    program = [sys.executable, *(["-m", "mpi4py"] if runner else []), *target, *args]
    cmd = launcher.command(program, ranks=ranks, oversubscribe=True, fault_tolerance=fault_tolerance,
                           tag_output=tag_output)
    mark = uuid.uuid4().hex
    job_env = {k: v for k, v in os.environ.items() if not k.startswith(JOB_STRIPPED)}
    job_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([job_env["PYTHONPATH"]] if job_env.get("PYTHONPATH")
                                                          else []))
    job_env["OMP_NUM_THREADS"] = "1"
    job_env.update(env or {})
    job_env = launcher.environment(job_env)
    job_env[JOB_MARK] = mark
    done = jobs.run(cmd, timeout=limit, cwd=ROOT, env=job_env)
    if done.timed_out:
        survivors = kill_marked(mark)
        pytest.fail(f"the job did not end within {limit:g} s and was killed: {' '.join(cmd)}"
                    + (f"\nprocesses that survived SIGKILL: {describe(survivors)}" if survivors else "")
                    + f"\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    job = Job(done.returncode, done.stdout, done.stderr, done.seconds, cmd)
    deadline = time.monotonic() + 5
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked(mark)
    if left:
        survivors = kill_marked(mark)
        pytest.fail(f"processes of the job outlived mpiexec: {describe(left)}"
                    + (f"; these survived SIGKILL: {describe(survivors)}" if survivors else "") + f"\n{job}")
    return job


def marked(mark: str) -> dict[int, str]:
    """Live processes whose environment holds ``JOB_MARK=mark``: pid to command line (Linux; elsewhere none)."""
    return jobs.marked(JOB_MARK, mark)


def describe(procs: dict[int, str]) -> str:
    return "; ".join(f"pid {pid}: {cmd[:100]}" for pid, cmd in sorted(procs.items()))


def kill_marked(mark: str) -> dict[int, str]:
    """SIGKILL every process marked with ``mark`` (those that left the job's group and tree included).

    Returns:
        The marked processes still alive 5 s later (pid to command line): none, unless a kill failed.
    """
    return jobs.kill_marked(JOB_MARK, mark)


def cluster_unavailable() -> str | None:
    """Why ``scripts/cluster.py`` cannot make a cluster here, or None when it can.

    Asked from a single process only (the tests that make clusters launch their own jobs).
    """
    if WORLD.Get_size() > 1:
        return "launches its own MPI jobs: run from a single process"
    script = Path(__file__).resolve().parents[1] / "scripts" / "cluster.py"
    done = jobs.run([sys.executable, str(script), "check"], timeout=60)
    if done.timed_out:
        return "no cluster of network namespaces here: `cluster.py check` ran past 60 s"
    return None if done.returncode == 0 else f"no cluster of network namespaces here: {done.stderr.strip()}"


def _cupy_devices() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device
        return 0


@pytest.fixture(scope="session")
def cupy():
    """cupy with a usable GPU on every rank, else the test is skipped on every rank."""
    available = np.array([_cupy_devices()], dtype=np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, available, op=MPI.MIN)  # the same decision everywhere
    if available[0] == 0:
        pytest.skip("needs cupy and a CUDA device on every rank")
    import cupy as cp

    from mpi_gradreducer import select_device

    select_device(WORLD)
    return cp
