"""The clusters that tests make with ``scripts/cluster.py``, the jobs they run, and every process those start.

``test_hosts.py`` and ``test_bench_hosts.py`` go through this module. Every
command it runs carries, in its environment, ``CLUSTER_TEST_TAG`` set to a
value of the test's own; ``mpiexec`` hands its environment on to the
launcher, the proxies and the ranks. So :func:`tagged` finds every process a
test started wherever it runs: in a host's namespace or not, in a session of
its own, reparented after its parent died, and after the namespaces are gone
(a process outlives the removal of its namespace, and ``ip netns pids`` then
no longer sees it). What a cluster leaves besides processes (namespaces,
interfaces, files in ``/etc/netns``) is :func:`remains`.

:class:`HostCluster` is a cluster made for one test and the job it runs;
its :meth:`~HostCluster.close` checks for processes of the test that
outlived their job while the hosts still exist, takes the cluster down, and
checks that nothing at all is left.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from itertools import count
from pathlib import Path

from mpi_gradreducer import jobs

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.py"
#: The environment variable that marks every process a test starts.
TAG = "CLUSTER_TEST_TAG"
#: Hard limit on one job: ``cluster.py run --timeout`` kills it past this.
LIMIT = 60

_names = count()


def new_name(kind: str = "x") -> str:
    """A cluster name of this process's own (``cluster.py --name``: at most 8 letters and digits)."""
    return f"t{os.getpid() % 10000}{kind}{next(_names)}"


def new_tag() -> str:
    return uuid.uuid4().hex


def job_env(tag: str) -> dict[str, str]:
    """This process's environment without MPI launch, package or unbuffered-output settings, with the
    repository on ``PYTHONPATH`` and ``tag``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_GRADREDUCER_", "MPI4PY_"))
           and k not in ("PYTHONUNBUFFERED", TAG)}
    env["PYTHONPATH"] = str(ROOT)
    env[TAG] = tag
    return env


def cli(name: str, *args: str, tag: str, timeout: float = 120) -> jobs.Finished:
    """``cluster.py --name NAME ARGS`` to its end, its processes marked with ``tag``.

    Raises:
        AssertionError: it ran past ``timeout`` seconds (then it was ended: SIGTERM, on which
            ``cluster.py`` takes down what it made for a ``run --hosts``, then SIGKILL).
    """
    done = jobs.run([sys.executable, str(CLUSTER), "--name", name, *args], timeout=timeout, cwd=ROOT,
                    env=job_env(tag), grace=30)
    assert not done.timed_out, f"`cluster.py {' '.join(args)}` ran past {timeout:g} s\n{done.stdout}{done.stderr}"
    return done


def tagged(tag: str) -> dict[int, str]:
    """The live processes marked with ``tag``: pid to command line (a zombie shows no environment)."""
    return jobs.marked(TAG, tag)


def describe(procs: dict[int, str]) -> str:
    return "; ".join(f"{pid} {cmd[:80]}" for pid, cmd in sorted(procs.items()))


def kill_tagged(tag: str) -> None:
    """SIGKILL every process marked with ``tag``; wait (at most 5 s) until none is left."""
    jobs.kill_marked(TAG, tag)


def remains(name: str) -> list[str]:
    """What cluster ``name`` left on this machine besides processes: namespaces, interfaces, /etc/netns files."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    return ([f"namespace {line.split()[0]}" for line in spaces.splitlines() if line.startswith(f"{name}-")]
            + [f"interface {i}" for i in re.findall(rf"\d+: ({re.escape(name)}-\w+)", links)]
            + [str(p) for p in Path("/etc/netns").glob(f"{name}-*")])


def leftovers(name: str, tag: str) -> list[str]:
    """Everything of cluster ``name`` and of the processes marked with ``tag`` still on this machine."""
    return remains(name) + [f"process {pid} {cmd[:80]}" for pid, cmd in sorted(tagged(tag).items())]


