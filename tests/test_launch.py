"""``mpi_gradreducer.launch`` and the tests' one job helper, under whichever MPI this Python has.

The jobs are real (``tests/jobs/launch_probe.py`` under this environment's
``mpiexec``): variables reach every rank, tagged output names its rank,
more ranks than cores start, ULFM (Open MPI) survives a rank SIGKILLed
mid-collective, and ``conftest.run_job`` kills a job past its limit and
names what outlives ``mpiexec``. ``scripts/test.sh`` runs this file under
each MPI's venv. Argument checks need no MPI.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import uuid
from pathlib import Path

import pytest
from mpi4py import MPI

from conftest import job_launcher, run_job
from mpi_gradreducer.launch import Launcher, Network, find_mpiexec

#: A value with what a launcher could split or quote: commas, spaces, '=', quotes, a dollar sign.
AWKWARD = "a,b c=d 'e' \"f\" $HOME"


def _probe_mark() -> tuple[str, dict[str, str]]:
    """A value to find a job's processes by from here (an extra variable besides the helper's own mark)."""
    value = uuid.uuid4().hex
    return value, {"LAUNCH_PROBE_MARK": value}


def _alive_with(value: str) -> list[int]:
    needle = f"LAUNCH_PROBE_MARK={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_the_launcher_is_the_library_s_own():
    """The mpiexec a job starts with is of the MPI library mpi4py loaded here (else ranks start as singletons)."""
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own MPI jobs: run from a single process")
    launcher = job_launcher()
    if launcher is None:
        pytest.skip("no mpiexec beside this Python or on PATH")
    assert launcher.vendor == MPI.get_vendor()[0], (launcher, MPI.Get_library_version())
    job = run_job("launch_probe.py", "--mode=env", ranks=3, env={"LAUNCH_PROBE": "x"})
    assert job.returncode == 0, str(job)
    assert job.lines(r"vendor (.*)")[0][1] == launcher.vendor, str(job)


@pytest.mark.slow
def test_variables_reach_every_rank_unchanged():
    job = run_job("launch_probe.py", "--mode=env", ranks=4, env={"LAUNCH_PROBE": AWKWARD})
    assert job.returncode == 0, str(job)
    got = {int(m[1]): (int(m[2]), m[3]) for m in job.lines(r"rank (\d+) of (\d+) \| (.*)")}
    assert got == {r: (4, AWKWARD) for r in range(4)}, str(job)


@pytest.mark.slow
def test_more_ranks_than_cores_start():
    ranks = 2 * len(os.sched_getaffinity(0)) + 1
    job = run_job("launch_probe.py", "--mode=env", ranks=ranks, env={"LAUNCH_PROBE": "x"})
    assert job.returncode == 0, str(job)
    assert sorted(int(m[1]) for m in job.lines(r"rank (\d+) of \d+ \| x")) == list(range(ranks)), str(job)


@pytest.mark.slow
def test_tagged_output_names_each_line_s_rank():
    job = run_job("launch_probe.py", "--mode=env", ranks=3, env={"LAUNCH_PROBE": "tagged"}, tag_output=True)
    assert job.returncode == 0, str(job)
    launcher = job_launcher()
    assert launcher is not None
    found = {}
    for line in job.stdout.splitlines():
        rank, text = launcher.untag(line)
        m = re.fullmatch(r"rank (\d+) of 3 \| tagged", text)
        if m:
            found[int(m[1])] = rank
    assert found == {0: 0, 1: 1, 2: 2}, str(job)


@pytest.mark.slow
def test_ulfm_survivors_shrink_after_a_rank_is_killed():
    """Open MPI's ``--with-ft ulfm``: SIGKILL on rank 2 while it waits in a barrier; the other three carry on."""
    job = run_job("launch_probe.py", "--mode=ulfm", "--victim=2", ranks=4, runner=False, fault_tolerance=True,
                  limit=60)
    assert job.returncode == 0, str(job)
    rows = job.lines(r"rank (\d) \| error (\w+) \| shrunk to (\d) \| sum (\d+)")
    assert sorted(int(m[1]) for m in rows) == [0, 1, 3], str(job)
    assert all(m[2] in ("PROC_FAILED", "REVOKED") and m[3] == "3" and m[4] == "4" for m in rows), str(job)
    assert any(m[2] == "PROC_FAILED" for m in rows), f"no rank saw the failure itself\n{job}"


