"""Elastic mode under Open MPI with ULFM: real jobs, ranks SIGKILLed from outside, the survivors go on.

Each test launches ``tests/jobs/elastic_train.py`` with ``mpiexec --with-ft
ulfm`` (``tests/elastic_ompi.py``), kills ranks at a point the job reports
through small files, and checks, in every case: the job exits 0; every
process alive at the end holds bit-identical parameters and reached the
last step; no committed step was lost (each survivor resumed from at least
the last step it had committed); the survivors named the lost ranks.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clusters import ROOT, HostCluster
from conftest import cluster_unavailable
from elastic_ompi import OmpiJob, kill, wait_for, why_not_here
from mpi_gradreducer import jobs

pytestmark = pytest.mark.slow
JOB = "tests/jobs/elastic_train.py"
REASON = why_not_here()
needs_ompi = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def pid_of(out: Path, rank: int, limit: float = 180) -> int:
    return int(wait_for(lambda: (out / f"pid.{rank}").exists() and (out / f"pid.{rank}").read_text(), limit,
                        f"rank {rank}'s pid"))


def phase(out: Path, pid: int) -> tuple[str, int] | None:
    try:
        name, step = (out / f"at.{pid}").read_text().split()
        return name, int(step)
    except (OSError, ValueError):
        return None


def committed(out: Path, step: int) -> bool:
    return any(f"commit {step} " in p.read_text() for p in out.glob("log.*"))


def check(out: Path, job: OmpiJob, steps: int, size: int, lost: list[int], limit: float = 120) -> dict[int, list[str]]:
    """The checks every scenario ends with; returns each finishing process's log lines."""
    try:
        rc = job.wait(limit)
    except AssertionError:
        _launcher_only(out, size)
        raise
    assert rc == 0, f"exit status {rc}:\n{job.output[-6000:]}"
    return check_finals(out, steps, size, lost, job.output)


def check_finals(out: Path, steps: int, size: int, lost: list[int], output: str) -> dict[int, list[str]]:
    """The checks on what the finishing processes wrote: the same parameters, every committed step kept, the lost
    ranks named; returns each finishing process's log lines."""
    finals = sorted(out.glob("final.*.npy"))
    assert len(finals) == size, f"{len(finals)} processes finished, expected {size}:\n{output[-4000:]}"
    first = np.load(finals[0])
    for f in finals[1:]:
        assert np.array_equal(np.load(f).view(np.uint32), first.view(np.uint32)), f"{f.name} differs from {finals[0]}"
    logs: dict[int, list[str]] = {}
    for f in finals:
        pid = int(f.name.split(".")[1])
        step, now = (int(v) for v in (out / f"final.{pid}.txt").read_text().split())
        assert (step, now) == (steps, size), f"process {pid} ended at step {step} with {now} ranks"
        lines = (out / f"log.{pid}").read_text().splitlines()
        last = 0
        for line in lines:
            if line.startswith("commit "):
                last = int(line.split()[1])
            elif line.startswith("resume "):
                resumed = int(line.split()[1])
                assert resumed >= last, f"process {pid} resumed at step {resumed} after committing step {last}"
        logs[pid] = lines
    if lost:
        named = " ".join(line for lines in logs.values() for line in lines if line.startswith("failure "))
        for r in lost:
            assert re.search(rf"lost ranks? [0-9, ]*\b{r}\b", named), f"rank {r} not named lost: {named[:500]}"
    return logs


def _launcher_only(out: Path, size: int) -> None:
    """xfail when only Open MPI's launcher is left: every survivor finished and every rank process has ended.

    Seen now and then with Open MPI 5.0.11 after two ranks were lost at
    once: ``prterun`` waits on although each rank has exited (or is a zombie
    it has not reaped). Anything else (a rank still running) is a failure.
    """
    running = [pid for pid in pids(out) if alive(pid)]
    if len(list(out.glob("final.*.npy"))) == size and not running:
        pytest.xfail("every rank had ended, but Open MPI's launcher (prterun 5.0.11) did not exit")


