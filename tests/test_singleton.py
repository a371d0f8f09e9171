"""No silent job of singletons (``mpi_gradreducer._core.singleton``).

The pure part reads launcher environments as each launcher writes them (as
measured: Hydra's, PRRTE's, Slurm's job steps and batch scripts). The real
part starts two separate Python processes without ``mpiexec`` (each its own
world of size 1) with a launcher's variables set, as a bare ``srun`` or
another MPI's ``mpiexec`` would: each must stop with the error before it
trains; with ``MPI_GRADREDUCER_ALLOW_SINGLETON=1`` each trains alone; under
this environment's ``mpiexec`` the ranks form one world and train.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from conftest import JOB_STRIPPED, run_job
from mpi_gradreducer import jobs
from mpi_gradreducer._core.singleton import ALLOW_SINGLETON_ENV, check_not_singleton, launch_claims, singleton_problem

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "jobs" / "singleton_probe.py"
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."
OPEN_MPI = "Open MPI v5.0.11, package: Open MPI ... Distribution, ident: 5.0.11, repo rev: v5.0.11"
INTEL = "Intel(R) MPI Library 2021.18 for Linux* OS\n"

#: A task of a bare ``srun -N2 -n4`` (no --mpi), as Slurm 22.05 sets it.
SRUN_BARE = {"SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2",
             "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}
#: The batch script of ``sbatch --ntasks 4``: an allocation, no job step: one Python there is right.
SBATCH_SHELL = {"SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2",
                "SLURM_PROCID": "0"}
#: A rank of Hydra's ``mpiexec -n 4`` inside that allocation: its proxies are a Slurm step of one task per node.
HYDRA_IN_SLURM = {**SRUN_BARE, "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_STEP_NUM_TASKS": "2",
                  "SLURM_PROCID": "1", "PMI_SIZE": "4", "PMI_RANK": "3", "PMI_FD": "9", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize("environ, world, tasks", [
    ({}, 1, None),                                                        # python script.py
    (SBATCH_SHELL, 1, None),                                              # sbatch's batch script
    (SRUN_BARE, 1, 4),                                                    # bare srun: 4 singletons
    ({**SRUN_BARE, "SLURM_PROCID": "0"}, 1, 4),                           # ... rank 0 of them too
    ({**SRUN_BARE, "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "4", "PMI_RANK": "2"}, 1, 4),  # srun --mpi=pmi2, missed
    ({**SRUN_BARE, "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "4", "PMI_RANK": "2"}, 4, None),  # ... and understood
    (HYDRA_IN_SLURM, 4, None),                                            # mpiexec inside the allocation
    ({**HYDRA_IN_SLURM, "PMI_SIZE": "1", "PMI_RANK": "0", "MPI_LOCALNRANKS": "1"}, 1, None),  # mpiexec -n 1 there
    ({"PMI_SIZE": "2", "PMI_RANK": "0", "PMI_FD": "9", "MPI_LOCALNRANKS": "2"}, 1, 2),  # Hydra's, not this MPI's
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0"}, 1, 3),  # PRRTE's, not this MPI's
    ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0"}, 1, None),  # mpiexec -n 1
    ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.7.0"}, 1, 4),      # srun --mpi=pmix: rank 3 of >= 4
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.7.0"}, 1, None),   # ... rank 0 alone says nothing
    ({"PMI_RANK": "1"}, 1, 2),                                            # a rank with no size
    ({"MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1"}, 1, 2),             # Hydra's local count
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "3"}, 1, None),  # srun -n 1
    ({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, 1, None),               # a step's variables, no task id
    ({"SLURM_NPROCS": "3", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, 1, 3),  # the older name alone
    ({"SLURM_NTASKS": "x", "SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}, 1, 3),  # unreadable size: the task id
    ({"PMI_SIZE": "", "PMI_RANK": "junk"}, 1, None),                      # unreadable: no claim
    ({**SRUN_BARE, ALLOW_SINGLETON_ENV: "1"}, 1, None),                   # turned off
    ({**SRUN_BARE, ALLOW_SINGLETON_ENV: "0"}, 1, 4),                      # only 1 turns it off
])
def test_which_environments_are_a_job_of_singletons(environ, world, tasks):
    problem = singleton_problem(environ, world, MPICH)
    if tasks is None:
        assert problem is None, problem
    else:
        assert problem is not None
        assert f"one of {tasks} tasks" in problem, problem
        assert f"{ALLOW_SINGLETON_ENV}=1" in problem, problem


def test_the_error_names_the_variables_seen_and_the_library():
    problem = singleton_problem({**SRUN_BARE, "HOME": "/root"}, 1, MPICH, "/v/bin/mpiexec")
    assert problem is not None
    for seen in ("SLURM_NTASKS=4", "SLURM_PROCID=2", "SLURM_STEP_ID=0", "Slurm (a job step: srun)"):
        assert seen in problem, problem
    assert "HOME" not in problem, problem
    assert "(MPICH Version: 5.0.2)" in problem, problem  # its first line, spaces collapsed
    assert "`/v/bin/mpiexec`, inside the allocation" in problem, problem
    assert "`srun --mpi=pmi2`" in problem, problem


@pytest.mark.parametrize("library, fix", [
    (MPICH, "`srun --mpi=pmi2`"),
    (OPEN_MPI, "`srun --mpi=pmix` (Slurm's PMIx plugin; Open MPI 5 starts N jobs of size 1 under `srun --mpi=pmi2`"),
    (INTEL, "`srun --mpi=pmi2` with I_MPI_PMI_LIBRARY"),
])
def test_the_fix_is_the_loaded_library_s(library, fix):
    problem = singleton_problem(SRUN_BARE, 1, library)
    assert problem is not None and fix in problem and "its own `mpiexec`" in problem, problem


def test_another_mpi_s_launcher_is_named_as_such():
    problem = singleton_problem({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, 1, MPICH)
    assert problem is not None and "another MPI's (Open MPI's mpiexec (PRRTE))" in problem, problem
    assert "under Slurm" in problem, problem  # no Slurm here: srun offered as the alternative under Slurm
    assert "another MPI's" not in (singleton_problem({"PMI_SIZE": "2"}, 1, MPICH) or ""), "PMI is MPICH's own"


def test_the_nearest_launcher_s_size_is_the_claim():
    claims = launch_claims(HYDRA_IN_SLURM)
    assert [(c.launcher.split()[1], c.tasks) for c in claims] == [("PMI", 4)], claims
    assert claims[0].variables == ("PMI_SIZE=4", "PMI_RANK=3", "MPI_LOCALNRANKS=2"), claims
    assert launch_claims({}) == []


def test_this_process_is_no_singleton():
    """Under pytest (alone, or a rank of mpiexec) this process's own environment is consistent."""
    check_not_singleton()


