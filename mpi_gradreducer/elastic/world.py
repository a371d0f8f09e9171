"""The ranks training now, and what changes with them: shrink after a loss, spawn and merge to grow back.

A :class:`World` owns the communicator of the ranks training now and the
objects that must be rebuilt on each new one (reducers, optimizers, a
Horovod context). On a lost rank it revokes every communicator that any of
them made, so that no survivor stays blocked with live peers, shrinks its
own to the survivors and rebuilds the objects on it. When a host discovery
script or host file lists room for more ranks, it starts them in the
background (``Spawn`` from the survivors); they run the script from its top
and wait at the start of the run loop, and at the next commit on which every
rank sees them started, the two sides merge into one communicator. When the
discovery no longer lists the host of some ranks (or lists fewer slots there),
those ranks are drained: at the next commit they leave and the others go on
over a communicator of their own.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core import faults
from .._core.topology import processor_names
from . import _ulfm
from .discovery import Discovery, leaving, placement
from .errors import ElasticError, HostsUpdated, RanksLost
from .rebuild import Rebuildable, rebuildable

__all__ = ["JOIN_TIMEOUT_ENV", "MAX_SIZE_ENV", "MIN_SIZE_ENV", "RUNNING_HOSTS_ENV", "TIMEOUT_ENV", "JoinFailed",
           "Settings", "World", "joining", "joining_hosts"]

MIN_SIZE_ENV = "MPI_GRADREDUCER_ELASTIC_MIN_SIZE"
MAX_SIZE_ENV = "MPI_GRADREDUCER_ELASTIC_MAX_SIZE"
TIMEOUT_ENV = "MPI_GRADREDUCER_ELASTIC_TIMEOUT"
JOIN_TIMEOUT_ENV = "MPI_GRADREDUCER_ELASTIC_JOIN_TIMEOUT"
#: Set by the running ranks in the environment of the processes they start (Open MPI's ``env`` spawn key): the
#: host of each running rank, in rank order, as runs ``NAME*COUNT`` (``NAME`` for one), comma-separated (see
#: :func:`joining_hosts`). Left out where it would pass ``MPI_MAX_INFO_VAL`` (256 under Open MPI).
RUNNING_HOSTS_ENV = "MPI_GRADREDUCER_ELASTIC_RUNNING_HOSTS"
#: How long new processes may take from their start to the run loop, by default, before their start counts as
#: failed (one killed as it started never arrives, and no failure of it reaches the running ranks).
DEFAULT_JOIN_TIMEOUT = 60.0
#: How long the survivors wait for room below the minimum size, by default (Horovod's elastic timeout).
DEFAULT_TIMEOUT = 600.0
#: After this many failed starts of new ranks, the job stops trying (it goes on with the ranks it has).
MAX_FAILED_SPAWNS = 3
#: How long MPI_Finalize may take, at exit, in a process that lived through a change of ranks.
FINALIZE_SECONDS = 10.0
#: How often rank 0 looks at the discovery script or host file while training.
LOOK_EVERY = 1.0


class JoinFailed(ElasticError):
    """A new process's merge with the running ranks failed (one was lost meanwhile): it never became a rank."""


class Settings:
    """How elastic the job is: the discovery, the minimum and maximum size, and the wait below the minimum.

    Args:
        discovery: where new ranks may start (default: from the environment).
        min_size: below this many ranks the survivors wait for replacements (default 1).
        max_size: never more ranks than this (default: what the discovery lists).
        timeout: seconds to wait below ``min_size`` before giving up.

    The seconds that new processes may take to reach the run loop come from
    ``MPI_GRADREDUCER_ELASTIC_JOIN_TIMEOUT`` (default 60).

    Raises:
        ValueError: a size or the timeout is not positive, or ``min_size > max_size``.
    """

    def __init__(self, discovery: Discovery | None = None, min_size: int | None = None,
                 max_size: int | None = None, timeout: float | None = None) -> None:
        self.discovery = Discovery.from_env() if discovery is None else discovery
        self.min_size = _positive("min_size", min_size, MIN_SIZE_ENV, 1, int)
        self.max_size = _positive("max_size", max_size, MAX_SIZE_ENV, None, int)
        self.timeout = _positive("timeout", timeout, TIMEOUT_ENV, DEFAULT_TIMEOUT, float)
        self.join_timeout = _positive("join_timeout", None, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT, float)
        if self.max_size is not None and self.min_size > self.max_size:
            raise ValueError(f"min_size={self.min_size} is larger than max_size={self.max_size}")