def pids(out: Path, pattern: str = "pid.*") -> list[int]:
    """The process ids the job wrote (``pid.R``, and ``pid.new.PID`` for replacements; ``pattern`` picks)."""
    return [int(p.read_text()) for p in sorted(out.glob(pattern)) if p.read_text().strip()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def start(tmp_path: Path, *args: str, ranks: int = 4, env: dict[str, str] | None = None) -> tuple[Path, OmpiJob]:
    out = tmp_path / "out"
    out.mkdir()
    return out, OmpiJob(JOB, "--out", str(out), *args, ranks=ranks, env=env)


@needs_ompi
@pytest.mark.parametrize("victim", [2, 0], ids=["one-rank", "rank-0"])
def test_lost_rank_mid_collective(tmp_path: Path, victim: int) -> None:
    """A straggler holds the others inside a step's collective; the victim is killed while it waits there."""
    survivor = next(r for r in range(4) if r != victim)
    out, job = start(tmp_path, "--steps", "40", "--straggle", f"{survivor}:12")
    with job:
        pid = pid_of(out, victim)
        wait_for(lambda: phase(out, pid) == ("reduce", 12), 180, "the victim in step 12's call", job)
        time.sleep(0.3)  # it is blocked in the collective, waiting for the straggler
        kill(pid)
        check(out, job, 40, 3, [victim])


@needs_ompi
def test_two_ranks_at_once(tmp_path: Path) -> None:
    """Ranks 1 and 3 are killed together while the ranks train (no one holds them anywhere)."""
    out, job = start(tmp_path, "--steps", "40")
    with job:
        pids = [pid_of(out, r) for r in (1, 3)]
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        for p in pids:
            kill(p)
        check(out, job, 40, 2, [1, 3], limit=60)


@needs_ompi
def test_second_failure_during_recovery(tmp_path: Path) -> None:
    """Rank 1 is killed; rank 3 is killed while the survivors wait for it in the recovery's sync."""
    out, job = start(tmp_path, "--steps", "40", "--slow-sync", "3")
    with job:
        first, second = pid_of(out, 1), pid_of(out, 3)
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        kill(first)
        wait_for(lambda: phase(out, second) == ("sync", phase(out, second)[1] if phase(out, second) else -1), 180,
                 "rank 3 in the recovery's sync", job)
        time.sleep(0.5)  # the others wait for it inside the sync's collectives
        kill(second)
        check(out, job, 40, 2, [])
        # numbered in the communicator of the moment: rank 3 of 4 was rank 2 of the 3 survivors
        assert "lost rank 1 of 4" in job.output and "lost rank 2 of 3" in job.output, job.output[-3000:]


@needs_ompi
def test_lost_rank_with_a_large_bucket_in_flight(tmp_path: Path) -> None:
    """A rank is killed while a 48 MiB parameter's reduction is in flight."""
    out, job = start(tmp_path, "--steps", "16", "--ballast-mb", "48", "--step-seconds", "0")
    with job:
        victim = pid_of(out, 2)
        wait_for(lambda: phase(out, victim) == ("reduce", 6), 180, "rank 2 in step 6's call", job, every=0.001)
        kill(victim)
        check(out, job, 16, 3, [2], limit=180)


@needs_ompi
def test_lost_rank_during_commit(tmp_path: Path) -> None:
    """A rank is killed while it commits 48 MiB of state (the others commit too, or have)."""
    out, job = start(tmp_path, "--steps", "16", "--ballast-mb", "48", "--step-seconds", "0")
    with job:
        victim = pid_of(out, 1)
        wait_for(lambda: phase(out, victim) == ("commit", 6), 180, "rank 1 in step 6's commit", job, every=0.001)
        kill(victim)
        check(out, job, 16, 3, [1], limit=180)


@needs_ompi
def test_replacement_joins_mid_run(tmp_path: Path) -> None:
    """With room for 4 in the host file, a lost rank is replaced: a new process joins and training ends at 4."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    out, job = start(tmp_path, "--steps", "150", env={"MPI_GRADREDUCER_ELASTIC_HOSTFILE": str(hosts)})
    with job:
        victim = pid_of(out, 2)
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        kill(victim)
        logs = check(out, job, 150, 4, [2])
        new = [p for p in logs if (out / f"pid.new.{p}").exists()]
        assert len(new) == 1, f"expected one replacement among the finishers, got {new}"
        assert any(line.startswith("resume ") and line.split()[2] == "4" for line in logs[new[0]])
        assert logs[new[0]][0] == "start 4 3", logs[new[0]][:3]  # its state said the world it joins from its start


@needs_ompi
def test_a_replacement_killed_as_it_starts(tmp_path: Path) -> None:
    """Rank 2 is lost with room for 4; its replacement is SIGKILLed as soon as it starts (before it reaches the run
    loop): its loss does not reach the running ranks, which train on; past the join timeout (8 s here) its start
    counts as failed, another one starts and joins, and all four finish with the same parameters, no committed
    step lost."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    out, job = start(tmp_path, "--steps", "600", env={"MPI_GRADREDUCER_ELASTIC_HOSTFILE": str(hosts),
                                                      "MPI_GRADREDUCER_ELASTIC_JOIN_TIMEOUT": "8"})
    with job:
        victim = pid_of(out, 2)
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        kill(victim)
        new = wait_for(lambda: [p for p in out.glob("pid.new.*") if p.read_text().strip()], 120, "a replacement",
                       job)
        first = int(new[0].read_text())
        kill(first)
        job.wait(180)  # its status is Open MPI's: 137 after a replacement was killed (docs/elastic.rst, Limits)
    logs = check_finals(out, 600, 4, [2], job.output)
    assert first not in logs, "the killed replacement finished"
    assert "did not reach the run loop within 8 s" in job.output, job.output[-4000:]
    assert "1 new rank(s) joined" in job.output, job.output[-4000:]