def _singletons(env: dict[str, str], tasks: int, via: str = "check", limit: float = 60.0) -> list[tuple[int, str]]:
    """Start ``tasks`` probes at once, without mpiexec, task ``t`` with ``env`` (``{t}`` replaced by ``t``)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(JOB_STRIPPED) and not k.startswith("SLURM_")}
    base.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    probes = [jobs.Job([sys.executable, str(PROBE), f"--via={via}"], cwd=ROOT, stderr=jobs.STDOUT,
                       env={**base, **{k: v.replace("{t}", str(t)) for k, v in env.items()}}) for t in range(tasks)]
    deadline, out = time.monotonic() + limit, []
    for probe in probes:  # each ended, with its whole group, by its deadline at the latest
        done = probe.finish(max(1.0, deadline - time.monotonic()))
        if done.timed_out:
            pytest.fail(f"a singleton probe did not end within {limit:g} s:\n{done.stdout[-2000:]}")
        out.append((done.returncode, done.stdout))
    return out


def _claims_for_this_library() -> list[dict[str, str]]:
    """Launcher variables that a singleton of this library starts with (not the library's own wiring)."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "{t}", "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "1"}
    vendor = MPI.get_vendor()[0]
    other = ({"PMI_SIZE": "2", "PMI_RANK": "{t}"} if vendor == "Open MPI"
             else {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "{t}"})
    return [slurm, other]


@pytest.mark.slow
@pytest.mark.parametrize("via", ["check", "reducer", "hvd", "torch", "torch-backend"])
@pytest.mark.parametrize("which", ["slurm step", "another MPI's launcher"])
def test_two_singletons_both_stop_before_training(which, via):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own processes: run from a single process")
    env = _claims_for_this_library()[0 if which == "slurm step" else 1]
    out = _singletons(env, 2, via)
    for task, (status, text) in enumerate(out):
        assert status == 3, f"task {task}: exit status {status}\n{text}"
        assert "trained" not in text, text
        assert f"probe 0 of 1 | task {task}" in text, text
        assert "singleton error 0 | MPI.COMM_WORLD has 1 rank, but the launcher started this process as one of 2 " \
            "tasks" in text, text
        assert f"{ALLOW_SINGLETON_ENV}=1" in text, text
        names = [n for n in env if n.endswith(("SIZE", "NTASKS"))]
        assert all(f"{n}=2" in text for n in names), text


@pytest.mark.slow
def test_allowed_singletons_each_train_alone():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own processes: run from a single process")
    out = _singletons({**_claims_for_this_library()[0], ALLOW_SINGLETON_ENV: "1"}, 2)
    for status, text in out:
        assert status == 0 and "trained 0 of 1 | mean 0" in text and "singleton" not in text, text


@pytest.mark.slow
def test_one_world_under_this_mpi_s_mpiexec_trains():
    job = run_job(str(PROBE), ranks=2, runner=False)
    assert job.returncode == 0, str(job)
    assert sorted(m[1] for m in job.lines(r"trained (\d) of 2 \| mean 0.5")) == ["0", "1"], str(job)
