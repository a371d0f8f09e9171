"""Across hosts: whole jobs on a cluster of network namespaces, with a link cut, an outage, a host lost.

Each test makes its own cluster of 2 hosts with ``scripts/cluster.py`` and
runs ``tests/jobs/train.py`` on it with 2 ranks per host, MPI over TCP
through the hosts' NICs. While the job trains, the test cuts host 2's link
for good (inside a reduction, found by watching the link's bytes), or for a
few seconds, or host 2 dies (its link cut and every process on it killed),
or host 2's ranks are killed while it lives on. The job must end within
seconds of the watchdog's timeout, its surviving ranks naming the ranks they
lost (or go on with the right weights, after a step that stalled through
the outage). Every process a test starts is found by a mark in its
environment (:mod:`clusters`), while the job runs, after it ended, and after
the cluster is down: none may be left, nor found and killed by
``cluster.py run`` after ``mpiexec`` ended; ``cluster.py down`` must itself end
a process left on a host. The harness's own errors (not root, a
bad host count or rate, a failing command, a counter it cannot read, an
interruption) are tested here too: each says what is wrong and leaves
nothing behind.

These tests need root and network namespaces; where ``cluster.py check``
says they are not available, they are skipped. Like ``test_faults.py``,
they run from a single process (skipped under ``mpiexec`` with more ranks).
They run under the MPI of the Python that runs them (``cluster.py`` starts
the ``mpiexec`` beside it). Where the launchers differ, each is held to its
own words: Hydra (MPICH, Intel MPI) ends the job once the ranks it reaches
have aborted; Open MPI's PRRTE loses the cut-off host first
(``cluster.HOST_TIMEOUT``) and ends the job itself, naming that host.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from clusters import CLUSTER, ROOT, HostCluster, cli, job_env, kill_tagged, leftovers, new_name, new_tag, tagged
from conftest import cluster_unavailable, job_launcher
from mpi_gradreducer import jobs

TRAIN = ROOT / "tests" / "jobs" / "train.py"
#: The reducer's timeout in the jobs whose link is cut for good.
TIMEOUT = 4.0
#: A waiting rank's watchdog asks the others for 3 s before it aborts; then MPI_Abort and the harness.
GRACE = 3.0 + 4.0
#: The weights of train.py's model with ``--inputs=INPUTS``: ``INPUTS x 8`` and 8 float32.
INPUTS = 50_000
MODEL_BYTES = (INPUTS * 8 + 8) * 4

UNAVAILABLE = cluster_unavailable()
#: Whose mpiexec the jobs run under (None: no mpiexec; the tests that launch jobs then fail to start them).
LAUNCHER = job_launcher() if UNAVAILABLE is None else None
PRRTE = LAUNCHER is not None and LAUNCHER.kind == "prrte"
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]


def _cluster(rate: str = "none") -> Iterator[HostCluster]:
    made = HostCluster(2, rate)
    yield made
    problems = made.close()
    assert not problems, problems


@pytest.fixture
def cluster() -> Iterator[HostCluster]:
    """2 hosts, unshaped."""
    yield from _cluster()


@pytest.fixture
def slow_cluster() -> Iterator[HostCluster]:
    """2 hosts whose NICs send 5 Mbit/s: a 1.6 MB reduction takes 2.6 s on the wire."""
    yield from _cluster("5mbit")


def train(cluster: HostCluster, *args: str) -> None:
    cluster.start(sys.executable, str(TRAIN), *args)


def finished(cluster: HostCluster) -> dict[int, str]:
    """Rank to digest of its trained weights, for each rank that finished."""
    found = (re.fullmatch(r"rank (\d): finished, weights ([0-9a-f]+)", line) for line in cluster.lines)
    return {int(m[1]): m[2] for m in found if m}


def ranks_on(cluster: HostCluster, host: int) -> list[int]:
    """The job's ranks running on host ``host``, found by the test's mark."""
    return sorted(pid for pid, cmd in cluster.on_host(host).items() if str(TRAIN) in cmd)


def assert_job_running(cluster: HostCluster) -> None:
    """The processes of the job are seen where they run: the check that finds leftovers can find them."""
    every = cluster.processes()
    assert len(ranks_on(cluster, 1)) == len(ranks_on(cluster, 2)) == 2, every
    outside = set(every) - set(cluster.on_host(1)) - set(cluster.on_host(2))
    # the launcher, in the root namespace: Hydra's mpiexec, or Open MPI's, which runs PRRTE's prterun
    assert any(re.search(r"\b(mpiexec|prterun)\b", every[pid]) for pid in outside), every


def lost(cluster: HostCluster) -> dict[str, str]:
    """Rank to the call it waited in, for each rank that printed the watchdog's diagnosis naming ranks 2 and 3
    as lost (no answer) and aborted."""
    found = re.findall(rf"mpi_gradreducer: rank (\d): call (\d+), bucket \d+ \(\d+ bytes\) has not completed "
                       rf"after [\d.]+ s \(timeout={TIMEOUT:g} s\); missing ranks: 2, 3 \[rank 2: no answer[^\]]*; "
                       rf"rank 3: no answer[^\]]*\]\. Aborting the job\.", cluster.stderr)
    return dict(found)


def launcher_lost_host_2(cluster: HostCluster, status: int) -> None:
    """Under Open MPI: its launcher lost host 2 before any watchdog fired, and ended the job naming that host:
    as a daemon it lost communication with (a cut link), or one that failed to report back (a daemon killed)."""
    said = "\n".join(cluster.lines) + "\n" + cluster.stderr
    assert re.search(rf"PRTE has lost communication with a remote daemon\.[\s\S]*?Remote daemon: \S+ on node "
                     rf"{cluster.name}-h2\n|A daemon failed to report back[\s\S]*?Remote host:\s+{cluster.name}-h2\n",
                     said), cluster.report()
    if status == 0:
        pytest.xfail("Open MPI 5.0.11's mpiexec (PRRTE 3) exits 0 after ending a job for a lost host")


def steps_done(cluster: HostCluster, rank: int) -> list[int]:
    return [int(m[1]) for m in (re.fullmatch(rf"rank {rank}: step (\d+) done", line) for line in cluster.lines) if m]


def test_healthy_job_sends_its_gradients_through_the_links(cluster: HostCluster):
    """The same job without its reductions (``--steps=0``: the launch, the broadcast, the output) is run
    too, and its bytes taken off: 20 reductions of 1.6 MB must add what a ring sends, 1.6 MB a host each."""
    steps = 20
    totals = {}
    for n in (0, steps):
        before = cluster.sent()
        train(cluster, f"--steps={n}", f"--inputs={INPUTS}", "--progress")
        if n:
            cluster.wait_for("rank 0: step 1 done")
            assert_job_running(cluster)
        assert cluster.finish() == 0, cluster.report()
        assert sorted(finished(cluster)) == [0, 1, 2, 3], cluster.report()
        assert len(set(finished(cluster).values())) == 1, cluster.report()
        after = cluster.sent()
        totals[n] = {h: after[h] - before[h] for h in after}
    per_step = {h: (totals[steps][h] - totals[0][h]) / steps for h in totals[0]}
    ring = MODEL_BYTES  # 2 (hosts - 1) / hosts of it, at 2 hosts
    print(f"without reductions: {totals[0]} bytes; per reduction: {per_step} ({ring} a ring)")  # pytest -rP
    assert all(0.95 <= b / ring <= 1.05 for b in per_step.values()), (
        f"each host should send {ring} bytes a reduction; per step: {per_step} (the job without reductions: "
        f"{totals[0]})")


def test_link_cut_for_good_between_steps_every_reporting_rank_names_the_lost_ranks(cluster: HostCluster):
    """A small model (one message with the call header): the cut lands between reductions, which take well
    under a millisecond; the ranks wait in the next call's first message."""
    train(cluster, "--steps=400", "--pause=0.05", "--progress", f"--timeout={TIMEOUT:g}")
    cluster.wait_for("rank 0: step 5 done")
    assert_job_running(cluster)
    assert cluster.cli("cut", "2").returncode == 0
    cut = time.monotonic()
    status = cluster.finish()
    took = time.monotonic() - cut
    assert took < TIMEOUT + GRACE, f"the job ended {took:.1f} s after the cut\n{cluster.report()}"
    assert not finished(cluster), cluster.report()
    if PRRTE:
        return launcher_lost_host_2(cluster, status)
    assert status != 0, cluster.report()
    named = lost(cluster)
    assert sorted(named) == ["0", "1"], f"ranks 0 and 1 (on the host that can still report) must name 2 and " \
        f"3\n{cluster.report()}"
    for rank, call in named.items():  # the call named is the one that never completed
        assert max(steps_done(cluster, int(rank))) == int(call) - 1, cluster.report()
    assert not finished(cluster), cluster.report()


