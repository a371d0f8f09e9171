"""MPI jobs as users start them under Slurm, on a Slurm cluster of two namespace hosts.

``scripts/cluster.py up --hosts 3 --slurm`` makes the cluster (munged,
slurmctld on the bridge, a slurmd per host); every test here submits real
jobs to it and reads their output:

- ``sbatch --nodes 2 --ntasks-per-node 2 scripts/slurm_mpiexec.sh`` with the
  ``mpiexec`` of MPICH's venv and of Open MPI's: one world of 4, two ranks on
  each host, that trains (``tests/jobs/singleton_probe.py``) and runs the seed
  example; and the suite's collective tests
  (``tests --only-mpi``, the 2 x 2 stage) at 2 x 2;
- ``srun`` directly, with the plugin that ``Launcher.srun_command`` picks
  (``pmi2`` for MPICH, ``pmix`` for Open MPI 5): the same world;
- ``srun`` with a plugin the MPI cannot use (none for MPICH, ``pmi2`` for
  Open MPI 5): four singletons, each of which stops with the singleton error
  before training;
- elastic under Slurm (Open MPI's ULFM): ``mpiexec --with-ft ulfm`` inside
  an allocation of 3 nodes trains on 2 of them; both ranks of one node are
  killed and the node drained: the survivors go on, and replacements start
  on the third node, found by ``scripts/slurm_hosts.sh``.

Runs in ``scripts/test.sh``'s Slurm stage (``MPI_GRADREDUCER_SLURM=1``, as
root, Debian's Slurm installed); elsewhere every test is skipped with the
reason. One process only: the tests launch their own jobs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import JOB_STRIPPED, cluster_unavailable
from elastic_ompi import ompi_venv
from mpi_gradreducer.launch import Launcher

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = [sys.executable, str(ROOT / "scripts" / "cluster.py"), "--name", "slmci"]
PROBE = str(ROOT / "tests" / "jobs" / "singleton_probe.py")
#: The variable that scripts/test.sh's Slurm stage sets.
STAGE_ENV = "MPI_GRADREDUCER_SLURM"
#: Seconds a job may take from submission to its end (about 10 here: Python's start-up on 4 ranks).
JOB_LIMIT = 120.0


def _why_not_here() -> str | None:
    if MPI.COMM_WORLD.Get_size() > 1:
        return "launches its own Slurm jobs: run from a single process"
    if os.environ.get(STAGE_ENV) != "1":
        return f"runs in scripts/test.sh's Slurm stage ({STAGE_ENV}=1; root, Debian's slurmd, slurmctld, munge)"
    missing = [p for p in ("sbatch", "srun", "sinfo", "squeue", "scontrol") if shutil.which(p) is None]
    if missing:
        return f"Slurm's commands are not installed: {', '.join(missing)}"
    return cluster_unavailable()


#: Intel MPI's venv, for the opt-in stage (``MPI_GRADREDUCER_IMPI=1 bash scripts/test.sh``).
IMPI_VENV = Path(os.environ.get("MPI_GRADREDUCER_IMPI_VENV", ROOT / ".venv-impi"))
#: Slurm's PMI-2 library (Debian's ``libpmi2-0``), which Intel MPI loads under ``srun --mpi=pmi2``.
SLURM_PMI2 = Path("/usr/lib/x86_64-linux-gnu/libpmi2.so.0")


def _venvs() -> dict[str, Path]:
    """The venvs of each MPI at hand: this Python's, Open MPI's (``.venv-ompi`` or its variable) and, in the
    opt-in stage, Intel MPI's (``.venv-impi`` or ``MPI_GRADREDUCER_IMPI_VENV``)."""
    found = {}
    impi = IMPI_VENV if os.environ.get("MPI_GRADREDUCER_IMPI") == "1" else None
    for venv in (Path(sys.executable).parent.parent.absolute(), ompi_venv(), impi):
        if venv is not None and (venv / "bin" / "mpiexec").exists():
            found[Launcher.detect(str(venv / "bin" / "mpiexec")).vendor] = venv.absolute()
    return found


