"""Launching Open MPI jobs with fault tolerance for the elastic tests, and killing their ranks from outside.

One small helper (``OmpiJob``): a job started in the background, so that a
test can kill its ranks while it runs. Its command line is the package's
launcher's (:mod:`mpi_gradreducer.launch`) for the Open MPI venv's
``mpiexec`` (``.venv-ompi`` at the repository's root, or
``MPI_GRADREDUCER_OMPI_VENV``) with fault tolerance, as root where needed,
oversubscribed, with TCP on loopback only. It runs as a
:class:`mpi_gradreducer.jobs.Job`: its whole process tree is ended on
timeout, and on the way out of a ``with`` block.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from mpi_gradreducer import jobs
from mpi_gradreducer.launch import Launcher

ROOT = Path(__file__).resolve().parents[1]
VENV_ENV = "MPI_GRADREDUCER_OMPI_VENV"


def ompi_venv() -> Path | None:
    """The Open MPI venv (with ``mpiexec`` and ``python``), or None."""
    venv = Path(os.environ.get(VENV_ENV, ROOT / ".venv-ompi"))
    return venv if (venv / "bin" / "mpiexec").exists() and (venv / "bin" / "python").exists() else None


def why_not_here() -> str | None:
    """Why these tests cannot run in this process, or None.

    They run under the Open MPI venv's pytest (``scripts/test.sh``'s elastic
    stage), as one process that launches its own jobs.
    """
    from mpi4py import MPI

    if not MPI.Get_library_version().startswith("Open MPI"):
        return "runs in the Open MPI stage (scripts/test.sh: the venv .venv-ompi)"
    if MPI.COMM_WORLD.Get_size() > 1:
        return "launches its own MPI jobs: run from a single process"
    if ompi_venv() is None:
        return f"needs Open MPI's mpiexec in .venv-ompi (or {VENV_ENV})"
    return None


class OmpiJob:
    """``mpiexec --with-ft ulfm -n RANKS python SCRIPT ARGS``, started in the background.

    Args:
        script: the job script (relative to the repository).
        args: its arguments.
        ranks: how many ranks.
        env: more environment variables (passed to every rank with ``-x``).
        ft: launch with ``--with-ft ulfm``.
    """

    def __init__(self, script: str, *args: str, ranks: int = 4, env: dict[str, str] | None = None,
                 ft: bool = True) -> None:
        venv = ompi_venv()
        assert venv is not None
        launcher = Launcher.detect(str(venv / "bin" / "mpiexec"))
        variables = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        environ = launcher.environment({k: v for k, v in os.environ.items()
                                        if not k.startswith("MPI_GRADREDUCER_") and k != "PYTHONUNBUFFERED"})
        environ.update(variables)
        environ["OMPI_MCA_btl_tcp_if_include"] = "lo"  # the jobs' TCP stays on the loopback
        command = launcher.command([str(venv / "bin" / "python"), str(ROOT / script), *args], ranks=ranks,
                                   oversubscribe=True, fault_tolerance=ft, env=variables)
        self.command = command
        self.job = jobs.Job(command, cwd=ROOT, env=environ, stderr=jobs.STDOUT)
        self.output = ""

    def wait(self, limit: float) -> int:
        """Wait for the end (at most ``limit`` s; then end the whole tree and fail); returns the exit status."""
        done = self.job.finish(limit)
        self.output = done.stdout
        if done.timed_out:
            raise AssertionError(f"the job did not end within {limit} s:\n{self.output[-6000:]}")
        return done.returncode

    def ended(self) -> str | None:
        """The output of a job that is over (the end of what it wrote), or None while it runs."""
        if self.job.poll() is None:
            return None
        self.output = self.job.finish(10).stdout
        return self.output

    def __enter__(self) -> OmpiJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.job.__exit__(kind, *rest)


def wait_for(predicate, limit: float, what: str, job: OmpiJob | None = None, every: float = 0.005):  # type: ignore[no-untyped-def]
    """Poll ``predicate()`` until it returns something true (returned); fail after ``limit`` s or if the job ended."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and (out := job.ended()) is not None:
            raise AssertionError(f"the job ended ({job.job.poll()}) before {what}:\n{out[-6000:]}")
        time.sleep(every)
    raise AssertionError(f"timed out after {limit} s waiting for {what}")


def kill(pid: int) -> float:
    """SIGKILL process ``pid`` from outside; returns the time (``time.time()``) it was sent."""
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def python() -> str:
    """This interpreter (for single-process helpers)."""
    return sys.executable
