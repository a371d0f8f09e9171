"""No silent job of singletons: the launcher says N > 1 tasks, MPI says a world of 1.

A job started by a launcher that the loaded MPI library cannot talk to (a
bare ``srun``; ``srun --mpi=pmi2`` under Open MPI 5; MPICH's ``mpiexec``
running an Open MPI build of mpi4py, or the other way round) starts N
separate processes that each initialise MPI alone: N worlds of size 1, each
rank 0. Each trains its own model, and nothing fails. The launcher's
environment tells the truth that MPI missed: :func:`launch_claims` reads it
(Slurm's task variables in a job step, Hydra's and Slurm's PMI variables,
Open MPI's PRRTE variables, PMIx's rank), and :func:`singleton_problem`
writes the error, naming what it saw and the likely fix for the MPI library
that mpi4py loaded. :func:`check_not_singleton` raises it; every process of
such a job raises it alone (there is no one to talk to).

Slurm's variables count only in a job step (``SLURM_STEP_ID`` set): the
batch script of ``sbatch --ntasks 4`` sees ``SLURM_NTASKS=4`` and rightly
runs one Python. Where an MPI launcher's own size variable is present
(``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``), it is nearer the process than
Slurm's: ``mpiexec`` inside an allocation starts its daemons as a Slurm
step of one task per node, and its ranks inherit that step's variables.

``MPI_GRADREDUCER_ALLOW_SINGLETON=1`` turns the check off, for a job that
means to run N independent processes.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ALLOW_SINGLETON_ENV", "LaunchClaim", "check_not_singleton", "launch_claims", "singleton_problem"]

#: ``1`` turns the check off (N independent processes, meant so).
ALLOW_SINGLETON_ENV = "MPI_GRADREDUCER_ALLOW_SINGLETON"

#: The MPI launchers' own variables: (launcher, size variable, rank variable). Nearer the process than Slurm's.
_MPI_LAUNCHERS = (
    ("Open MPI's mpiexec (PRRTE)", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("a PMI launcher (Hydra's mpiexec, or srun --mpi=pmi2)", "PMI_SIZE", "PMI_RANK"),
)
#: Hydra's count of ranks on this node: more than one means a world of more than one.
_HYDRA_LOCAL = "MPI_LOCALNRANKS"
#: PMIx's rank (PRRTE, ``srun --mpi=pmix``): it gives no size, but a rank above 0 means a world of more than one.
_PMIX_RANK = "PMIX_RANK"
_PMIX_NAMESPACE = "PMIX_NAMESPACE"
#: The launcher (as :data:`_MPI_LAUNCHERS` names it) that is not the given library's own.
_FOREIGN = {"MPICH": "Open MPI", "Intel MPI": "Open MPI"}
#: Slurm's task count of a job step (``SLURM_NPROCS`` is its older name).
_SLURM_SIZES = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS")


@dataclass(frozen=True)
class LaunchClaim:
    """What one launcher's variables say about the job.

    Args:
        launcher: who set them, in words.
        tasks: the least number of tasks they imply (a size, or a rank + 1).
        variables: the variables read, as ``NAME=VALUE``.
    """

    launcher: str
    tasks: int
    variables: tuple[str, ...]


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    return int(text) if re.fullmatch(r"\d{1,9}", text) else None


def _seen(environ: Mapping[str, str], *names: str) -> tuple[str, ...]:
    return tuple(f"{n}={environ[n]}" for n in names if n in environ)


def launch_claims(environ: Mapping[str, str]) -> list[LaunchClaim]:
    """The task counts that a launcher's variables in ``environ`` imply, nearest launcher first.

    An MPI launcher's own size variable, where present, is the claim: Slurm's
    and others' are then left out (they describe the step that started the
    launcher's daemons). Otherwise each of PMIx's rank, Hydra's local count
    and, in a Slurm job step (``SLURM_STEP_ID`` and ``SLURM_PROCID`` set),
    Slurm's task count is a claim.

    Args:
        environ: the process's environment (``os.environ``).

    Returns:
        One claim per launcher whose variables are present and readable; empty where none is.
    """
    for launcher, size_var, rank_var in _MPI_LAUNCHERS:
        size, rank = _int(environ, size_var), _int(environ, rank_var)
        if size is not None:
            return [LaunchClaim(launcher, max(size, (rank or 0) + 1),
                                _seen(environ, size_var, rank_var, _HYDRA_LOCAL, _PMIX_RANK))]
    claims = []
    for launcher, _, rank_var in _MPI_LAUNCHERS:
        rank = _int(environ, rank_var)
        if rank is not None and rank > 0:
            claims.append(LaunchClaim(launcher, rank + 1, _seen(environ, rank_var)))
    local = _int(environ, _HYDRA_LOCAL)
    if local is not None:
        claims.append(LaunchClaim("Hydra's mpiexec", local, _seen(environ, _HYDRA_LOCAL, "MPI_LOCALRANKID")))
    pmix = _int(environ, _PMIX_RANK)
    if pmix is not None:
        claims.append(LaunchClaim("a PMIx launcher (PRRTE, or srun --mpi=pmix)", pmix + 1,
                                  _seen(environ, _PMIX_RANK, _PMIX_NAMESPACE)))
    procid = _int(environ, "SLURM_PROCID")
    if "SLURM_STEP_ID" in environ and procid is not None:
        sizes = [s for s in (_int(environ, n) for n in _SLURM_SIZES) if s is not None]
        claims.append(LaunchClaim("Slurm (a job step: srun)", max([*sizes, procid + 1]),
                                  _seen(environ, *_SLURM_SIZES, "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_MPI_TYPE")))
    return claims


def _library(version: str) -> str:
    """Whose MPI library ``MPI.Get_library_version()`` names: ``"Open MPI"``, ``"Intel MPI"``, ``"MPICH"`` or ``""``."""
    if "Open MPI" in version:
        return "Open MPI"
    if "Intel(R) MPI" in version:
        return "Intel MPI"
    if "MPICH" in version:
        return "MPICH"
    return ""


def _fixes(library: str, mpiexec: str | None, slurm: bool) -> list[str]:
    launcher = f"`{mpiexec}`" if mpiexec else "its own `mpiexec`"
    own = (f"start the job with the mpiexec of the MPI that mpi4py loaded ({library or 'see above'}): {launcher}"
           + (", inside the allocation (it reads Slurm's allocation itself)" if slurm else ""))
    if library == "Open MPI":
        direct = ("`srun --mpi=pmix` (Slurm's PMIx plugin; Open MPI 5 starts N jobs of size 1 under "
                  "`srun --mpi=pmi2` or a bare `srun`)")
    elif library == "Intel MPI":
        direct = "`srun --mpi=pmi2` with I_MPI_PMI_LIBRARY set to Slurm's libpmi2.so"
    else:
        direct = "`srun --mpi=pmi2`"
    return [own, f"or start it directly with {direct}" if slurm else f"or, under Slurm, with {direct}"]


def singleton_problem(environ: Mapping[str, str], world_size: int, library_version: str,
                      mpiexec: str | None = None) -> str | None:
    """The error for a world of size 1 that the launcher meant to be larger; None when there is none.

    Args:
        environ: the process's environment.
        world_size: ``MPI.COMM_WORLD.Get_size()``.
        library_version: ``MPI.Get_library_version()`` (which MPI mpi4py loaded).
        mpiexec: that MPI's ``mpiexec``, where known, for the fix.

    Returns:
        None when the world has more than one rank, the check is turned off
        (:data:`ALLOW_SINGLETON_ENV` = ``1``) or no launcher claims more than one
        task; else the message: what each launcher claimed, the library, the fix.
    """
    if world_size != 1 or environ.get(ALLOW_SINGLETON_ENV, "").strip() == "1":
        return None
    claims = [c for c in launch_claims(environ) if c.tasks > 1]
    if not claims:
        return None
    library = _library(library_version)
    first_line = " ".join(library_version.strip().splitlines()[0].split()) if library_version.strip() else "unknown"
    said = "; ".join(f"{c.launcher}: {', '.join(c.variables)}" for c in claims)
    most = max(c.tasks for c in claims)
    slurm = any(n.startswith("SLURM_") for n in environ)
    fixes = _fixes(library, mpiexec, slurm)
    foreign = [c.launcher for c in claims if library and c.launcher.startswith(_FOREIGN.get(library, "-"))]
    mismatch = (f"The launcher is another MPI's ({foreign[0]}) than the library's. " if foreign else "")
    return (f"MPI.COMM_WORLD has 1 rank, but the launcher started this process as one of {most} tasks ({said}). "
            f"Each task is a separate world of size 1 (a singleton) and would train alone, silently. "
            f"The MPI library mpi4py loaded ({first_line}) did not receive the launcher's wiring. {mismatch}Fix: "
            f"{'; '.join(fixes)}. "
            f"If {most} independent processes are meant, set {ALLOW_SINGLETON_ENV}=1.")


def check_not_singleton(environ: Mapping[str, str] | None = None) -> None:
    """Raise on a process that the launcher started as one of N > 1 tasks but that MPI gave a world of 1.

    Call before any collective: every process of such a job raises alone, each
    being rank 0 of its own world. Cheap (a read of the environment and the
    world's size); initialises MPI where mpi4py has not yet.

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        RuntimeError: the job is one of singletons: the message names the launcher's variables seen, the
            MPI library loaded and the fix.
    """
    from mpi4py import MPI

    env = os.environ if environ is None else environ
    size = MPI.COMM_WORLD.Get_size()
    if size != 1 or singleton_problem(env, size, "") is None:  # the usual cases, without a look at the disk
        return
    beside = Path(sys.executable).parent / "mpiexec"
    problem = singleton_problem(env, size, MPI.Get_library_version(), str(beside) if beside.is_file() else None)
    if problem is not None:
        raise RuntimeError(problem)