class Slurm:
    """The running cluster: its environment for Slurm's commands and jobs, and its network."""

    def __init__(self, conf: str, subnet: str) -> None:
        self.subnet = subnet
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith((*JOB_STRIPPED, "SLURM_", "UCX_", "PRTE_"))}
        self.env.update(SLURM_CONF=conf, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TCP_SUBNET=subnet,
                        TCP_IFACE="eth0", SHARED_CORES="1")

    def run(self, *argv: str, limit: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=limit, env=self.env,
                              stdin=subprocess.DEVNULL)

    def run_with(self, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, env={**self.env, **env},
                              stdin=subprocess.DEVNULL)

    def submit(self, *argv: str, env: dict[str, str] | None = None) -> tuple[str, Path]:
        """``sbatch ARGV`` (with more environment variables ``env``): the job id and its output file."""
        out = Path(f"/tmp/slurm-test-{uuid.uuid4().hex}.out")
        done = self.run_with(env or {}, "sbatch", "--parsable", f"--output={out}", f"--chdir={ROOT}", *argv)
        assert done.returncode == 0, f"sbatch {' '.join(argv)}: {done.stderr}"
        return done.stdout.strip().split(";")[0], out

    def wait(self, job: str, out: Path, limit: float = JOB_LIMIT) -> tuple[int, str]:
        """Wait for ``job`` to end: its exit status and output (the job is cancelled past ``limit``)."""
        deadline = time.monotonic() + limit
        state = ""
        while time.monotonic() < deadline:
            shown = self.run("scontrol", "show", "job", job).stdout
            state = m[1] if (m := re.search(r"JobState=(\S+)", shown)) else "?"
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                text = out.read_text(errors="replace") if out.exists() else "(no output file)"
                out.unlink(missing_ok=True)
                m = re.search(r"\bExitCode=(\d+):(\d+)", shown)
                return (int(m[1]) if m else -1), f"job {job}: {state}\n{text}"
            time.sleep(0.5)
        self.run("scancel", "--signal=KILL", job)
        text = out.read_text(errors="replace") if out.exists() else "(no output file)"
        out.unlink(missing_ok=True)
        pytest.fail(f"job {job} still {state} after {limit:g} s: cancelled\n{text}")

    def srun(self, argv: list[str], env: dict[str, str] | None = None, limit: float = JOB_LIMIT) -> tuple[int, str]:
        """Run an ``srun`` line from the machine's own namespace (a user's shell): exit status and output."""
        proc = subprocess.Popen(argv, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            pytest.fail(f"`{' '.join(argv)}` did not end within {limit:g} s: killed\n{text}")
        return proc.returncode, text


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    """A Slurm cluster of three namespace hosts, up for this module's tests and down after (also on failure)."""
    why = _why_not_here()
    if why is not None:
        pytest.skip(why)
    subprocess.run([*CLUSTER, "down"], capture_output=True, timeout=120)
    up = subprocess.run([*CLUSTER, "up", "--hosts", "3", "--slurm"], capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, f"cluster.py up --slurm failed:\n{up.stdout}\n{up.stderr}"
        conf = re.search(r"SLURM_CONF=(\S+)", up.stdout)
        bridge = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", "slmci-br"], capture_output=True,
                                text=True, timeout=30).stdout
        net = re.search(r"inet (\d+\.\d+\.\d+)\.\d+/24", bridge)
        assert conf and net, up.stdout + bridge
        yield Slurm(conf[1], f"{net[1]}.0/24")
    finally:
        down = subprocess.run([*CLUSTER, "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr


@pytest.fixture(params=["MPICH", "Open MPI", "Intel MPI"])
def venv(request: pytest.FixtureRequest, slurm: Slurm) -> Path:
    """Each MPI's venv (skipped with the reason where there is none)."""
    found = _venvs()
    if request.param not in found:
        pytest.skip(f"no {request.param} venv here (Open MPI's: .venv-ompi or MPI_GRADREDUCER_OMPI_VENV; Intel "
                    "MPI's: MPI_GRADREDUCER_IMPI=1 with .venv-impi or MPI_GRADREDUCER_IMPI_VENV)")
    return found[request.param]


def _one_world_across_both_hosts(text: str) -> None:
    probes = re.findall(r"^probe (\d) of (\d) \| task \S+ \| host (\S+)$", text, re.M)
    assert sorted(int(r) for r, _, _ in probes) == [0, 1, 2, 3] and {s for _, s, _ in probes} == {"4"}, text
    # two of the three nodes, two tasks on each: Slurm picks which (a node still cleaning up after the last job
    # is passed over)
    hosts = Counter(h for _, _, h in probes)
    assert sorted(hosts.values()) == [2, 2] and set(hosts) <= {"slmci-h1", "slmci-h2", "slmci-h3"}, text
    trained = re.findall(r"^trained (\d) of 4 \| mean 1.5$", text, re.M)
    assert sorted(trained) == ["0", "1", "2", "3"], text


def test_the_hosts_are_idle_slurm_nodes(slurm: Slurm):
    shown = slurm.run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split("\n")
    assert sorted(line for line in shown if line) == ["slmci-h1 idle", "slmci-h2 idle", "slmci-h3 idle"], shown
    node = slurm.run("scontrol", "show", "node", "slmci-h2").stdout
    assert f"NodeAddr={slurm.subnet[:-4]}2 " in node, node


def test_mpiexec_inside_sbatch_finds_the_allocation(slurm: Slurm, venv: Path):
    """Two jobs at once: the probe (one world of 4, two ranks per host, trained) and the seed example."""
    probe = slurm.submit("--nodes=2", "--ntasks-per-node=2", "scripts/slurm_mpiexec.sh", str(venv), PROBE)
    seed = slurm.submit("--nodes=2", "--ntasks-per-node=2", "scripts/slurm_mpiexec.sh", str(venv),
                        "scripts/seed_example.py")
    status, text = slurm.wait(*probe)
    assert status == 0, text
    _one_world_across_both_hosts(text)
    status, text = slurm.wait(*seed)
    assert status == 0 and re.findall(r"^256\.0$", text, re.M) == ["256.0"] * 4, text


@pytest.mark.limit(900)
def test_the_collective_tests_pass_inside_sbatch(slurm: Slurm, venv: Path):
    """The suite's collective tests (``--only-mpi``: the 2 x 2 stage) at 2 nodes x 2 ranks, under sbatch and the
    venv's mpiexec (Open MPI's idle ranks yield their cores: SHARED_CORES, set by the fixture)."""
    job = slurm.submit("--nodes=2", "--ntasks-per-node=2", "scripts/slurm_mpiexec.sh", str(venv), "-m", "pytest",
                       "-q", "-p", "no:cacheprovider", "--color=no", "tests", "--only-mpi",
                       env={"CLUSTER_HOSTS": "2", "CLUSTER_PPN": "2"})  # the layout, as cluster.py tells its ranks
    status, text = slurm.wait(*job, limit=840)
    assert status == 0, text[-6000:]
    counts = re.findall(r"^(\d+) passed(?:, (\d+) skipped)?(?:, \d+ warnings?)? in [\d.]+s", text, re.M)
    ran = {int(p) + int(s or 0) for p, s in counts}  # a rank's passed and skipped, as each rank counts them
    assert len(counts) == 4 and len(ran) == 1 and min(int(p) for p, _ in counts) > 500, text[-6000:]
    assert not re.search(r"^\d+ failed|^FAILED ", text, re.M), text[-6000:]


def test_srun_with_the_launcher_s_plugin_makes_one_world(slurm: Slurm, venv: Path):
    launcher = Launcher.detect(str(venv / "bin" / "mpiexec"))
    env = ({"OMPI_MCA_btl_tcp_if_include": slurm.subnet, "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,sm,tcp"}
           if launcher.vendor == "Open MPI" else {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"})
    pmi = None
    if launcher.vendor == "Intel MPI":
        if not SLURM_PMI2.exists():
            pytest.skip(f"Intel MPI under srun loads Slurm's {SLURM_PMI2} (Debian's libpmi2-0), not installed")
        pmi, env = str(SLURM_PMI2), {"FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}
    argv = launcher.srun_command([str(venv / "bin" / "python"), PROBE], nodes=2, ppn=2, env=env, pmi_library=pmi)
    status, text = slurm.srun(argv)
    assert status == 0, f"{' '.join(argv)}\n{text}"
    _one_world_across_both_hosts(text)


def test_srun_with_a_plugin_the_mpi_cannot_use_stops_every_task(slurm: Slurm, venv: Path):
    """A bare srun under MPICH; --mpi=pmi2 under Open MPI 5 (its issue 13523): four singletons, each stops."""
    launcher = Launcher.detect(str(venv / "bin" / "mpiexec"))
    plugin = "pmi2" if launcher.vendor == "Open MPI" else "none"
    argv = ["srun", f"--mpi={plugin}", "--nodes=2", "--ntasks-per-node=2", str(venv / "bin" / "python"), PROBE]
    status, text = slurm.srun(argv)
    assert status == 3, f"{' '.join(argv)}: exit status {status}\n{text}"
    assert "trained" not in text, text
    tasks = re.findall(r"^probe 0 of 1 \| task (\d) \| host (\S+)$", text, re.M)
    assert sorted(tasks) == [("0", "slmci-h1"), ("1", "slmci-h1"), ("2", "slmci-h2"), ("3", "slmci-h2")], text
    errors = re.findall(r"^singleton error 0 \| MPI.COMM_WORLD has 1 rank, but the launcher started this process "
                        r"as one of 4 tasks \((.*?)\)\. .*MPI_GRADREDUCER_ALLOW_SINGLETON=1\.$", text, re.M)
    assert len(errors) == 4, text
    seen = "PMI_SIZE=4" if plugin == "pmi2" else "SLURM_NTASKS=4"
    assert all(seen in e for e in errors), text
    fix = {"Open MPI": "`srun --mpi=pmix`", "Intel MPI": "`srun --mpi=pmi2` with I_MPI_PMI_LIBRARY"}.get(
        launcher.vendor, "`srun --mpi=pmi2`")
    assert fix in text and f"`{venv / 'bin' / 'mpiexec'}`, inside the allocation" in text, text


def _on_host(host: str, needle: str) -> list[int]:
    """The processes in host ``host``'s namespace whose command line holds ``needle``."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, timeout=30).stdout.split()
    found = []
    for pid in pids:
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.limit(300)
def test_elastic_node_loss_is_replaced_on_the_free_node(slurm: Slurm, tmp_path: Path):
    """3 nodes x 2 slots, 4 ranks on slmci-h1 and -h2; h2 drained and its ranks killed at step 10: the two
    survivors go on, two replacements start on slmci-h3, and all four end at step 150 with the same weights."""
    venv = _venvs().get("Open MPI")
    if venv is None:
        pytest.skip("needs Open MPI's venv (ULFM): .venv-ompi or MPI_GRADREDUCER_OMPI_VENV")
    out = tmp_path / "out"
    out.mkdir()
    script = "tests/jobs/elastic_train.py"
    job = slurm.submit("--nodes=3", "--ntasks-per-node=2", "scripts/slurm_mpiexec.sh", str(venv), script,
                       "--out", str(out), "--steps", "150", env={"ELASTIC_RANKS": "4"})
    try:
        deadline = time.monotonic() + JOB_LIMIT
        while not any("commit 10 " in p.read_text() for p in out.glob("log.*")):
            assert time.monotonic() < deadline, f"no commit of step 10 within {JOB_LIMIT:g} s"
            time.sleep(0.2)
        assert _on_host("slmci-h3", script) == [], "a rank started on the room node before any loss"
        victims = _on_host("slmci-h2", script)
        assert len(victims) == 2, victims
        drained = slurm.run("scontrol", "update", "nodename=slmci-h2", "state=drain", "reason=node-loss-test")
        assert drained.returncode == 0, drained.stderr
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + JOB_LIMIT
        while len(_on_host("slmci-h3", script)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        replacements = _on_host("slmci-h3", script)
        status, text = slurm.wait(*job, limit=JOB_LIMIT)
    finally:
        slurm.run("scontrol", "update", "nodename=slmci-h2", "state=resume")
    assert len(replacements) == 2, f"replacements on slmci-h3: {replacements}\n{text}"
    finals = sorted(out.glob("final.*.npy"))
    assert len(finals) == 4, f"{len(finals)} processes finished:\n{text}"
    first = np.load(finals[0]).view(np.uint32)
    assert all(np.array_equal(np.load(f).view(np.uint32), first) for f in finals[1:]), "the weights differ"
    assert {(out / f"final.{f.name.split('.')[1]}.txt").read_text().split() == ["150", "4"] for f in finals} \
        == {True}, text
    new = {int(p.name.split(".")[2]) for p in out.glob("pid.new.*")}
    assert new == set(replacements), (new, replacements)
    assert "lost ranks 2, 3 of 4" in text and "2 new rank(s) joined; 4 ranks go on" in text, text
    # Open MPI 5.0.11's mpiexec ends with status 1 after ranks were lost ("LAUNCHER JOB OBJECT NOT FOUND"):
    # the job's own outcome is what the files above show
    print(f"the elastic job's exit status: {status}")
