"""Across hosts: whole jobs on a cluster of network namespaces, with a link cut, an outage, a host's ranks killed.

Each test makes its own cluster of 2 hosts with ``scripts/cluster.py`` and
runs ``tests/jobs/train.py`` on it with 2 ranks per host, MPI over TCP
through the hosts' NICs. While the job trains, the test cuts host 2's link
for good, or for a few seconds, or kills every rank of host 2; the job must
end within seconds of the watchdog's timeout (or go on with the right
weights), and leave no process on either host. The harness's own errors
(not root, a bad host count or rate, a failing command, an interruption)
are tested here too: each says what is wrong and leaves nothing behind.

These tests need root and network namespaces; where ``cluster.py check``
says they are not available, they are skipped. Like ``test_faults.py``,
they run from a single process (skipped under ``mpiexec`` with more ranks).
They run under the MPI of the Python that runs them (``cluster.py`` starts
the ``mpiexec`` beside it). Where the launchers differ, each is held to its
own words: Hydra (MPICH, Intel MPI) ends the job once the ranks it reaches
have aborted; Open MPI's PRRTE loses the cut-off host first
(``cluster.HOST_TIMEOUT``) and ends the job itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import pytest

from conftest import cluster_unavailable, job_launcher

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.py"
TRAIN = ROOT / "tests" / "jobs" / "train.py"
#: Hard limit on one job (the harness kills it past this), and on the test's wait for it.
LIMIT = 60
#: The reducer's timeout in the jobs whose link is cut for good.
TIMEOUT = 4.0
#: A waiting rank's watchdog asks the others for 3 s before it aborts; then MPI_Abort and the harness.
GRACE = 3.0 + 4.0


UNAVAILABLE = cluster_unavailable()
#: Whose mpiexec the jobs run under (None: no mpiexec; the tests that launch jobs then fail to start them).
LAUNCHER = job_launcher() if UNAVAILABLE is None else None
PRRTE = LAUNCHER is not None and LAUNCHER.kind == "prrte"
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]

_names = count()


def cluster_cli(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLUSTER), "--name", name, *args], capture_output=True, text=True,
                          timeout=timeout)


def namespaces(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{name}-")]


def leftovers(name: str) -> list[str]:
    """What a cluster left on this machine: namespaces, interfaces, /etc/netns files, processes in them."""
    left = namespaces(name)
    for ns in left:
        left += [f"process {p} in {ns}" for p in
                 subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left += re.findall(rf"\d+: ({re.escape(name)}-\w+)", links)
    left += [str(p) for p in Path("/etc/netns").glob(f"{name}-*")]
    return left


class Cluster:
    """A cluster of 2 hosts made for one test, and the job running on it."""

    def __init__(self) -> None:
        self.name = f"t{os.getpid() % 10000}x{next(_names)}"
        made = cluster_cli(self.name, "up", "--hosts", "2")
        assert made.returncode == 0, made.stderr
        self.lines: list[str] = []
        self.stderr = ""
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str) -> None:
        """Launch ``train.py ARGS`` with 2 ranks per host; its stdout lines collect in ``self.lines``."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPI_GRADREDUCER_", "MPI4PY_"))
               and k != "PYTHONUNBUFFERED"}
        env["PYTHONPATH"] = str(ROOT)
        self.lines = []
        self.proc = subprocess.Popen([sys.executable, str(CLUSTER), "--name", self.name, "run", "--ppn", "2",
                                      "--timeout", str(LIMIT), "--", sys.executable, str(TRAIN), *args],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, line: str, limit: float = 30) -> None:
        deadline = time.monotonic() + limit
        while line not in self.lines:
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.finish()
                pytest.fail(f"never saw {line!r}\n{self.report()}")
            time.sleep(0.05)

    def finish(self) -> int:
        """Wait for the job (at most LIMIT + 15 s: past that, kill it and fail); its exit status."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout=LIMIT + 15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"the harness did not end the job within its --timeout\n{self.report()}")
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()
        time.sleep(0.1)  # the reader thread takes the last lines
        return self.proc.returncode

    def report(self) -> str:
        return "--- stdout ---\n" + "\n".join(self.lines) + f"\n--- stderr ---\n{self.stderr}"

    def finished(self) -> dict[int, str]:
        """Rank to digest of its trained weights, for each rank that finished."""
        found = (re.fullmatch(r"rank (\d): finished, weights ([0-9a-f]+)", line) for line in self.lines)
        return {int(m[1]): m[2] for m in found if m}

    def sent(self) -> dict[int, int]:
        """Bytes each host's NIC has sent."""
        out = cluster_cli(self.name, "stats").stdout
        return {int(h): int(b) for h, b in re.findall(r"host (\d+): sent (\d+) bytes", out)}

    def processes(self) -> list[str]:
        return [line for line in leftovers(self.name) if line.startswith("process")]

    def down(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        cluster_cli(self.name, "down")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    try:
        yield made
    finally:
        made.down()
    assert not leftovers(made.name), leftovers(made.name)


def test_healthy_job_sends_its_gradients_through_the_links(cluster: Cluster):
    before = cluster.sent()
    cluster.start("--steps=20")
    assert cluster.finish() == 0, cluster.report()
    assert sorted(cluster.finished()) == [0, 1, 2, 3], cluster.report()
    assert len(set(cluster.finished().values())) == 1, cluster.report()
    grown = {h: cluster.sent()[h] - before[h] for h in before}
    # 20 reductions of 544 bytes each way between the hosts, besides the launch's own traffic
    assert all(b > 20 * 544 for b in grown.values()), grown


@pytest.mark.parametrize("inputs", [16, 50_000], ids=["small", "large"])
def test_link_cut_for_good_every_reporting_rank_names_the_lost_ranks(cluster: Cluster, inputs: int):
    """A small model (one message with the call header) and a large one (1.6 MB: summed in two levels)."""
    cluster.start("--steps=400", "--pause=0.05", "--progress", f"--timeout={TIMEOUT:g}", f"--inputs={inputs}")
    cluster.wait_for("rank 0: step 5 done")
    assert cluster_cli(cluster.name, "cut", "2").returncode == 0
    cut = time.monotonic()
    status = cluster.finish()
    took = time.monotonic() - cut
    assert took < TIMEOUT + GRACE, f"the job ended {took:.1f} s after the cut\n{cluster.report()}"
    assert not cluster.finished(), cluster.report()
    if not PRRTE:  # Open MPI's daemon on the cut-off host outlives the job (until TCP gives up): the harness kills it
        assert "still ran" not in cluster.stderr, f"processes were left on a host\n{cluster.report()}"
    assert not cluster.processes(), cluster.processes()
    if PRRTE:  # the launcher loses host 2 before the watchdog fires, and ends the job naming it
        assert re.search(rf"PRTE has lost communication with a remote daemon\.[\s\S]*?Remote daemon: \S+ on node "
                         rf"{cluster.name}-h2\n", cluster.stderr), cluster.report()
        if status == 0:
            pytest.xfail("Open MPI 5.0.11's mpiexec (PRRTE 3) exits 0 after ending a job for a lost host")
    assert status != 0, cluster.report()
    if PRRTE:
        return
    named = re.findall(rf"mpi_gradreducer: rank (\d): call \d+, bucket \d+ \(\d+ bytes\) has not completed after "
                       rf"[\d.]+ s \(timeout={TIMEOUT:g} s\); missing ranks: 2, 3 \[rank 2: no answer[^\]]*; "
                       rf"rank 3: no answer[^\]]*\]\. Aborting the job\.", cluster.stderr)
    assert sorted(named) == ["0", "1"], f"ranks 0 and 1 (on the host that can still report) must name 2 and 3\n" \
        f"{cluster.report()}"


def test_link_outage_shorter_than_the_timeout_is_survived(cluster: Cluster):
    cluster.start("--steps=30", "--pause=0.05")
    assert cluster.finish() == 0, cluster.report()
    healthy = cluster.finished()
    assert sorted(healthy) == [0, 1, 2, 3] and len(set(healthy.values())) == 1, cluster.report()

    cluster.start("--steps=30", "--pause=0.05", "--progress", "--timeout=20")
    cluster.wait_for("rank 0: step 5 done")
    assert cluster_cli(cluster.name, "cut", "2").returncode == 0
    time.sleep(3)
    assert cluster_cli(cluster.name, "restore", "2").returncode == 0
    assert cluster.finish() == 0, cluster.report()
    assert cluster.finished() == healthy, f"different weights after the outage\n{cluster.report()}"
    assert "mpi_gradreducer:" not in cluster.stderr, cluster.report()


def test_every_rank_of_one_host_killed_the_job_ends_naming_the_host(cluster: Cluster):
    cluster.start("--steps=400", "--pause=0.05", "--progress", f"--timeout={TIMEOUT:g}")
    cluster.wait_for("rank 0: step 5 done")
    ns = f"{cluster.name}-h2"
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            if str(TRAIN).encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    status = cluster.finish()
    took = time.monotonic() - killed
    assert status != 0 and took < TIMEOUT + GRACE, f"{took:.1f} s\n{cluster.report()}"
    address = cluster_cli(cluster.name, "exec", "2", "--", "ip", "-o", "-4", "addr", "show", "dev", "eth0").stdout
    host2 = re.search(r"inet ([\d.]+)/", address)[1]  # type: ignore[index]
    output = "\n".join(cluster.lines) + "\n" + cluster.stderr
    if PRRTE:  # the first report ends the job: PRRTE's of a killed rank (naming its host), or a survivor's
        # error on its socket to that rank, which names no host
        assert re.search(rf"process rank [23] with PID ({'|'.join(map(str, pids))}) on node {cluster.name}-h2 "
                         rf"exited on\s+signal 9", output) or "An error occurred in Socket closed" in output, \
            cluster.report()
    else:
        assert re.search(rf"BAD TERMINATION .*\n.*PID ({'|'.join(map(str, pids))}) RUNNING AT {re.escape(host2)}\n"
                         rf".*EXIT CODE: 9", output), cluster.report()
    assert not cluster.finished(), cluster.report()
    assert "still ran" not in cluster.stderr, cluster.report()


# The harness's own errors: each says what is wrong, and nothing is left behind.

def _fresh_name() -> str:
    return f"t{os.getpid() % 10000}y{next(_names)}"


@pytest.mark.parametrize("args, message", [
    (["up", "--hosts", "0"], r"--hosts: expected a host count from 1 to 64, got 0"),
    (["up", "--hosts", "2", "--rate", "fast"], r"--rate: expected a rate such as 1gbit, 500mbit or 2.5gbit "
                                               r"\(or none\), got 'fast'"),
    (["run", "--hosts", "2", "--rate", "1 gbit/s", "--", "true"], r"--rate: .* got '1 gbit/s'"),
    (["run", "--hosts", "2", "--ppn", "0", "--", "true"], r"--ppn: expected at least 1 rank per host, got 0"),
    (["run", "--hosts", "2"], r"run: no command given"),
    (["cut", "2"], r"cluster '\w+' is not up"),
])
def test_bad_arguments_are_refused_and_leave_nothing(args: list[str], message: str):
    name = _fresh_name()
    done = cluster_cli(name, *args)
    assert done.returncode in (1, 2), done
    assert re.search(message, done.stderr), done.stderr
    assert not leftovers(name), leftovers(name)


def test_a_bad_name_is_refused():
    done = cluster_cli("Bad-Name!", "up", "--hosts", "1")
    assert done.returncode == 2 and "--name: expected 1-8 lowercase letters and digits" in done.stderr, done


def test_not_root_is_refused_at_once():
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                           str(CLUSTER), "--name", _fresh_name(), "up", "--hosts", "2"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 3, done
    assert "cluster.py must run as root (it makes network namespaces); this is uid 65534" in done.stderr, done


def test_a_failing_command_returns_its_status_and_leaves_nothing():
    name = _fresh_name()
    done = cluster_cli(name, "run", "--hosts", "2", "--", "sh", "-c", "exit 7")
    assert done.returncode == 7, done
    assert not leftovers(name), leftovers(name)
    done = cluster_cli(name, "run", "--hosts", "2", "--", "/no/such/program")
    assert done.returncode != 0 and "/no/such/program" in done.stderr + done.stdout, done
    assert not leftovers(name), leftovers(name)


def test_a_job_past_its_timeout_is_killed_and_nothing_left():
    name = _fresh_name()
    start = time.monotonic()
    done = cluster_cli(name, "run", "--hosts", "2", "--timeout", "2", "--", "sleep", "60")
    assert done.returncode == 124 and time.monotonic() - start < 15, done
    assert "the job ran past --timeout 2 s; killing it" in done.stderr, done
    assert not leftovers(name), leftovers(name)


def test_an_interrupted_run_takes_the_cluster_down():
    name = _fresh_name()
    proc = subprocess.Popen([sys.executable, str(CLUSTER), "--name", name, "run", "--hosts", "2", "--", "sleep", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not [p for p in leftovers(name) if p.startswith("process")] and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in err, err
    assert not leftovers(name), leftovers(name)


def test_hosts_reach_nothing_but_the_cluster(cluster: Cluster):
    """Each host's only route is its /24 in 198.18.0.0/15; no IPv6 address (not even link-local); no name server."""
    for host in ("1", "2"):
        routes = cluster_cli(cluster.name, "exec", host, "--", "ip", "-o", "route", "show", "table", "all").stdout
        v4 = [line for line in routes.splitlines() if not line.startswith(("local ", "broadcast "))]
        assert len(v4) == 1 and re.match(r"198\.1[89]\.\d+\.0/24 dev eth0 ", v4[0]), routes
        assert not cluster_cli(cluster.name, "exec", host, "--", "ip", "-6", "-o", "addr").stdout.strip()
        resolv = cluster_cli(cluster.name, "exec", host, "--", "cat", "/etc/resolv.conf").stdout
        assert "nameserver" not in resolv, resolv