def _positive(name: str, value: Any, env: str, default: Any, kind: type) -> Any:
    if value is None:
        text = os.environ.get(env)
        if text is None:
            return default
        try:
            value = kind(text)
        except ValueError:
            value = 0
        name = f"{env}={text!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive {kind.__name__}, got {value!r}")
    return kind(value)


class World:
    """The communicator of the ranks training now, and the objects rebuilt on each new one.

    Construction is collective over ``comm`` (duplicated).

    Args:
        comm: the ranks; default ``MPI.COMM_WORLD``.
        interrupt: the error raised at a commit when new ranks are ready.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, interrupt: type[HostsUpdated] = HostsUpdated) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm: MPI.Intracomm = _ulfm.returning(base.Dup())  # type: ignore[assignment]
        self.interrupt = interrupt
        self.settings = Settings()
        self._tracked: list[Rebuildable] = []
        self._spawner: _Spawner | None = None
        self._look: _Look | None = None
        # the commit's reduction: its request, its result, whether a spawn was in flight, and its send buffer (mpi4py's
        # request does not keep the send buffer of a nonblocking reduction alive)
        self._pending: tuple[MPI.Request, np.ndarray, bool, np.ndarray] | None = None
        self._failed_spawns = 0
        self._running: list[str] | None = None  # the host of every rank of comm, once asked
        self._lost_on: set[str] = set()  # the hosts that lost ranks (known where _running was): placed last
        self._leaving: list[int] | None = None  # the ranks that a drain lets go, between the verdict and update()
        self._said_no_drain = False
        self._joined = False
        self._guarded = False
        #: Seconds of the last recovery, from catching the failure to the objects rebuilt.
        self.recovery_seconds = 0.0
        #: The loss that the last shrink made up for, known before the rebuild, so that a recovery cut short
        #: still names it.
        self.shrunk: RanksLost | None = None

    @property
    def size(self) -> int:
        """The number of ranks training now; in a replacement that has not joined yet, the number it joins
        (see :func:`joining`)."""
        ahead = None if self._joined else joining(self.comm)
        return self.comm.Get_size() if ahead is None else ahead[0]

    @property
    def rank(self) -> int:
        """This rank in ``comm``; in a replacement that has not joined yet, the rank it will have."""
        ahead = None if self._joined else joining(self.comm)
        return self.comm.Get_rank() if ahead is None else ahead[1]

    # -- objects rebuilt on each new communicator ---------------------------------------------

    def track(self, obj: Any) -> None:
        """Rebuild ``obj`` on every new communicator, after the objects tracked before it."""
        self._tracked.append(rebuildable(obj))

    def communicators(self) -> Iterator[MPI.Comm]:
        """Every communicator that a failure must revoke: this world's and every tracked object's."""
        yield self.comm
        for t in self._tracked:
            yield from t.communicators()
        if self._spawner is not None:
            yield from self._spawner.communicators()

    def rebuild(self) -> None:
        """Rebuild every tracked object on ``comm`` (collective), in the order tracked."""
        for t in self._tracked:
            t.rebuild(self.comm)

    # -- the run loop's steps ---------------------------------------------------------------------

    def join_if_new(self) -> bool:
        """In a process started as a replacement: merge with the running ranks and rebuild (collective).

        Returns:
            Whether this process has just joined.
        """
        parent = MPI.Comm.Get_parent()
        if self._joined or parent == MPI.COMM_NULL:
            return False
        self._joined = True
        self._guard_exit()
        _ulfm.returning(parent)
        try:  # until the merged communicator is this world's, a failure leaves this process out: never train alone
            # tells the running ranks that this process is here (see _Spawner._spawn); nonblocking as theirs is:
            # MPI matches a nonblocking collective only with nonblocking ones
            parent.Ibarrier().Wait()
            _meet(parent, self.comm, self.settings.join_timeout)
            merged = parent.Merge(high=True)
            parent.Free()  # as the running ranks free their side: MPI_Finalize then disconnects the same communicators
        except MPI.Exception as exc:
            raise JoinFailed(f"this new process could not join the running ranks ({exc.Get_error_string()})") \
                from exc
        except TimeoutError as exc:
            raise JoinFailed(f"this new process could not join the running ranks ({exc})") from exc
        self._replace(_ulfm.returning(merged))  # type: ignore[arg-type]
        self.rebuild()
        return True

    def newest(self, commits: int) -> int:
        """The lowest rank among those with the most commits (collective)."""
        counts = self.comm.allgather(int(commits))
        return int(np.argmax(counts))

    def recover(self, error: BaseException) -> RanksLost:
        """After a lost rank: revoke, shrink to the survivors, rebuild; grow back if there is room (collective).

        Args:
            error: what this rank caught.

        Returns:
            The loss, as every survivor names it.

        Raises:
            ElasticError: fewer than ``min_size`` ranks are left and no room came within the timeout.
        """
        t0 = time.perf_counter()
        self._guard_exit()
        failure = faults.failure_of(error)
        where = failure.Get_error_string() if failure is not None else f"{type(error).__name__}: {error}"
        _ulfm.revoke(self.communicators())
        self._drop_background()
        old = self.comm
        new = _ulfm.shrink(old)
        lost = RanksLost(_ulfm.lost_ranks(old, new), old.Get_size(), new.Get_size(), where)
        if self._running is not None and len(self._running) == old.Get_size():
            self._lost_on.update(self._running[r] for r in lost.ranks)
        self.shrunk = lost
        self._replace(new)
        if self.comm.Get_size() < self.settings.min_size:
            self._wait_for_room()
        self.rebuild()
        if self.settings.discovery.configured and self._failed_spawns < MAX_FAILED_SPAWNS:
            self._start_spawn(None)  # replacements start now, on a thread; they join at a commit
        self.recovery_seconds = time.perf_counter() - t0
        return lost

    def grow(self) -> None:
        """Take in the ranks that the background spawn started (collective over both sides), and rebuild."""
        self._merge()
        self.rebuild()

    def update(self) -> bool:
        """After the interrupt: let the drained ranks go, or take in the new ones; rebuild (collective).

        Returns:
            Whether this rank goes on training. A drained rank has left: its
            tracked objects are abandoned and its communicators freed, and it
            must make no more collective calls over this world.
        """
        if self._leaving is None:
            self.grow()
            return True
        drained, self._leaving = self._leaving, None
        self._guard_exit()
        stay = self.comm.Get_rank() not in drained
        new = self.comm.Split(0 if stay else MPI.UNDEFINED, self.comm.Get_rank())
        if stay:
            self._replace(_ulfm.returning(new))  # type: ignore[arg-type]
            self.rebuild()
            return True
        if self._look is not None:
            self._look.stop.set()
            self._look = None
        for t in self._tracked:
            t.abandon()
        self._replace(MPI.COMM_NULL)  # type: ignore[arg-type]
        return False

    def _merge(self) -> None:
        self._guard_exit()
        spawner, self._spawner = self._spawner, None
        assert spawner is not None and spawner.inter is not None and spawner.ready
        try:
            _meet(spawner.inter, self.comm, self.settings.join_timeout)
            merged = spawner.inter.Merge(high=False)
        except TimeoutError as exc:  # a new process died: a failure that only this wait saw
            raise RanksLost([], self.comm.Get_size(), self.comm.Get_size(), str(exc)) from exc
        finally:
            spawner.free()
        self._replace(_ulfm.returning(merged))  # type: ignore[arg-type]

    def check_host_updates(self) -> None:
        """At a commit: start new ranks where the discovery lists room, raise ``interrupt`` once they are up.

        Every rank reaches the same decision: each commit completes the small
        nonblocking reduction that the commit before started (rank 0's look
        at the discovery, and whether each rank's spawn has finished).
        """
        if not self.settings.discovery.configured and self._spawner is None:
            return
        if self._running is None:  # once per communicator, at the same commit on every rank
            self._running = self._hosts_here()
        verdict, spawned_before = None, False
        if self._pending is not None:
            request, values, spawned_before, _ = self._pending
            request.Wait()
            self._pending = None
            verdict = values
        if self.comm.Get_rank() == 0 and self._look is None and self.settings.discovery.configured:
            self._look = _Look(self.settings.discovery)
        elif self.comm.Get_rank() != 0 and self._look is not None:  # rank 0 is another process now
            self._look.stop.set()
            self._look = None
        # [rank 0's capacity, whether any rank's spawn is in flight, then per rank: whether it is drained]
        mine = np.zeros(2 + self.comm.Get_size(), dtype=np.int64)
        mine[1] = self._spawner is not None and not self._spawner.done.is_set()
        if self._look is not None:
            mine[0] = self._look.capacity
            if self._look.hosts is not None:
                mine[2 + np.array(leaving(self._look.hosts, self._running), dtype=np.intp)] = 1
        values = np.zeros_like(mine)
        self._pending = (self.comm.Iallreduce(mine, values, op=MPI.MAX), values, self._spawner is not None, mine)
        if verdict is None:
            return
        if self._spawner is not None:
            if spawned_before and verdict[1] == 0:  # every rank's spawn has returned
                self._finish_spawn()
            return
        if verdict[2:].any():
            self._drain([int(r) for r in np.flatnonzero(verdict[2:])])
        want = self._target(int(verdict[0])) - self.comm.Get_size()
        if want > 0 and self._failed_spawns < MAX_FAILED_SPAWNS:
            self._start_spawn(want)

    def wind_down(self) -> bool:
        """When the training function returned: complete the last commit's reduction, stop looking (collective).

        A spawn still in flight is finished and its new ranks are taken in
        (they wait for that), so that no process is left waiting.

        Returns:
            Whether new ranks were taken in: the training function is then
            called once more on every rank, from the state as it is (it
            returns at once when it resumes from the state).
        """
        if self._pending is not None:
            self._pending[0].Wait()
            self._pending = None
        if self._look is not None:
            self._look.stop.set()
            self._look = None
        if self._spawner is not None:
            self._spawner.done.wait()
            if self.comm.allreduce(int(self._spawner.ready), op=MPI.MIN):
                self.grow()
                return True
            self._drop_background()
        return False

    # -- internals --------------------------------------------------------------------------------

    def _guard_exit(self) -> None:
        """At exit, finalize MPI within :data:`FINALIZE_SECONDS`, or exit without it.

        After a loss, Open MPI 5's ``MPI_Finalize`` can wait for good in some
        survivors (open-mpi/ompi issue 11404; how often: ``docs/elastic.rst``,
        Limits). Registered once, when this process first lives through a
        change of ranks: it stops the tracked objects' watchdogs (no MPI call
        may follow the finalize), finalizes on a thread, and if that has not
        returned in time, ends the process with ``os._exit``: status 1 after
        an uncaught exception, else 0.
        """
        if self._guarded:
            return
        self._guarded = True
        atexit.register(_finalize_within, self._tracked, FINALIZE_SECONDS)

    def _replace(self, comm: MPI.Intracomm) -> None:
        self._complete_pending()
        self._running = None
        old, self.comm = self.comm, comm
        if old != MPI.COMM_NULL and old != comm:
            try:
                old.Free()
            except MPI.Exception:
                pass

    def _complete_pending(self) -> None:
        """Complete the commit's small reduction in flight, if any, before its communicator goes (local).

        Every rank started it at the same commit, so it completes when
        growing; on a revoked communicator it fails at once, which is ignored.
        """
        if self._pending is not None:
            request, self._pending = self._pending[0], None
            try:
                request.Wait()
            except MPI.Exception:
                pass

    def _target(self, capacity: int) -> int:
        limit = self.settings.max_size
        return capacity if limit is None else min(capacity, limit)

    def _hosts_here(self) -> list[str]:
        return self.comm.allgather(MPI.Get_processor_name())

    def _drain(self, ranks: list[int]) -> None:
        """Raise the interrupt on every rank to let ``ranks`` go, unless too few would be left (collective
        verdict: every rank decides the same)."""
        left = self.comm.Get_size() - len(ranks)
        if left < self.settings.min_size:
            if self.comm.Get_rank() == 0 and not self._said_no_drain:
                sys.stderr.write(f"mpi_gradreducer.elastic: {self.settings.discovery.describe()} no longer lists "
                                 f"the host of rank(s) {_listed(ranks)}; they go on training: draining them would "
                                 f"leave {left}, fewer than min_size={self.settings.min_size}\n")
                self._said_no_drain = True
            return
        self._leaving = ranks
        raise self.interrupt(f"rank(s) {_listed(ranks)} leave: their host is no longer listed", skip_sync=True)

    def _start_spawn(self, want: int | None) -> None:
        """Start ``want`` new ranks in the background (None: up to the target size), where the discovery lists
        free slots (collective)."""
        hosts = self.comm.bcast((_safe_hosts(self.settings.discovery) or {}) if self.comm.Get_rank() == 0 else None)
        if want is None:
            want = self._target(sum(hosts.values())) - self.comm.Get_size()
        if want <= 0:
            return
        running = self._hosts_here()
        places = placement(hosts, running, want, self._lost_on)
        if places:
            self._spawner = _Spawner(self.comm, places, running, self.settings.join_timeout)

    def _finish_spawn(self) -> None:
        """Every rank's spawn has returned: raise the interrupt if all succeeded, else drop it (collective)."""
        assert self._spawner is not None
        ok = self.comm.allreduce(int(self._spawner.ready), op=MPI.MIN)
        if ok:
            raise self.interrupt(f"{self._spawner.count} new rank(s) are ready to join")
        self._failed_spawns += 1
        if self.comm.Get_rank() == 0:
            again = "" if self._failed_spawns < MAX_FAILED_SPAWNS else "; no more tries"
            sys.stderr.write(f"mpi_gradreducer.elastic: starting {self._spawner.count} new rank(s) failed "
                             f"({self._spawner.error!r}); going on with {self.comm.Get_size()}{again}\n")
        self._drop_background()

    def _drop_background(self) -> None:
        """Forget the spawn and the look in flight (their communicators are revoked or unused)."""
        self._complete_pending()
        if self._spawner is not None:
            self._spawner.abandon()
            self._spawner = None

    def _wait_for_room(self) -> None:
        """Below ``min_size``: look for room every second; spawn and merge what comes (collective).

        Raises:
            ElasticError: on every survivor, when the timeout passes first.
        """
        settings = self.settings
        deadline = time.monotonic() + settings.timeout
        while self.comm.Get_size() < settings.min_size:
            hosts = (_safe_hosts(settings.discovery) or {}) if self.comm.Get_rank() == 0 else None
            hosts = self.comm.bcast(hosts)
            want = self._target(sum(hosts.values())) - self.comm.Get_size()
            running = self._hosts_here()
            places = placement(hosts, running, want, self._lost_on) if want > 0 else []
            if places:
                spawner = _Spawner(self.comm, places, running, settings.join_timeout, background=False)
                if spawner.ready:
                    self._spawner = spawner
                    self._merge()
                    continue
                spawner.abandon()
            late = self.comm.allreduce(int(time.monotonic() > deadline), op=MPI.MAX)
            if late:
                raise ElasticError(
                    f"mpi_gradreducer.elastic: {self.comm.Get_size()} rank(s) left, fewer than min_size="
                    f"{settings.min_size}, and no room for replacements appeared within {settings.timeout:g} s "
                    f"({settings.discovery.describe()}); ending the job")
            time.sleep(1.0)