@needs_ompi
def test_ranks_beyond_the_listed_slots_are_drained(tmp_path: Path) -> None:
    """The host file goes from room for 4 to room for 2: at a commit the two highest ranks leave cleanly, the two
    others go on to the end from that commit (nothing restored, nothing lost) and the job exits 0."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    out, job = start(tmp_path, "--steps", "100", env={"MPI_GRADREDUCER_ELASTIC_HOSTFILE": str(hosts)})
    with job:
        leavers = [pid_of(out, r) for r in (2, 3)]
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        hosts.write_text("localhost:2  # two slots taken away\n")
        logs = check(out, job, 100, 2, [])
    assert not any((out / f"final.{pid}.npy").exists() for pid in leavers)
    assert not any(alive(pid) for pid in leavers)
    said = re.findall(r"rank (\d) of 4 leaves at the commit of (\d+)", job.output)
    assert sorted(r for r, _ in said) == ["2", "3"], job.output[-4000:]
    assert "2 drained rank(s) left; 2 ranks go on" in job.output
    assert said[0][1] == said[1][1], said
    gone = int(said[0][1])
    for lines in logs.values():
        assert not any(line.startswith("failure ") for line in lines), lines
        resumed = [line.split() for line in lines if line.startswith("resume ")]
        assert [r[2] for r in resumed] == ["2"], resumed  # one change of ranks, to 2, and no restore
        assert int(resumed[0][1]) == gone, (resumed, gone)  # on from the very commit at which the others left
    for pid in leavers:
        lines = (out / f"log.{pid}").read_text().splitlines()
        assert lines[-1].startswith(f"commit {gone - 1} "), lines[-3:]  # commit {gone} raised: they left there


@needs_ompi
def test_a_stopped_rank_is_seen_by_the_heartbeat_detector(tmp_path: Path) -> None:
    """MPI_GRADREDUCER_ELASTIC_DETECT=2: a rank SIGSTOPped (alive, silent: its launcher reports nothing) is declared
    lost by ULFM's heartbeats; the three others go on within seconds, then the stopped process is SIGKILLed."""
    out, job = start(tmp_path, "--steps", "400", env={"MPI_GRADREDUCER_ELASTIC_DETECT": "2"})
    with job:
        victim = pid_of(out, 2)
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        stopped = time.time()
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_for(lambda: any(line.startswith("resume ") and float(line.split()[3]) > stopped
                                 for p in out.glob("log.*") for line in p.read_text().splitlines()),
                     60, "the survivors' resume", job)
            seen = time.time() - stopped
        finally:
            kill(victim)
        check(out, job, 400, 3, [2])
    assert seen < 30, seen


def test_detector_settings_from_the_environment() -> None:
    """MPI_GRADREDUCER_ELASTIC_DETECT=S: ULFM's detector on (not its thread), timeout S, period S/4; bad values
    name the variable."""
    from mpi_gradreducer._core.faults import detector_settings

    assert detector_settings({}) == {}
    assert detector_settings({"MPI_GRADREDUCER_ELASTIC_DETECT": "2"}) == {
        "OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_thread": "false",
        "OMPI_MCA_mpi_ft_detector_timeout": "2", "OMPI_MCA_mpi_ft_detector_period": "0.5"}
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match=rf"MPI_GRADREDUCER_ELASTIC_DETECT: expected a positive number .*{bad}"):
            detector_settings({"MPI_GRADREDUCER_ELASTIC_DETECT": bad})