@pytest.mark.slow
def test_a_job_past_its_limit_is_killed_whole():
    value, env = _probe_mark()
    with pytest.raises(pytest.fail.Exception, match=r"did not end within 3 s and was killed"):
        run_job("launch_probe.py", "--mode=sleep", "--seconds=120", ranks=3, limit=3, env=env)
    assert not _alive_with(value), "processes of the killed job are still alive"


@pytest.mark.slow
def test_a_process_that_outlives_mpiexec_is_named_and_killed():
    value, env = _probe_mark()
    with pytest.raises(pytest.fail.Exception, match=r"outlived mpiexec: pid \d+: sleep 97"):
        run_job("launch_probe.py", "--mode=escape", "--seconds=97", ranks=2, env=env)
    assert not _alive_with(value), "the escaped process is still alive"


# -- without running a job ---------------------------------------------------------------------------


def _fake_mpiexec(tmp_path: Path, says: str) -> str:
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{says}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("says, vendor, version", [
    ("HYDRA build details:\n    Version:                                 5.0.2\n", "MPICH", "5.0.2"),
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/", "Open MPI", "5.0.11"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626 (id: b44796a)", "Intel MPI",
     "2021.18.1"),
])
def test_detect_reads_each_launcher_s_version_text(tmp_path: Path, says: str, vendor: str, version: str):
    """What each MPI's ``mpiexec --version`` prints (copied from the PyPI builds), told apart."""
    launcher = Launcher.detect(_fake_mpiexec(tmp_path, says))
    assert (launcher.vendor, launcher.version) == (vendor, version)


@pytest.mark.parametrize("says, message", [
    ("mpirun (Open MPI) 4.1.6", r"Open MPI 4\.1\.6 \(ORTE\): only Open MPI 5"),
    ("srun: unrecognized option", r"is no mpiexec known here .* said: srun: unrecognized option"),
])
def test_detect_refuses_what_it_does_not_know(tmp_path: Path, says: str, message: str):
    with pytest.raises(RuntimeError, match=message):
        Launcher.detect(_fake_mpiexec(tmp_path, says))


def test_detect_names_a_program_that_does_not_run(tmp_path: Path):
    with pytest.raises(RuntimeError, match=r"cannot run `.*/nothing --version`"):
        Launcher.detect(str(tmp_path / "nothing"))


def test_find_prefers_the_mpiexec_beside_the_python(tmp_path: Path):
    beside = Path(_fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11"))
    assert find_mpiexec(str(tmp_path / "python")) == str(beside)
    assert Launcher.find(str(tmp_path / "python")).vendor == "Open MPI"


LAUNCHERS = [Launcher("/x/mpiexec", "MPICH", "5.0.2"), Launcher("/x/mpiexec", "Open MPI", "5.0.11"),
             Launcher("/x/mpiexec", "Intel MPI", "2021.18.1")]


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda launcher: launcher.vendor)
@pytest.mark.parametrize("kwargs, message", [
    ({"ranks": 0}, r"ranks: expected a positive int, got 0"),
    ({"ranks": 5, "hosts": ["a", "b"], "ppn": 2}, r"ranks: expected at most ppn \* len\(hosts\) = 4, got 5"),
    ({"ranks": 2, "ppn": 2}, r"ppn: given without hosts"),
    ({"ranks": 2, "hosts": ["a,b"]}, r"hosts\[0\]: expected a host name or address, got 'a,b'"),
    ({"ranks": 2, "env": {"A-B": "1"}}, r"env: expected variable names .* got 'A-B'"),
    ({"ranks": 2, "env": {"A": "1\n2"}}, r"env\['A'\]: expected a one-line string"),
    ({"ranks": 2, "agent": "/bin/ssh"}, r"network, agent: given without hosts"),
    ({"ranks": 2, "host_timeout": 1}, r"host_timeout: expected an int of at least 3 seconds, got 1"),
])
def test_bad_requests_are_refused_naming_the_argument(launcher: Launcher, kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        launcher.command([sys.executable, "job.py"], **kwargs)


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda launcher: launcher.vendor)
def test_fault_tolerance_only_where_there_is_ulfm(launcher: Launcher):
    if launcher.supports_ulfm:
        assert "ulfm" in launcher.command(["prog"], ranks=2, fault_tolerance=True)
    else:
        with pytest.raises(ValueError, match=rf"fault_tolerance: {launcher.vendor}'s mpiexec offers no ULFM"):
            launcher.command(["prog"], ranks=2, fault_tolerance=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"subnet": "198.18.1.0/33"}, r"Network.subnet: expected an IPv4 network"),
    ({"local_address": "10.0.0.1"}, r"Network.local_address: expected an address in 198.18.1.0/24, got 10.0.0.1"),
    ({"interface": "eth 0"}, r"Network.interface: expected a network interface name"),
])
def test_a_bad_network_is_refused(kwargs: dict, message: str):
    good = {"subnet": "198.18.1.0/24", "interface": "eth0", "local_address": "198.18.1.254",
            "local_interface": "br0"}
    with pytest.raises(ValueError, match=message):
        Network(**{**good, **kwargs})


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda launcher: launcher.vendor)
def test_the_program_comes_last_and_whole(launcher: Launcher):
    """Whatever the launcher's options, the program and its arguments end the line unchanged."""
    program = [sys.executable, "-m", "pytest", "-n", "2", "--ppn", "x"]
    net = Network("198.18.1.0/24", "eth0", "198.18.1.254", "br0")
    cmd = launcher.command(program, ranks=4, hosts=["198.18.1.1", "198.18.1.2"], ppn=2, env={"A": "1"},
                           tag_output=True, oversubscribe=True, pin=False, network=net, agent="/x/agent",
                           host_timeout=5)
    assert cmd[0] == "/x/mpiexec" and cmd[-len(program) - 2:] == ["-n", "4", *program]