def joining(comm: MPI.Intracomm) -> tuple[int, int] | None:
    """In a process started as a replacement (it has a parent) that has not joined yet: the size and the rank it
    will have once merged with the running ranks, who come first; None in any other process.

    So a replacement's script sees, from its start, the world it joins (as Horovod's ``hvd.size()`` and
    ``hvd.rank()`` do), and partitions data as the running ranks do. Until it joins (at the running ranks'
    next commit, in :func:`~mpi_gradreducer.elastic.run`), its collectives still go over ``comm``, the
    processes started with it.

    Args:
        comm: the processes started with this one (a replacement's ``MPI.COMM_WORLD``, or a duplicate of it).
    """
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    running = parent.Get_remote_size()
    return running + comm.Get_size(), running + comm.Get_rank()


def joining_hosts(comm: MPI.Intracomm) -> list[str] | None:
    """In a replacement that has not joined yet: the host (processor name) of every rank of the world it will
    join, in rank order, its own at its rank there (see :func:`joining`); None in any other process (collective
    over ``comm``).

    So a replacement knows, from its start, its local rank and size in that world too (Horovod's
    ``hvd.local_rank()`` and the like after its ``hvd.init()``). The running ranks pass their hosts in the
    environment of the processes they start (``MPI_GRADREDUCER_ELASTIC_RUNNING_HOSTS``, through Open MPI's
    ``env`` spawn key); where they could not (another MPI, or a list longer than an info value may be), each
    running rank is given a host of its own, so that the new processes count only themselves.

    Args:
        comm: the processes started with this one (as for :func:`joining`).
    """
    ahead = joining(comm)
    if ahead is None:
        return None
    count = ahead[0] - comm.Get_size()
    running = _hosts_from(os.environ.get(RUNNING_HOSTS_ENV, ""))
    if len(running) != count:  # not given (another MPI's spawn, or too long to pass): hosts of their own
        running = [f"(running rank {r})" for r in range(count)]
    return running + processor_names(comm)