def test_drained_ranks_are_those_beyond_their_host_s_slots() -> None:
    """The ranks a drain lets go: every rank of a host no longer listed, and the highest beyond a host's slots."""
    from mpi_gradreducer.elastic.discovery import leaving

    assert leaving({"a": 2, "b": 2}, ["a", "a", "b", "b"]) == []
    assert leaving({"a": 2}, ["a", "b", "a", "b"]) == [1, 3]
    assert leaving({"a": 1, "b": 3}, ["a", "b", "a", "a"]) == [2, 3]
    assert leaving({}, ["a", "a"]) == [0, 1]


def test_the_running_hosts_travel_as_runs_and_come_back_the_same() -> None:
    """What the running ranks pass to the processes they start: their hosts in rank order, as runs, so that 64
    ranks on 8 hosts of 20-character names stay within Open MPI's 256 characters of an info value."""
    from mpi_gradreducer.elastic.world import RUNNING_HOSTS_ENV, _hosts_from, _hosts_value

    for hosts in ([], ["a"], ["a", "a", "b", "a"], ["node-17.cluster", "node-17.cluster", "node-2"]):
        assert _hosts_from(_hosts_value(hosts)) == hosts
    assert _hosts_value(["a", "a", "b", "a"]) == "a*2,b,a"
    big = [f"compute-node-{h:02d}.site" for h in range(8) for _ in range(8)]
    assert _hosts_from(_hosts_value(big)) == big
    assert len(f"{RUNNING_HOSTS_ENV}={_hosts_value(big)}") < 256
    assert _hosts_from("a*x") == []  # malformed: the new process then counts only the processes started with it


@needs_ompi
def test_after_recovery_bitwise_as_a_fresh_run(tmp_path: Path) -> None:
    """deterministic=True: the 3 survivors' run from the commit equals a fresh 3-rank run from that state."""
    out, job = start(tmp_path, "--steps", "30", "--save-resume")
    with job:
        victim = pid_of(out, 1)
        wait_for(lambda: committed(out, 8), 180, "step 8's commit", job)
        kill(victim)
        check(out, job, 30, 3, [1])
    elastic = np.load(next(out.glob("final.*.npy")))
    fresh_out = tmp_path / "fresh"
    fresh_out.mkdir()
    with OmpiJob(JOB, "--out", str(fresh_out), "--steps", "30", "--load", str(out / "resume.npz"), ranks=3) as fresh:
        assert fresh.wait(120) == 0, fresh.output[-4000:]
    again = np.load(next(fresh_out.glob("final.*.npy")))
    assert np.array_equal(elastic.view(np.uint32), again.view(np.uint32)), \
        f"max difference {np.max(np.abs(elastic - again))}"


@needs_ompi
def test_below_min_size_ends_with_a_clear_message(tmp_path: Path) -> None:
    """min_size=4, no room listed: the survivors wait the timeout, then end with a message; no hang."""
    out, job = start(tmp_path, "--steps", "200", "--min-size", "4", env={"MPI_GRADREDUCER_ELASTIC_TIMEOUT": "3"})
    with job:
        victim = pid_of(out, 3)
        wait_for(lambda: committed(out, 5), 180, "step 5's commit", job)
        t0 = time.monotonic()
        kill(victim)
        rc = job.wait(90)
        # the survivors end it with MPI_Abort(1); Open MPI 5.0.11's mpiexec was seen to exit 0 all the same after the
        # lost rank (twice in about fifteen runs, the abort notice in its output): the abort is what the package does
        assert rc != 0 or "MPI_ABORT was invoked" in job.output, \
            f"exit 0: the job went on after rank 3's loss\n{job.output[-3000:]}\n" + "".join(
                f"--- {p.name}\n{p.read_text()[-600:]}" for p in sorted(out.glob("log.*")))
        assert not list(out.glob("final.*")), "a survivor trained on below min_size"
        assert "fewer than min_size=4" in job.output and "within 3 s" in job.output, job.output[-3000:]
        assert time.monotonic() - t0 < 60