def test_link_cut_for_good_inside_a_reduction_every_reporting_rank_names_the_lost_ranks(slow_cluster: HostCluster):
    """A 1.6 MB model, summed in two levels, at 5 Mbit/s: host 2's share takes 2.6 s on the wire. The test
    watches what host 2 sends between steps (0.3 s apart) and cuts its link once the second reduction has
    begun; then it reads how much of host 2's share had crossed: some, not all."""
    cluster = slow_cluster
    train(cluster, "--steps=400", "--pause=0.3", "--progress", f"--timeout={TIMEOUT:g}", f"--inputs={INPUTS}")
    cluster.wait_for("rank 0: step 1 done")
    assert_job_running(cluster)
    start = cluster.link_counter(2)
    deadline = time.monotonic() + 10
    while cluster.link_counter(2) - start < 64 << 10:  # the second reduction has begun
        assert time.monotonic() < deadline, f"host 2 sent nothing for 10 s\n{cluster.report()}"
        time.sleep(0.001)
    assert cluster.cli("cut", "2").returncode == 0
    cut = time.monotonic()
    crossed = cluster.link_counter(2) - start
    print(f"host 2 had sent {crossed} of its {MODEL_BYTES} bytes of the reduction when its link was cut")
    assert 64 << 10 <= crossed < 0.9 * MODEL_BYTES, (
        f"the cut did not land inside the reduction: host 2 had sent {crossed} of its {MODEL_BYTES} bytes")
    status = cluster.finish()
    took = time.monotonic() - cut
    assert took < TIMEOUT + GRACE, f"the job ended {took:.1f} s after the cut\n{cluster.report()}"
    assert not finished(cluster), cluster.report()
    if PRRTE:
        return launcher_lost_host_2(cluster, status)
    assert status != 0, cluster.report()
    named = lost(cluster)
    assert named == {"0": "2", "1": "2"}, f"ranks 0 and 1 must name 2 and 3, lost in call 2\n{cluster.report()}"
    assert steps_done(cluster, 0) == steps_done(cluster, 1) == [1], cluster.report()
    assert not finished(cluster), cluster.report()