def _hosts_value(hosts: list[str]) -> str:
    """``a*2,b`` for ``[a, a, b]``: the hosts of ranks in rank order, as runs (see :data:`RUNNING_HOSTS_ENV`)."""
    runs: list[list[Any]] = []
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    return ",".join(host if n == 1 else f"{host}*{n}" for host, n in runs)


def _hosts_from(value: str) -> list[str]:
    """The hosts that :func:`_hosts_value` wrote (empty for an empty or malformed value)."""
    hosts: list[str] = []
    for run in filter(None, value.split(",")):
        host, _, n = run.partition("*")
        if n and not n.isdigit():
            return []
        hosts += [host] * (int(n) if n else 1)
    return hosts


def _meet(inter: MPI.Intercomm, comm: MPI.Intracomm, seconds: float) -> None:
    """Both sides of a merge meet before it (collective over ``inter`` and ``comm``, this side's own): no process
    enters the merge before every other one is there, alive.

    Open MPI 5.0.11's ``Intercomm_merge`` waits for good when a process of
    either side dies before entering it, revoked communicators or not.
    These nonblocking barriers, one over each side (a barrier over an
    intercommunicator only waits for the other side) and one across, end
    instead, on every process, with an error (a failure known on either
    side revokes both communicators) or after ``seconds``. A process that
    dies inside the merge itself is not survived.

    Raises:
        MPI.Exception: a process was lost (or the communicators revoked).
        TimeoutError: the other side did not come within ``seconds`` (a new process's death is not reported to
            the running ranks, nor theirs always to it).
    """
    _ulfm.complete([comm.Ibarrier(), inter.Ibarrier()], seconds, "the two sides of the merge did not meet",
                   watched=[inter, comm])