@needs_ompi
def test_watchdog_does_not_abort_the_survivors(tmp_path: Path) -> None:
    """Reducers with a 2 s watchdog timeout and the exception hook on; the recovery and a replacement's
    start take longer than 2 s: the job still ends with every rank, exit 0."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    out, job = start(tmp_path, "--steps", "120", "--timeout", "2", "--progress", "thread",
                     env={"MPI_GRADREDUCER_ELASTIC_HOSTFILE": str(hosts)})
    with job:
        victim = pid_of(out, 0)
        wait_for(lambda: committed(out, 10), 180, "step 10's commit", job)
        kill(victim)
        check(out, job, 120, 4, [0])
        assert "Aborting the job" not in job.output


def test_discovery_lines_and_placement(tmp_path: Path) -> None:
    """Host lists with Horovod's semantics: HOST[:SLOTS], localhost is this host, free slots in listed order."""
    import socket

    from mpi_gradreducer.elastic import Discovery
    from mpi_gradreducer.elastic.discovery import parse_hosts, placement

    here = socket.gethostname()
    assert parse_hosts("a:2\n# comment\nb\n\nlocalhost:3  # this one\na:1\n", slots=4) == {"a": 3, "b": 4, here: 3}
    with pytest.raises(ValueError, match=r"the host list, line 2: expected HOST or HOST:SLOTS .* got 'b:0'"):
        parse_hosts("a:1\nb:0")
    assert placement({"a": 2, "b": 2}, ["a", "b", "b"], 3) == ["a"]
    assert placement({"a": 2, "b": 2}, [], 3) == ["a", "a", "b"]
    # a host that lost ranks comes last, and still serves when no other has room
    assert placement({"a": 2, "b": 2, "c": 2}, ["a", "a"], 2, last={"b"}) == ["c", "c"]
    assert placement({"a": 2, "b": 2, "c": 2}, ["a", "a", "c"], 2, last={"b"}) == ["c", "b"]
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho nodeA:2\necho nodeB\n")
    script.chmod(0o755)
    assert Discovery(script=str(script), slots=2).hosts() == {"nodeA": 2, "nodeB": 2}
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeC:5\n")
    assert Discovery(hostfile=str(hostfile)).hosts() == {"nodeC": 5}
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with 3: broken"):
        Discovery(script=str(failing)).hosts()
    with pytest.raises(ValueError, match="both set"):
        Discovery.from_env({"MPI_GRADREDUCER_ELASTIC_DISCOVERY": "x", "MPI_GRADREDUCER_ELASTIC_HOSTFILE": "y"})


def test_mpich_says_once_that_a_loss_ends_the_job(tmp_path: Path) -> None:
    """Under an MPI without ULFM the run loop says so once, naming the fix, and trains as usual."""
    from mpi4py import MPI

    if MPI.Get_library_version().startswith("Open MPI") or MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("runs under MPICH, from a single process")
    import shutil

    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if mpiexec is None:
        pytest.skip("needs mpiexec")
    out = tmp_path / "out"
    out.mkdir()
    root = Path(__file__).resolve().parents[1]
    done = jobs.run([mpiexec, "-n", "2", sys.executable, str(root / JOB), "--out", str(out), "--steps", "5"],
                    cwd=root, timeout=120)
    assert done.returncode == 0 and not done.timed_out, done.stderr[-3000:]
    assert done.stderr.count("a lost rank will end this job") == 1, done.stderr
    assert "--with-ft ulfm" in done.stderr
    assert len(list(out.glob("final.*.npy"))) == 2


CLUSTER_REASON = REASON or cluster_unavailable()


@pytest.mark.hosts
@pytest.mark.skipif(CLUSTER_REASON is not None, reason=str(CLUSTER_REASON))
def test_every_rank_of_one_host_killed_on_a_cluster(tmp_path: Path) -> None:
    """2 hosts x 2 ranks of network namespaces (MPI over TCP between them): both ranks of host 2 are SIGKILLed
    mid-training (its launcher daemon lives on); the two ranks of host 1 go on and finish."""
    out = tmp_path / "out"
    out.mkdir()
    cluster = HostCluster(2)
    try:
        cluster.start(sys.executable, str(ROOT / JOB), "--out", str(out), "--steps", "60", ft=True)
        victims = [pid_of(out, r) for r in (2, 3)]
        assert set(victims) <= set(cluster.on_host(2)), (victims, cluster.on_host(2))
        wait_for(lambda: committed(out, 10), 120, "step 10's commit")
        for pid in victims:
            kill(pid)
        status = cluster.finish()
        assert status == 0, f"exit status {status}\n{cluster.report()[-6000:]}"
        check_finals(out, 60, 2, [2, 3], cluster.report())
    finally:
        problems = cluster.close()
        assert not problems, problems