def test_environment_drops_an_enclosing_job_s_wiring_and_keeps_settings():
    launcher = Launcher("/x/bin/mpiexec", "Open MPI", "5.0.11")
    env = launcher.environment({"PMI_RANK": "3", "PMIX_NAMESPACE": "n", "OMPI_COMM_WORLD_SIZE": "4",
                                "OMPI_MCA_btl": "self,tcp", "MPIR_CVAR_X": "1", "PATH": "/usr/bin"})
    assert "PMI_RANK" not in env and "PMIX_NAMESPACE" not in env and "OMPI_COMM_WORLD_SIZE" not in env
    assert env["OMPI_MCA_btl"] == "self,tcp" and env["MPIR_CVAR_X"] == "1"
    assert env["PATH"].split(os.pathsep) == ["/usr/bin", "/x/bin"]
    assert ("OMPI_ALLOW_RUN_AS_ROOT" in env) == (os.geteuid() == 0)


@pytest.mark.parametrize("launcher, plugin", [(LAUNCHERS[0], "pmi2"), (LAUNCHERS[1], "pmix")],
                         ids=lambda x: x.vendor if isinstance(x, Launcher) else x)
def test_srun_lines_name_the_plugin_that_makes_one_world(launcher: Launcher, plugin: str):
    """MPICH's wheel aborts under --mpi=pmix; Open MPI 5 starts singletons under pmi2 (tests/test_slurm.py)."""
    program = [sys.executable, "job.py", "--x", "a,b c"]
    assert launcher.srun_command(program, nodes=2, ppn=2, env={"A": AWKWARD}) == [
        "srun", f"--mpi={plugin}", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=2", "env",
        f"A={AWKWARD}", *program]
    assert launcher.srun_command(program, srun="/s/srun") == ["/s/srun", f"--mpi={plugin}", "--kill-on-bad-exit=1",
                                                               *program]


def test_srun_under_intel_mpi_needs_slurm_s_pmi_library():
    intel = LAUNCHERS[2]
    with pytest.raises(ValueError, match=r"pmi_library: Intel MPI under srun needs Slurm's libpmi2.so"):
        intel.srun_command(["prog"])
    assert intel.srun_command(["prog"], ranks=4, pmi_library="/l/libpmi2.so") == [
        "srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--ntasks=4", "env", "I_MPI_PMI_LIBRARY=/l/libpmi2.so", "prog"]
    with pytest.raises(ValueError, match=r"pmi_library: only Intel MPI takes one; MPICH has its own PMI client"):
        LAUNCHERS[0].srun_command(["prog"], pmi_library="/l/libpmi2.so")


@pytest.mark.parametrize("kwargs, message", [
    ({"ranks": 0}, r"ranks: expected a positive int or None, got 0"),
    ({"nodes": True}, r"nodes: expected a positive int or None, got True"),
    ({"ranks": 5, "nodes": 2, "ppn": 2}, r"ranks: expected at most nodes \* ppn = 4, got 5"),
    ({"env": {"A-B": "1"}}, r"env: expected variable names .* got 'A-B'"),
])
def test_bad_srun_requests_are_refused_naming_the_argument(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        LAUNCHERS[0].srun_command(["prog"], **kwargs)