def _finalize_within(tracked: list[Rebuildable], seconds: float) -> None:
    if MPI.Is_finalized():
        return
    for t in tracked:
        t.abandon()  # threads stopped: no MPI call may follow the finalize
    library = _libmpi()
    if library is None:
        return
    # through ctypes, which lets go of the GIL during the call (mpi4py's Finalize keeps it: no timeout then)
    finalize = threading.Thread(target=library.MPI_Finalize, name="mpi_gradreducer-finalize", daemon=True)
    finalize.start()
    finalize.join(seconds)
    if finalize.is_alive():
        failed = getattr(sys, "last_type", None) is not None or getattr(sys, "last_exc", None) is not None
        sys.stderr.write(f"mpi_gradreducer.elastic: MPI_Finalize has not returned after {seconds:g} s (a known "
                         "wait of Open MPI's after lost ranks); exiting without it\n")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream must not stop the exit
                pass
        os._exit(1 if failed else 0)


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process has loaded (from ``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi.so"):
                    return ctypes.CDLL(path)
    except (OSError, IndexError):
        pass
    return None


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _safe_hosts(discovery: Discovery) -> dict[str, int] | None:
    """The discovery's hosts; None when the script or file failed, which counts as no room (said on stderr)."""
    try:
        return discovery.hosts()
    except (RuntimeError, ValueError) as exc:
        sys.stderr.write(f"mpi_gradreducer.elastic: {exc}; counting no room\n")
        return None


class _Look:
    """Rank 0's look at the discovery, every :data:`LOOK_EVERY` seconds on a thread of its own.

    Attributes:
        capacity: the slots listed at the last look (0 when it failed).
        hosts: the hosts listed at the last look that succeeded (None before one has): a failing script
            drains nothing.
    """

    def __init__(self, discovery: Discovery) -> None:
        self.capacity = 0
        self.hosts: dict[str, int] | None = None
        self.stop = threading.Event()
        self._discovery = discovery
        thread = threading.Thread(target=self._run, name="mpi_gradreducer-discovery", daemon=True)
        thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            hosts = _safe_hosts(self._discovery)
            self.capacity = sum(hosts.values()) if hosts is not None else 0
            self.hosts = hosts if hosts is not None else self.hosts
            self.stop.wait(LOOK_EVERY)


class _Spawner:
    """New ranks started from the current ranks (``Spawn``), on a thread or at once (collective to start).

    Args:
        comm: the ranks training now.
        places: one host per new rank.
        running: the host of every rank of ``comm``, in rank order (the new processes get them in
            :data:`RUNNING_HOSTS_ENV`: see :func:`joining_hosts`).
        join_timeout: seconds the new processes may take to reach the run loop; later, the start failed.
        background: spawn on a thread (the training goes on meanwhile).
    """

    def __init__(self, comm: MPI.Intracomm, places: list[str], running: list[str], join_timeout: float,
                 background: bool = True) -> None:
        self.comm: MPI.Intracomm = _ulfm.returning(comm.Dup())  # type: ignore[assignment]
        self.count = len(places)
        self.places = places
        self.running = running
        self.join_timeout = join_timeout
        self.inter: MPI.Intercomm | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        if background:
            threading.Thread(target=self._spawn, name="mpi_gradreducer-spawn", daemon=True).start()
        else:
            self._spawn()

    def _spawn(self) -> None:
        info = MPI.Info.Create()
        try:
            here = socket.gethostname()
            if any(p != here for p in self.places):
                info.Set("host", ",".join(self.places))
            variable = f"{RUNNING_HOSTS_ENV}={_hosts_value(self.running)}"
            if len(variable) < MPI.MAX_INFO_VAL:  # Open MPI's key (others ignore it); longer, it is refused
                info.Set("env", variable)
            argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))[1:]
            inter: MPI.Intercomm = _ulfm.returning(  # type: ignore[assignment]
                self.comm.Spawn(sys.executable, args=argv, maxprocs=self.count, info=info, root=0))
            self.inter = inter
            # Spawn returns once the new processes have initialized MPI; they still start Python, import and set
            # up. This barrier, which they enter on reaching the run loop, holds the verdict "spawned" until then,
            # so that the merge at the next commit waits for no one. A new process killed meanwhile never
            # arrives, and its loss does not reach this side: past the join timeout the start failed (the
            # failure then revokes the communicators, which ends the barrier of any that did arrive).
            _ulfm.complete([inter.Ibarrier()], self.join_timeout, "the new process(es) did not reach the run loop")
        except BaseException as exc:  # reported by check_host_updates on every rank
            self.error = exc
        finally:
            info.Free()
            self.done.set()

    @property
    def ready(self) -> bool:
        """Whether the new processes started and every one has reached the run loop (after :attr:`done`)."""
        return self.inter is not None and self.error is None

    def communicators(self) -> list[MPI.Comm]:
        """The communicators to revoke on a failure: the one spawned over, and the new processes' (once made)."""
        return [c for c in (self.comm, self.inter) if c is not None]

    def abandon(self) -> None:
        """Forget the spawn: revoke its communicators; a spawn or a wait for the new processes ends with an error."""
        _ulfm.revoke(self.communicators())
        self.done.wait(timeout=5.0)
        self.free()

    def free(self) -> None:
        """Free the communicators (local)."""
        for comm in (self.inter, self.comm):
            if comm is not None and comm != MPI.COMM_NULL:
                try:
                    comm.Free()
                except MPI.Exception:
                    pass
