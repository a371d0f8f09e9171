"""Whole MPI jobs with a fault on one rank: the job must end, and say why, never hang.

Each test launches ``mpiexec -n 4`` on a script in ``tests/jobs/`` as a
subprocess with a hard time limit; on that limit every process of the job is
killed and the test fails. The jobs are launched the documented way::

    mpiexec -n 4 python -m mpi4py train.py

mpi4py's runner (``-m mpi4py``) calls ``MPI_Abort`` when an exception escapes
on any rank, which ends every rank of the job; without it, the reducer's
exception hook does the same while a reducer exists. With that hook turned
off, a rank that raises waits in ``MPI_Finalize`` while the others wait for
it in a collective: only the reducer's watchdog (``timeout=``) then ends the
job (:func:`test_exception_without_the_hook_is_ended_by_the_watchdog`).

The jobs run without ``PYTHONUNBUFFERED``: what the tests parse must reach
the pipe because the library flushes it, not because Python is unbuffered.

These tests are not marked ``mpi``: they run in the single-process session
(``python -m pytest --with-mpi``), are skipped when no ``mpiexec`` is found,
and are skipped when pytest itself runs under ``mpiexec`` with more than one
rank (the same decision on every rank).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import WORLD

ROOT = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().parent / "jobs"
RANKS = 4
#: Hard limit on one job: past it, the job's processes are killed and the test fails.
JOB_LIMIT = 60.0
#: A job with a fault must be over well within this (a healthy one takes ~1 s here).
PROMPT = 20.0


def _find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


MPIEXEC = _find_mpiexec()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec next to the Python executable or on PATH"),
    pytest.mark.skipif(WORLD.Get_size() > 1, reason="launches its own MPI jobs: run from a single process"),
]


@dataclass
class Job:
    """What a finished job left behind."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines(self, pattern: str) -> list[re.Match]:
        """The stdout lines that match ``pattern`` in full."""
        return [m for m in map(re.compile(pattern).fullmatch, self.stdout.splitlines()) if m]

    def __str__(self) -> str:
        return (f"exit status {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")