@pytest.mark.hosts
@pytest.mark.skipif(CLUSTER_REASON is not None, reason=str(CLUSTER_REASON))
def test_a_host_removed_from_the_host_file_is_drained_on_a_cluster(tmp_path: Path) -> None:
    """2 hosts x 2 ranks of network namespaces: host 2 leaves the host file mid-training; at a commit its two
    ranks leave cleanly, the two ranks of host 1 go on to the end and the job exits 0."""
    out = tmp_path / "out"
    out.mkdir()
    hosts = tmp_path / "hosts"
    cluster = HostCluster(2)
    try:
        hosts.write_text(f"{cluster.name}-h1:2\n{cluster.name}-h2:2\n")
        cluster.start(sys.executable, str(ROOT / JOB), "--out", str(out), "--steps", "60", "--hostfile", str(hosts),
                      ft=True)
        leavers = [pid_of(out, r) for r in (2, 3)]
        assert set(leavers) <= set(cluster.on_host(2)), (leavers, cluster.on_host(2))
        wait_for(lambda: committed(out, 10), 120, "step 10's commit")
        hosts.write_text(f"{cluster.name}-h1:2\n")
        status = cluster.finish()
        report = cluster.report()
        assert status == 0, f"exit status {status}\n{report[-6000:]}"
        check_finals(out, 60, 2, [], report)
        assert not any((out / f"final.{pid}.npy").exists() for pid in leavers)
        assert sorted(re.findall(r"rank (\d) of 4 leaves at the commit", report)) == ["2", "3"], report[-4000:]
        assert not cluster.on_host(2), cluster.on_host(2)
    finally:
        problems = cluster.close()
        assert not problems, problems


@pytest.mark.hosts
@pytest.mark.skipif(CLUSTER_REASON is not None, reason=str(CLUSTER_REASON))
@pytest.mark.parametrize("lost", [True, False], ids=["replaced", "grown"])
def test_new_ranks_start_on_an_idle_host_on_a_cluster(tmp_path: Path, lost: bool) -> None:
    """3 hosts of network namespaces, 4 ranks on hosts 1 and 2, host 3 idle; the host file lists 2 slots on each
    (the launcher knows the hosts by those names). ``replaced``: at most 4 ranks; both ranks of host 2 are
    SIGKILLed, and their replacements start on host 3 (a host that lost ranks comes last). ``grown``: at most 6;
    two new ranks start on host 3. Either way the job ends with every rank at the last step, the same parameters
    everywhere, no committed step lost, and nothing left on the hosts."""
    out = tmp_path / "out"
    out.mkdir()
    hosts = tmp_path / "hosts"
    cluster = HostCluster(3)
    try:
        hosts.write_text("".join(f"{cluster.name}-h{h}:2\n" for h in (1, 2, 3)))
        cluster.start(sys.executable, str(ROOT / JOB), "--out", str(out), "--steps", "300", "--hostfile", str(hosts),
                      "--max-size", "4" if lost else "6", ft=True, ranks=4, names=True)
        victims = [pid_of(out, r) for r in (2, 3)]
        assert set(victims) <= set(cluster.on_host(2)), (victims, cluster.on_host(2))
        wait_for(lambda: committed(out, 10), 120, "step 10's commit")
        if lost:
            for pid in victims:
                kill(pid)
        status = cluster.finish()
        report = cluster.report()
        # after a loss, in a job across hosts that took new ranks in, Open MPI 5.0.11's MPI_Finalize waits for good
        # (docs/elastic.rst, Limits): each process ends 10 s later without it, and mpiexec's status is then 1
        stuck = report.count("MPI_Finalize has not returned after")
        assert status == 0 or (lost and stuck == 4), f"exit status {status}\n{report[-6000:]}"
        logs = check_finals(out, 300, 4 if lost else 6, [2, 3] if lost else [], report)
        new = [pid for pid in logs if (out / f"pid.new.{pid}").exists()]
        assert len(new) == 2, f"expected two new ranks among the finishers, got {new}:\n{report[-4000:]}"
        for pid in new:
            assert f"host {cluster.name}-h3" in logs[pid], (pid, logs[pid][:3])
        assert not any(cluster.on_host(h) for h in (1, 2, 3)), [cluster.on_host(h) for h in (1, 2, 3)]
    finally:
        problems = cluster.close()
        assert not problems, problems