def test_link_outage_shorter_than_the_timeout_is_survived(cluster: HostCluster):
    """A step stalls through a 3 s outage and completes after it: the same weights as without the outage."""
    train(cluster, "--steps=30", "--pause=0.05")
    assert cluster.finish() == 0, cluster.report()
    healthy = finished(cluster)
    assert sorted(healthy) == [0, 1, 2, 3] and len(set(healthy.values())) == 1, cluster.report()

    train(cluster, "--steps=30", "--pause=0.05", "--progress", "--timeout=20")
    cluster.wait_for("rank 0: step 5 done")
    assert cluster.cli("cut", "2").returncode == 0
    down = time.monotonic()  # the link is down from here
    time.sleep(3)
    up = time.monotonic()  # until at least here
    assert cluster.cli("restore", "2").returncode == 0
    assert cluster.finish() == 0, cluster.report()
    steps = {int(m[1]): t for t, m in ((t, re.fullmatch(r"rank 0: step (\d+) done", line))
                                      for t, line in cluster.timed) if m}
    stalled = [k for k in steps if k - 1 in steps and steps[k - 1] < down and steps[k] > up]
    print("rank 0's steps, s after the cut:", {k: round(t - down, 2) for k, t in steps.items()})
    assert stalled, f"no step began before the outage and completed after it\n{cluster.report()}"
    assert finished(cluster) == healthy, f"different weights after the outage\n{cluster.report()}"
    assert "mpi_gradreducer:" not in cluster.stderr, cluster.report()