def run_job(script: str, *args: str, runner: bool = True, limit: float = JOB_LIMIT,
            env: dict[str, str] | None = None) -> Job:
    """Run ``mpiexec -n 4 python [-m mpi4py] tests/jobs/<script> <args>`` to its end.

    Fails the test, after killing every process of the job, when it runs past
    ``limit`` seconds, and also when any rank outlives ``mpiexec``. ``env``
    adds environment variables to the job's (which has no ``MPI_GRADREDUCER_*``
    variables of the caller, and no ``PYTHONUNBUFFERED``).
    """
    tag = uuid.uuid4().hex
    cmd = [MPIEXEC, "-n", str(RANKS), sys.executable, *(["-m", "mpi4py"] if runner else []),
           str(JOBS / script), *args, f"--tag={tag}"]
    extra = env or {}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_GRADREDUCER_", "MPI4PY_"))
           and k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill(proc, tag)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "(not collected)", "(not collected)"
        pytest.fail(f"the job did not end within {limit:g} s and was killed: {' '.join(cmd)}\n"
                    f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    job = Job(proc.returncode, stdout, stderr, time.monotonic() - start)
    deadline = time.monotonic() + 5
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _tagged(tag)
    if left:
        _kill(proc, tag)
        pytest.fail(f"processes {left} of the job outlived mpiexec\n{job}")
    return job


def _tagged(tag: str) -> list[int]:
    """Live processes whose command line holds ``tag`` (Linux; elsewhere none are found)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if tag.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _descendants(root: int) -> list[int]:
    """Processes below ``root`` in the process tree (Linux; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _kill(proc: subprocess.Popen, tag: str) -> None:
    """SIGKILL the job: mpiexec's process group, and the ranks and proxies, which
    the launcher puts in sessions of their own."""
    for pid in set(_descendants(proc.pid) + _tagged(tag)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 5
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)


def _assert_prompt(job: Job) -> None:
    assert job.returncode != 0, f"the job should have failed\n{job}"
    assert job.seconds < PROMPT, f"the job took {job.seconds:.1f} s to end\n{job}"
    assert not job.lines(r"rank \d: finished.*"), f"a rank finished training despite the fault\n{job}"


def test_healthy_job_finishes_in_step():
    """The baseline that the fault tests depart from: same weights on every rank."""
    job = run_job("train.py")
    assert job.returncode == 0, str(job)
    done = job.lines(r"rank (\d): finished, weights ([0-9a-f]+)")
    assert sorted(int(m[1]) for m in done) == list(range(RANKS)), str(job)
    assert len({m[2] for m in done}) == 1, f"the ranks trained different weights\n{job}"


def test_exception_on_one_rank_aborts_the_job_under_the_mpi4py_runner():
    job = run_job("train.py", "--fault=raise", "--rank=2", "--step=4")
    _assert_prompt(job)
    assert "Traceback (most recent call last)" in job.stderr, str(job)
    assert "RuntimeError: injected failure on rank 2 at step 4" in job.stderr, str(job)


def test_exception_without_the_runner_aborts_the_job_at_once():
    """Plain ``python``, no watchdog timeout: the reducer's exception hook ends the job."""
    job = run_job("train.py", "--fault=raise", "--rank=2", "--step=4", "--timeout=none", runner=False,
                  limit=30)
    _assert_prompt(job)
    assert job.seconds < 10, str(job)
    assert "Traceback (most recent call last)" in job.stderr, str(job)
    assert "RuntimeError: injected failure on rank 2 at step 4" in job.stderr, str(job)
    assert re.search(r"mpi_gradreducer: rank 2: uncaught RuntimeError; aborting the job", job.stderr), str(job)
    assert "BAD TERMINATION" not in job.output, f"the abort did not go through MPI_Abort\n{job}"


def test_exception_without_the_hook_is_ended_by_the_watchdog():
    """Hook turned off: the others wait in the call's first message (it carries the call header) until the
    watchdog fires."""
    job = run_job("train.py", "--fault=raise", "--rank=2", "--step=4", "--timeout=2", runner=False,
                  env={"MPI_GRADREDUCER_ABORT_ON_EXCEPTION": "0"})
    _assert_prompt(job)
    assert "RuntimeError: injected failure on rank 2 at step 4" in job.stderr, str(job)
    assert "uncaught RuntimeError" not in job.stderr, str(job)
    fired = re.findall(r"mpi_gradreducer: rank (\d): call 4, bucket 0 \(\d+ bytes\) has not completed "
                       r"after [\d.]+ s \(timeout=2 s\); missing ranks: 2 \[rank 2: no answer", job.stderr)
    assert fired and "2" not in fired, str(job)


def test_rank_killed_mid_reduction_ends_the_job():
    """SIGKILL on rank 2 while the others are in the first bucket's Allreduce (no watchdog)."""
    job = run_job("train.py", "--fault=kill", "--rank=2", "--step=4", "--validate=first")
    _assert_prompt(job)


def test_stalled_rank_is_named_by_the_watchdog_and_the_job_aborted():
    job = run_job("train.py", "--fault=stall", "--rank=2", "--step=4", "--sleep=300",
                  "--validate=first", "--timeout=2")
    _assert_prompt(job)
    (plan,) = job.lines(r"plan: \d+ buckets, bucket 0 = (\d+) bytes")
    assert job.lines(r"rank 2: stalling for 300 s at step 4"), str(job)
    fired = re.findall(r"mpi_gradreducer: rank (\d): call 4, bucket 0 \((\d+) bytes\) has not completed "
                       r"after ([\d.]+) s \(timeout=2 s\); missing ranks: 2 \[rank 2: not in a collective "
                       r"since call 3\]\. Aborting the job\.", job.stderr)
    assert fired, f"no watchdog diagnostic naming call 4, bucket 0\n{job}"
    for rank, nbytes, waited in fired:
        assert rank != "2" and nbytes == plan[1] and float(waited) >= 2, str(job)


def test_mismatched_models_raise_on_every_rank():
    job = run_job("mismatch.py")
    assert job.returncode == 0, str(job)
    expected = {
        "shape": r"parameter 1 is shape \(4,\) float32 .* at rank 0 but shape \(2, 2\) float32 .* at rank 3",
        "dtype": r"parameter 0 is shape \(3, 2\) float32 .* at rank 0 but shape \(3, 2\) float64 .* at rank 1",
        "count": r"the number of parameters is 3 at rank 0 but 4 at rank 3",
        "order": r"parameter 0 is shape \(3, 2\) float32 .* at rank 0 but shape \(2, 2, 2\) float32 .* at rank 2",
    }
    for kind, pattern in expected.items():
        found = job.lines(rf"rank (\d) \| {kind} \| (.*)")
        assert sorted(int(m[1]) for m in found) == list(range(RANKS)), f"{kind}\n{job}"
        assert len({m[2] for m in found}) == 1, f"{kind}: the ranks raised different errors\n{job}"
        assert re.fullmatch(rf"ValueError: the ranks disagree: {pattern}; pass the same .*", found[0][2]), \
            f"{kind}\n{job}"
    after = job.lines(r"rank (\d) \| after \| mean (.*)")
    assert sorted(int(m[1]) for m in after) == list(range(RANKS)), str(job)
    assert {m[2] for m in after} == {"1.5"}, str(job)


def test_bad_grads_on_one_rank_raise_on_every_rank_and_change_nothing():
    job = run_job("bad_grads.py")
    assert job.returncode == 0, str(job)
    expected = {
        "shape": r"rank 1: grads\[1\]: expected shape \(4,\) \(as parameter 1\), got \(5,\)",
        "readonly": r"rank 2: grads\[2\] is read-only, .*",
        "aliased": r"rank 3: grads\[0\] and grads\[1\] share memory, .*",
        "count": r"rank 0: grads: expected 3 arrays .*, got 2",
    }
    for kind, pattern in expected.items():
        found = job.lines(rf"rank (\d) \| {kind} \| unchanged=(\w+) \| (.*)")
        assert sorted(int(m[1]) for m in found) == list(range(RANKS)), f"{kind}\n{job}"
        assert {m[2] for m in found} == {"True"}, f"{kind}: an array changed\n{job}"
        assert len({m[3] for m in found}) == 1, f"{kind}: the ranks raised different errors\n{job}"
        assert re.fullmatch(rf"ValueError: {pattern}", found[0][3]), f"{kind}\n{job}"
    after = job.lines(r"rank (\d) \| after \| mean (.*)")
    assert sorted(int(m[1]) for m in after) == list(range(RANKS)), str(job)
    assert {m[2] for m in after} == {"2.5"}, str(job)


#: For each fault of rank 2: the call the others wait in, what rank 2 is said to be doing, and a
#: timeout that leaves room for the warning (a rank that does not answer costs the 3 s reply window).
STALLS = {
    "stall": (4, r"not in a collective since call 3", 3),
    "busy": (4, r"not in a collective since call 3", 3),
    "skip": (6, r"not in a collective since call 5", 3),
    "exit": (4, r"no answer \(exited, or stuck in native code\)", 5),
}


@pytest.mark.parametrize("fault", list(STALLS))
def test_waiting_ranks_name_the_missing_rank_then_abort(fault: str):
    """``stall_warning=1``: each waiting rank names rank 2 once, waits on, then aborts at the timeout."""
    call, doing, timeout = STALLS[fault]
    job = run_job("train.py", f"--fault={fault}", "--rank=2", "--step=4", "--sleep=300", "--validate=first",
                  "--stall-warning=1", f"--timeout={timeout}", runner=False)
    _assert_prompt(job)
    what = rf"call {call}, bucket 0 \(\d+ bytes\)"
    warned = re.findall(rf"mpi_gradreducer: rank (\d): {what} has waited ([\d.]+) s \(stall_warning=1 s\); "
                        rf"missing ranks: 2 \[rank 2: {doing}\]; still waiting until timeout={timeout} s\.",
                        job.stderr)
    assert sorted(r for r, _ in warned) == ["0", "1", "3"], f"not one warning per waiting rank\n{job}"
    assert all(1 <= float(w) < timeout for _, w in warned), str(job)
    aborted = re.findall(rf"mpi_gradreducer: rank (\d): {what} has not completed after ([\d.]+) s "
                         rf"\(timeout={timeout} s\); missing ranks: 2 \[rank 2: {doing}\]\. Aborting the job\.",
                         job.stderr)
    assert aborted and all(r != "2" and float(w) >= timeout for r, w in aborted), str(job)
    assert job.stderr.index("has waited") < job.stderr.index("has not completed"), str(job)


def test_missing_ranks_are_unknown_without_thread_multiple():
    """With ``MPI_THREAD_SERIALIZED`` the side channel stays unused, and the warning says so."""
    job = run_job("train.py", "--fault=stall", "--rank=2", "--step=4", "--sleep=300", "--validate=first",
                  "--stall-warning=1", "--timeout=3", runner=False, env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    _assert_prompt(job)
    warned = re.findall(r"mpi_gradreducer: rank (\d): call 4, bucket 0 \(\d+ bytes\) has waited [\d.]+ s "
                        r"\(stall_warning=1 s\); missing ranks: unknown \(MPI was not initialized with "
                        r"MPI_THREAD_MULTIPLE\); still waiting", job.stderr)
    assert sorted(warned) == ["0", "1", "3"], str(job)


def test_healthy_job_with_a_stall_warning_prints_nothing():
    job = run_job("train.py", "--stall-warning=30", "--timeout=60", runner=False)
    assert job.returncode == 0, str(job)
    assert len(job.lines(r"rank (\d): finished, weights ([0-9a-f]+)")) == RANKS, str(job)
    assert "mpi_gradreducer:" not in job.output, str(job)


#: What a crashing process leaves in the job's output: the launcher's exit string or glibc's report.
CRASH = re.compile(r"Segmentation fault|signal 11|signal 6|Aborted|double free|corruption|core dumped", re.I)
#: Aborts per kind in the test (without the fix about 3 in 8 torch-loaded aborts crashed).
ABORTS = 3


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize("kind", ["watchdog", "exception"])
def test_aborts_with_torch_loaded_leave_no_crash_report(kind: str):
    args = (["--fault=stall", "--sleep=300", "--validate=first", "--timeout=1"] if kind == "watchdog"
            else ["--fault=raise", "--timeout=none"])
    for attempt in range(ABORTS):
        job = run_job("train.py", *args, "--rank=2", "--step=3", "--torch", runner=False)
        _assert_prompt(job)
        assert job.returncode == 1, f"attempt {attempt}\n{job}"
        assert not CRASH.search(job.output), f"attempt {attempt}: a crash report\n{job}"
