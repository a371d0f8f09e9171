"""Where the job may have ranks: a host discovery script or a host file, with Horovod's semantics.

A *host discovery script* is an executable that prints the hosts available
now, one a line, each as ``HOST:SLOTS`` (or ``HOST`` alone: ``slots`` slots),
and exits 0; it is run again whenever the job wants to know (Horovod's
``horovodrun --host-discovery-script``). A *host file* holds the same lines
and is read again each time, so that editing it adds or removes room. Blank
lines and lines from ``#`` on are ignored. ``localhost`` and ``127.0.0.1``
stand for the host that asks.

The job's target size is the sum of the slots listed, capped by
``max_size``. When it has fewer ranks than that (ranks were lost, or a
host was added), elastic mode starts new processes in the free slots: a
host's free slots are its slots less the ranks already running there.
When a host leaves the list (or lists fewer slots than it runs ranks), its
ranks beyond its slots are *drained*: they leave at the next commit, the
highest ranks of the host first, and the others go on.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["DISCOVERY_ENV", "HOSTFILE_ENV", "SLOTS_ENV", "Discovery", "leaving", "parse_hosts", "placement"]

#: A host discovery script (its path, or a command line run by the shell).
DISCOVERY_ENV = "MPI_GRADREDUCER_ELASTIC_DISCOVERY"
#: A host file, read again on each look.
HOSTFILE_ENV = "MPI_GRADREDUCER_ELASTIC_HOSTFILE"
#: The slots of a host listed without a count (default 1).
SLOTS_ENV = "MPI_GRADREDUCER_ELASTIC_SLOTS"
#: The longest a discovery script may run.
SCRIPT_SECONDS = 10.0
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def parse_hosts(text: str, slots: int = 1, source: str = "the host list") -> dict[str, int]:
    """``{host: slots}`` from lines ``HOST[:SLOTS]``, in the order listed (a host listed twice adds up).

    Args:
        text: the lines.
        slots: the slots of a host listed without a count.
        source: what the lines came from, for the message.

    Raises:
        ValueError: a line that is not ``HOST`` or ``HOST:SLOTS`` with SLOTS a positive int, naming the line.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, colon, count = line.rpartition(":")
        if not colon:
            host, n = line, slots
        else:
            try:
                n = int(count)
            except ValueError:
                n = 0
            if n < 1:
                raise ValueError(f"{source}, line {number}: expected HOST or HOST:SLOTS with SLOTS a positive int, "
                                 f"got {raw.strip()!r}")
        host = socket.gethostname() if host in _LOCAL_NAMES else host
        hosts[host] = hosts.get(host, 0) + n
    return hosts


@dataclass(frozen=True)
class Discovery:
    """Where the job may run ranks: a discovery script, a host file, or nothing (no new ranks).

    Args:
        script: a host discovery script (path or shell command line).
        hostfile: a host file.
        slots: the slots of a host listed without a count.
    """

    script: str | None = None
    hostfile: str | None = None
    slots: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Discovery:
        """The discovery that the environment names (``MPI_GRADREDUCER_ELASTIC_DISCOVERY`` or ``..._HOSTFILE``).

        Raises:
            ValueError: both are set, or ``MPI_GRADREDUCER_ELASTIC_SLOTS`` is not a positive int.
        """
        env = os.environ if environ is None else environ
        script, hostfile = env.get(DISCOVERY_ENV) or None, env.get(HOSTFILE_ENV) or None
        if script and hostfile:
            raise ValueError(f"{DISCOVERY_ENV} and {HOSTFILE_ENV} are both set; set one")
        text = env.get(SLOTS_ENV, "1")
        try:
            slots = int(text)
        except ValueError:
            slots = 0
        if slots < 1:
            raise ValueError(f"{SLOTS_ENV}: expected a positive int, got {text!r}")
        return cls(script, hostfile, slots)

    @property
    def configured(self) -> bool:
        """Whether anything lists room (without, the job never starts new ranks)."""
        return self.script is not None or self.hostfile is not None

    def describe(self) -> str:
        """What is asked, for messages."""
        if self.script is not None:
            return f"the host discovery script {self.script!r}"
        if self.hostfile is not None:
            return f"the host file {self.hostfile!r}"
        return "no host discovery script nor host file"

    def hosts(self) -> dict[str, int]:
        """The hosts listed now, with their slots (empty when nothing is configured).

        Raises:
            RuntimeError: the script failed, timed out or the file cannot be read, naming it.
            ValueError: a line of the output is malformed.
        """
        if self.hostfile is not None:
            try:
                with open(self.hostfile, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise RuntimeError(f"{self.describe()}: cannot be read ({exc})") from exc
            return parse_hosts(text, self.slots, self.describe())
        if self.script is None:
            return {}
        command: str | list[str] = [self.script] if os.path.isfile(self.script) else self.script
        try:
            done = subprocess.run(command, shell=isinstance(command, str), capture_output=True, text=True,
                                  timeout=SCRIPT_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{self.describe()} failed: {exc}") from exc
        if done.returncode != 0:
            raise RuntimeError(f"{self.describe()} exited with {done.returncode}: {done.stderr.strip()[-300:]}")
        return parse_hosts(done.stdout, self.slots, self.describe())


def placement(hosts: Mapping[str, int], running: Sequence[str], wanted: int, last: Collection[str] = ()) -> list[str]:
    """The hosts of up to ``wanted`` new ranks, one entry a rank: free slots in the order listed.

    Args:
        hosts: the hosts listed and their slots.
        running: the host of every rank running now.
        wanted: how many new ranks are wanted at most.
        last: hosts whose free slots come after every other host's (those that lost ranks: a host that
            failed may fail again, as Horovod's blacklist assumes; they still serve when nothing else is free).
    """
    busy: dict[str, int] = {}
    for host in running:
        busy[host] = busy.get(host, 0) + 1
    places: list[str] = []
    for host in [h for h in hosts if h not in last] + [h for h in hosts if h in last]:
        slots = hosts[host]
        free = max(0, slots - busy.get(host, 0))
        places += [host] * min(free, wanted - len(places))
    return places


def leaving(hosts: Mapping[str, int], running: Sequence[str]) -> list[int]:
    """The ranks to drain: those on a host that is not listed, or beyond its slots (the highest ranks there).

    Args:
        hosts: the hosts listed and their slots.
        running: the host of every rank running now, by rank.

    Returns:
        The ranks that leave, ascending.
    """
    kept: dict[str, int] = {}
    out: list[int] = []
    for rank, host in enumerate(running):
        kept[host] = kept.get(host, 0) + 1
        if kept[host] > hosts.get(host, 0):
            out.append(rank)
    return out