def test_a_host_that_dies_is_named_by_every_survivor(cluster: HostCluster):
    """Host 2 dies as a machine does (power, kernel): its link goes silent and every process on it is gone.
    The ranks of host 1 wait out the timeout, name ranks 2 and 3 as lost and end the job."""
    train(cluster, "--steps=400", "--pause=0.05", "--progress", f"--timeout={TIMEOUT:g}")
    cluster.wait_for("rank 0: step 5 done")
    assert_job_running(cluster)
    assert cluster.cli("cut", "2").returncode == 0
    victims = cluster.on_host(2)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    dead = time.monotonic()
    status = cluster.finish()
    took = time.monotonic() - dead
    assert took < TIMEOUT + GRACE, f"{took:.1f} s\n{cluster.report()}"
    assert not finished(cluster), cluster.report()
    if PRRTE:
        return launcher_lost_host_2(cluster, status)
    assert status != 0, cluster.report()
    assert sorted(lost(cluster)) == ["0", "1"], f"ranks 0 and 1 must name ranks 2 and 3 as lost\n" \
        f"{cluster.report()}"
    assert not finished(cluster), cluster.report()


def test_every_rank_of_one_host_killed_the_launcher_ends_the_job_at_once(cluster: HostCluster):
    """Host 2 lives on, its ranks killed (an out-of-memory killer): the launcher sees them exit and ends the
    job before any watchdog has anything to say."""
    train(cluster, "--steps=400", "--pause=0.05", "--progress", f"--timeout={TIMEOUT:g}")
    cluster.wait_for("rank 0: step 5 done")
    pids = ranks_on(cluster, 2)
    assert len(pids) == 2, cluster.on_host(2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    status = cluster.finish()
    took = time.monotonic() - killed
    assert status != 0 and took < TIMEOUT, f"{took:.1f} s\n{cluster.report()}"
    assert "mpi_gradreducer:" not in cluster.stderr, cluster.report()
    assert not finished(cluster), cluster.report()


def test_hosts_reach_nothing_but_the_cluster(cluster: HostCluster):
    """Each host's only route is its /24 in 198.18.0.0/15; no IPv6 address (not even link-local); no name server."""
    for host in ("1", "2"):
        routes = cluster.cli("exec", host, "--", "ip", "-o", "route", "show", "table", "all").stdout
        v4 = [line for line in routes.splitlines() if not line.startswith(("local ", "broadcast "))]
        assert len(v4) == 1 and re.match(r"198\.1[89]\.\d+\.0/24 dev eth0 ", v4[0]), routes
        assert not cluster.cli("exec", host, "--", "ip", "-6", "-o", "addr").stdout.strip()
        resolv = cluster.cli("exec", host, "--", "cat", "/etc/resolv.conf").stdout
        assert "nameserver" not in resolv, resolv


# The harness's own errors: each says what is wrong, and nothing is left behind.

def test_a_counter_that_cannot_be_read_fails_stats_naming_the_host(cluster: HostCluster):
    assert sorted(cluster.sent()) == [1, 2]
    ns = f"{cluster.name}-h2"
    for args in (["link", "set", "eth0", "down"], ["link", "set", "eth0", "name", "eth9"]):
        assert subprocess.run(["ip", "-n", ns, *args], capture_output=True, timeout=30).returncode == 0
    done = cluster.cli("stats")
    assert done.returncode == 1 and "cluster.py: host 2: cannot read the counters of its eth0" in done.stderr, done
    with pytest.raises(AssertionError, match="every host's counters expected"):
        cluster.sent()


@pytest.mark.parametrize("args, message", [
    (["up", "--hosts", "0"], r"--hosts: expected a host count from 1 to 64, got 0"),
    (["up", "--hosts", "2", "--rate", "fast"], r"--rate: expected a rate such as 1gbit, 500mbit or 2.5gbit "
                                               r"\(or none\), got 'fast'"),
    (["run", "--hosts", "2", "--rate", "1 gbit/s", "--", "true"], r"--rate: .* got '1 gbit/s'"),
    (["run", "--hosts", "2", "--ppn", "0", "--", "true"], r"--ppn: expected at least 1 rank per host, got 0"),
    (["run", "--hosts", "2"], r"run: no command given"),
    (["cut", "2"], r"cluster '\w+' is not up"),
    (["stats"], r"cluster '\w+' is not up"),
])
def test_bad_arguments_are_refused_and_leave_nothing(args: list[str], message: str):
    name, tag = new_name("y"), new_tag()
    done = cli(name, *args, tag=tag)
    assert done.returncode in (1, 2), done
    assert re.search(message, done.stderr), done.stderr
    assert not leftovers(name, tag), leftovers(name, tag)


def test_a_bad_name_is_refused():
    done = cli("Bad-Name!", "up", "--hosts", "1", tag=new_tag())
    assert done.returncode == 2 and "--name: expected 1-8 lowercase letters and digits" in done.stderr, done


def test_not_root_is_refused_at_once():
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                           str(CLUSTER), "--name", new_name("y"), "up", "--hosts", "2"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 3, done
    assert "cluster.py must run as root (it makes network namespaces); this is uid 65534" in done.stderr, done


def test_a_failing_command_returns_its_status_and_leaves_nothing():
    name, tag = new_name("y"), new_tag()
    done = cli(name, "run", "--hosts", "2", "--", "sh", "-c", "exit 7", tag=tag)
    assert done.returncode == 7 and "still ran" not in done.stderr, done
    assert not leftovers(name, tag), leftovers(name, tag)
    done = cli(name, "run", "--hosts", "2", "--", "/no/such/program", tag=tag)
    assert done.returncode != 0 and "/no/such/program" in done.stderr + done.stdout, done
    assert not leftovers(name, tag), leftovers(name, tag)


def _run_sleepers(name: str, tag: str, *args: str) -> jobs.Job:
    """``cluster.py run --hosts 2 ARGS -- sleep 60``, once a ``sleep`` runs on each host."""
    job = jobs.Job([sys.executable, str(CLUSTER), "--name", name, "run", "--hosts", "2", *args, "--", "sleep", "60"],
                   cwd=ROOT, env=job_env(tag))
    deadline = time.monotonic() + 20
    while sum(cmd == "sleep 60" for cmd in tagged(tag).values()) < 2:
        if time.monotonic() > deadline or job.poll() is not None:
            job.stop()
            raise AssertionError(f"no sleep on each host: {tagged(tag)}\n{job.stderr}")
        time.sleep(0.05)
    return job


def test_a_job_past_its_timeout_is_killed_and_nothing_left():
    name, tag = new_name("y"), new_tag()
    start = time.monotonic()
    with _run_sleepers(name, tag, "--timeout", "3") as job:
        done = job.finish(30)
    assert done.returncode == 124 and not done.timed_out and time.monotonic() - start < 15, done
    assert "the job ran past --timeout 3 s; killing it" in done.stderr, done
    assert not leftovers(name, tag), leftovers(name, tag)


def test_an_interrupted_run_takes_the_cluster_down():
    name, tag = new_name("y"), new_tag()
    with _run_sleepers(name, tag) as job:
        job.process.send_signal(signal.SIGTERM)  # to cluster.py alone: it must end its job itself
        done = job.finish(30)
    assert done.returncode == 130 and not done.timed_out and "interrupted" in done.stderr, done
    assert not leftovers(name, tag), leftovers(name, tag)


def test_down_ends_a_process_left_on_a_host():
    """``cluster.py down`` itself must end what still runs on a host (every other test's processes are gone
    before it runs): a process left in host 2's namespace, in a session of its own as a daemon would be, is
    named and killed by ``down``, which then removes the namespaces, interfaces and bridge."""
    name, tag = new_name("d"), new_tag()
    try:
        made = cli(name, "up", "--hosts", "2", tag=tag)
        assert made.returncode == 0, made
        left = cli(name, "exec", "2", "--", "sh", "-c", "setsid -f sleep 300 </dev/null >/dev/null 2>&1", tag=tag)
        assert left.returncode == 0, left
        host2 = os.stat(f"/run/netns/{name}-h2").st_ino
        deadline = time.monotonic() + 10
        while not (sleeper := [pid for pid, cmd in tagged(tag).items() if cmd == "sleep 300"]):
            assert time.monotonic() < deadline, f"no sleep left on host 2: {tagged(tag)}"
            time.sleep(0.05)
        assert len(sleeper) == 1 and os.stat(f"/proc/{sleeper[0]}/ns/net").st_ino == host2, tagged(tag)
        down = cli(name, "down", tag=tag)
        assert down.returncode == 0, down
        assert f"cluster {name}: host 2: killed 1 processes: {sleeper[0]} sleep 300" in down.stderr, down
        deadline = time.monotonic() + 2
        while tagged(tag) and time.monotonic() < deadline:  # SIGKILL sent: it goes at once
            time.sleep(0.05)
        assert not leftovers(name, tag), leftovers(name, tag)
    finally:
        kill_tagged(tag)
        if leftovers(name, tag):
            cli(name, "down", tag=tag)