class HostCluster:
    """A cluster of ``hosts`` hosts (NICs shaped to ``rate``) made for one test, and the job running on it.

    Every process it starts is marked with :attr:`tag`. Call :meth:`close` once, when the test is done.
    """

    def __init__(self, hosts: int = 2, rate: str = "none") -> None:
        self.name, self.tag, self.count = new_name(), new_tag(), hosts
        made = self.cli("up", "--hosts", str(hosts), "--rate", rate)
        if made.returncode != 0:
            self.cli("down")
            raise AssertionError(f"cluster.py up failed: {made.stderr}")
        #: The job's stdout lines, each with the time it arrived here (``time.monotonic()``).
        self.timed: list[tuple[float, str]] = []
        self.stderr = ""
        #: What ``cluster.py run`` found still running on a host after ``mpiexec`` ended (and killed), every job.
        self.reaped: list[str] = []
        self.job: jobs.Job | None = None

    def cli(self, *args: str, timeout: float = 120) -> jobs.Finished:
        return cli(self.name, *args, tag=self.tag, timeout=timeout)

    def start(self, *command: str, ppn: int = 2, ft: bool = False, ranks: int | None = None,
              names: bool = False) -> None:
        """Launch ``command`` with ``ppn`` ranks per host (``cluster.py run --timeout LIMIT``; ``--ft`` if ``ft``;
        ``--ranks`` and ``--names`` if given)."""
        self.timed = []
        more = [*(["--ft"] if ft else []), *(["--ranks", str(ranks)] if ranks else []), *(["--names"] if names else [])]
        self.job = jobs.Job([sys.executable, str(CLUSTER), "--name", self.name, "run", "--ppn", str(ppn),
                             "--timeout", str(LIMIT), *more, "--", *command],
                            cwd=ROOT, env=job_env(self.tag), on_line=self._arrived)

    def _arrived(self, line: str) -> None:
        self.timed.append((time.monotonic(), line.rstrip("\n")))

    @property
    def lines(self) -> list[str]:
        return [line for _, line in self.timed]

    def arrived(self, line: str) -> float | None:
        """When ``line`` arrived here first, or None."""
        return next((t for t, text in self.timed if text == line), None)

    def wait_for(self, line: str, limit: float = 30) -> float:
        """Wait until the job prints ``line``; when it arrived. Fails the test if the job ends first."""
        deadline = time.monotonic() + limit
        while (when := self.arrived(line)) is None:
            assert self.job is not None
            if self.job.poll() is not None or time.monotonic() > deadline:
                self.finish()
                raise AssertionError(f"never saw {line!r}\n{self.report()}")
            time.sleep(0.01)
        return when

    def finish(self) -> int:
        """Wait for the job (at most LIMIT + 15 s: past that, kill it and fail); its exit status."""
        assert self.job is not None
        done = self.job.finish(LIMIT + 15)
        self.stderr = done.stderr
        if done.timed_out:
            kill_tagged(self.tag)
            raise AssertionError(f"the harness did not end the job within its --timeout\n{self.report()}")
        self.reaped += re.findall(r"^cluster: host \d+ still ran .*$", self.stderr, re.M)
        return done.returncode

    def report(self) -> str:
        return "--- stdout ---\n" + "\n".join(self.lines) + f"\n--- stderr ---\n{self.stderr}"

    def sent(self) -> dict[int, int]:
        """Bytes each host's NIC has sent (``cluster.py stats``); fails unless every host's counter was read."""
        done = self.cli("stats")
        found = {int(h): int(b) for h, b in re.findall(r"^host (\d+): sent (\d+) bytes, received \d+ bytes$",
                                                         done.stdout, re.M)}
        assert done.returncode == 0 and sorted(found) == list(range(1, self.count + 1)), (
            f"cluster.py stats: every host's counters expected\n{done.stdout}{done.stderr}")
        return found

    def link_counter(self, host: int) -> int:
        """What host ``host`` has sent, as the bridge's end of its link counts it (read here, at once)."""
        return int(Path(f"/sys/class/net/{self.name}-v{host}/statistics/rx_bytes").read_text())

    def processes(self) -> dict[int, str]:
        """The live processes this cluster's commands started (the job's included)."""
        return tagged(self.tag)

    def on_host(self, host: int) -> dict[int, str]:
        """Those of :meth:`processes` in host ``host``'s namespace."""
        ns = os.stat(f"/run/netns/{self.name}-h{host}").st_ino
        found = {}
        for pid, cmd in self.processes().items():
            try:
                if os.stat(f"/proc/{pid}/ns/net").st_ino == ns:
                    found[pid] = cmd
            except OSError:
                continue
        return found

    def close(self) -> list[str]:
        """End the job, take the cluster down; what was left behind.

        Returns:
            Processes of the test that outlived their job while the hosts
            still existed: those ``cluster.py run`` found and killed, and
            those it did not (none of them when the job had to be killed here:
            the test failed then); and anything at all left after the cluster
            went down.
        """
        problems = [f"processes outlived their job: {line}" for line in self.reaped]
        if self.job is not None and self.job.poll() is None:
            kill_tagged(self.tag)
            self.job.stop()
        elif left := self.processes():
            problems.append(f"processes outlived their job: {describe(left)}")
        kill_tagged(self.tag)
        down = self.cli("down")
        if down.returncode != 0:
            problems.append(f"cluster.py down failed: {down.stderr}")
        problems += [f"after cluster.py down: {what}" for what in leftovers(self.name, self.tag)]
        kill_tagged(self.tag)
        return problems
