"""Horovod's set-up and topology: ``init``/``shutdown`` and who is where, held in one context object.

Everything Horovod keeps in its C++ core's global state lives here in one
:class:`Context` (the communicators, the engine thread, the process sets),
made by :func:`init` and dropped by :func:`shutdown`; the module keeps
nothing else. Local ranks are the ranks that share a host (the package's
:class:`~mpi_gradreducer._core.topology.Topology`), cross ranks the ranks with the same
local rank on every host, as in Horovod.
"""

from __future__ import annotations

import atexit
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from .._core import groups
from .._core.agreement import raise_if_any
from .._core.singleton import check_not_singleton
from .._core.topology import Topology
from ..elastic import joining, joining_hosts
from .engine import Engine
from .settings import Settings
from .views import Views

__all__ = ["Context", "SetInfo", "current", "init", "shutdown", "is_initialized", "waiting_in", "size", "rank",
           "local_size", "local_rank", "cross_size", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]

#: The interpreter's thread switch interval while Horovod is initialized (seconds), where the program left Python's
#: default (5 ms). The engine's thread and the caller's take turns with the GIL; every MPI call releases it, and
#: getting it back from a thread that runs Python code takes up to one interval. 400 ``allreduce_async_`` of 4 KiB
#: then ``synchronize`` at 2 ranks (a shared 2-core machine): 183 ms median at 5 ms, 105 ms at 0.5 ms, 106 ms at
#: 0.1 ms.
SWITCH_INTERVAL = 0.5e-3
#: Python's own switch interval.
_PYTHON_SWITCH_INTERVAL = 5e-3

#: Horovod's words, and ours: the type is Horovod's (``ValueError``).
NOT_INITIALIZED = ("Horovod has not been initialized; use hvd.init(). (mpi_gradreducer.horovod: call hvd.init() "
                   "on every rank before {what})")


@dataclass
class SetInfo:
    """One process set as this rank knows it.

    Attributes:
        id: its ``process_set_id`` (0: the global set).
        ranks: its global ranks, in order.
        comm: its communicator on its ranks (a duplicate, owned here); ``MPI.COMM_NULL`` elsewhere.
        views: the host views of the tensors of this rank's latest in-place grouped allreduces in the set.
    """

    id: int
    ranks: tuple[int, ...]
    comm: MPI.Intracomm
    views: Views = field(default_factory=Views)

    @property
    def member(self) -> bool:
        """Whether this rank is in the set."""
        return self.comm != MPI.COMM_NULL


@dataclass
class Context:
    """What :func:`init` sets up: the communicators (duplicates, owned here), the engine and the process sets.

    Attributes:
        comm: the global communicator (Horovod's global process set), for
            the few collectives the caller's thread makes itself (making and
            freeing process sets, writing the timeline).
        local: the ranks of ``comm`` on this host.
        cross: the ranks of ``comm`` with this rank's local rank, one per host.
        engine: the thread every operation goes through.
        sets: the process sets by id (0: the global one, over a duplicate of ``comm``).
        next_id: the id the next process set gets (the same on every rank: sets are added collectively).
        timeline: the timeline being recorded (``start_timeline``).
        optimizers: weak references to the live ``DistributedOptimizer`` objects (``join()`` serves them).
        switch_interval: the interpreter's switch interval before :func:`init` lowered it (:data:`SWITCH_INTERVAL`),
            restored by :func:`shutdown`; None when it was left as it was.
        joining: in a replacement started by elastic mode, before it joins the running ranks: the hosts of the
            world it joins, as it will be there (:func:`mpi_gradreducer.elastic.joining_hosts`), whose size,
            rank, local and cross ranks and sizes :func:`size`, :func:`rank`, :func:`local_rank` and the like
            report, as Horovod's do; None otherwise.
    """

    comm: MPI.Intracomm
    local: MPI.Intracomm
    cross: MPI.Intracomm
    engine: Engine
    sets: dict[int, SetInfo] = field(default_factory=dict)
    next_id: int = 1
    timeline: Any = None
    optimizers: list[Any] = field(default_factory=list)
    switch_interval: float | None = None
    joining: Topology | None = None

    def communicators(self) -> Iterator[MPI.Intracomm]:
        """Every communicator this context owns, the engine's included: what a lost rank's recovery revokes."""
        yield from (c for c in (self.comm, self.local, self.cross) if c != MPI.COMM_NULL)
        yield from (info.comm for info in self.sets.values() if info.comm != MPI.COMM_NULL)
        yield from self.engine.communicators()

    def free(self) -> None:
        """Stop the engine and free the communicators (collective over ``comm``)."""
        self.engine.close()
        self.engine.free()
        for info in self.sets.values():
            if info.comm != MPI.COMM_NULL:
                info.comm.Free()
        self.sets.clear()
        for c in (self.cross, self.local, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()


class _Session:
    """The single holder of the context: set by :func:`init`, cleared by :func:`shutdown`."""

    context: Context | None = None


def current(what: str = "this call") -> Context:
    """The context made by :func:`init`.

    Args:
        what: the call that needs it, for the message.

    Raises:
        ValueError: before :func:`init` (or after :func:`shutdown`), as Horovod does.
    """
    ctx = _Session.context
    if ctx is None:
        raise ValueError(NOT_INITIALIZED.format(what=what))
    return ctx


def init(comm: MPI.Intracomm | Sequence[int] | None = None) -> None:
    """Initialize (collective over ``comm``; over ``MPI.COMM_WORLD`` when ``comm`` lists ranks).

    A second call while initialized does nothing, as in Horovod. Starts the
    engine thread that every collective goes through, and lowers the
    interpreter's thread switch interval to :data:`SWITCH_INTERVAL` where the
    program left Python's default (restored by :func:`shutdown`).

    Args:
        comm: None (every rank of ``MPI.COMM_WORLD``), an mpi4py
            intracommunicator (duplicated), or a list of ranks of
            ``MPI.COMM_WORLD`` (every rank of ``MPI.COMM_WORLD`` calls
            ``init`` with the same list).

    Raises:
        TypeError: ``comm`` is none of the above.
        ValueError: this rank is not in the listed ranks (on those ranks only:
            the listed ranks are initialized), or the list is invalid (on every
            rank), or a ``HOROVOD_*`` setting is invalid on some rank (on every
            rank, naming it: :class:`~.settings.Settings`).
    """
    if _Session.context is not None:
        return
    check_not_singleton()
    if comm is None:
        base: MPI.Intracomm = MPI.COMM_WORLD.Dup()
    elif isinstance(comm, MPI.Intracomm):
        if comm == MPI.COMM_NULL:
            raise TypeError("comm: expected an mpi4py intracommunicator, got MPI.COMM_NULL")
        base = comm.Dup()
    elif isinstance(comm, Sequence) and not isinstance(comm, (str, bytes)):
        new = groups.create_group(list(comm), MPI.COMM_WORLD)
        if new is None:
            raise ValueError(f"init(comm={list(comm)!r}): rank {MPI.COMM_WORLD.Get_rank()} of MPI.COMM_WORLD is "
                             "not in comm; only the listed ranks may use Horovod's calls")
        base = new
    else:
        raise TypeError(f"comm: expected None, an mpi4py intracommunicator or a list of ranks, got "
                        f"{type(comm).__name__} {comm!r}")
    try:
        settings, error = Settings.from_environment(), None
    except ValueError as exc:  # raised on every rank, naming the rank whose environment is wrong
        settings, error = Settings(), exc
    try:
        raise_if_any(base, error)
    except ValueError:
        base.Free()
        raise
    if base.Get_rank() == 0:
        for note in settings.ignored:
            warnings.warn(note, RuntimeWarning, stacklevel=3)
    local, cross = Topology.of(base).split(base)
    ranks = tuple(range(base.Get_size()))
    optimizers: list[Any] = []
    engine = Engine(base.Get_rank(), settings, elsewhere=lambda: _reductions(optimizers))
    own = base.Dup()
    engine.add_set(0, ranks, own)
    switch = None
    if sys.getswitchinterval() == _PYTHON_SWITCH_INTERVAL:  # a program's own choice is left alone
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
    # a replacement's first init (its rebuilds pass the world): the world it joins, as it will be there
    hosts, ahead = (joining_hosts(base), joining(base)) if comm is None else (None, None)
    joined = None if hosts is None or ahead is None else Topology.named(hosts, ahead[1])
    _Session.context = Context(base, local, cross, engine, {0: SetInfo(0, ranks, own)}, optimizers=optimizers,
                               switch_interval=switch, joining=joined)


def waiting_in(besides: Callable[[], Any] | None = None) -> list[str]:
    """What this process waits in under Horovod now, in words: the engine's operations in flight, then the
    reductions of the live ``DistributedOptimizer`` objects (but the one ``besides`` refers to): the
    ``elsewhere`` option of a ``DistributedOptimizer``'s reducer, which the other ranks' stall warnings quote.
    Safe from any thread; empty when Horovod is not initialized.

    Args:
        besides: a weak reference to the optimizer that asks (its own reduction is its watchdog's to tell).
    """
    ctx = _Session.context
    if ctx is None:
        return []
    return ctx.engine.pending() + _reductions(ctx.optimizers, None if besides is None else besides())


def _reductions(optimizers: list[Any], besides: Any = None) -> list[str]:
    """The reductions of the live ``DistributedOptimizer`` objects in progress (but ``besides``'s), in words."""
    out = []
    for ref in list(optimizers):
        opt = ref()
        waiting = None if opt is None or opt is besides else opt.reducer.waiting()
        if waiting is not None:
            set_id = getattr(opt.process_set, "process_set_id", None)
            where = "" if set_id is None else f" in process set {set_id}"
            out.append(f"hvd.DistributedOptimizer's reduction{where}: {waiting}")
    return out


def shutdown() -> None:
    """Stop the engine and free what :func:`init` made (collective). Does nothing when not initialized.

    Operations still in flight then (some rank never made the call) fail
    with ``RuntimeError`` after at most 30 seconds. Then the other ranks of
    this rank's process sets hear that it has left: their operations that
    wait for it fail with ``HorovodInternalError`` instead of waiting (also
    when the process ends without calling this: it runs at exit).
    """
    ctx, _Session.context = _Session.context, None
    if ctx is not None:
        ctx.free()
        if ctx.switch_interval is not None and sys.getswitchinterval() == SWITCH_INTERVAL:
            sys.setswitchinterval(ctx.switch_interval)


def _at_exit() -> None:
    """At the end of the process: stop the engine before MPI is finalized (no collective here)."""
    ctx = _Session.context
    if ctx is not None:
        ctx.engine.close(limit=5.0)


atexit.register(_at_exit)


def is_initialized() -> bool:
    """Whether :func:`init` was called (and :func:`shutdown` was not since)."""
    return _Session.context is not None


def size() -> int:
    """The number of ranks (in a replacement before it joins the running ranks: the number it joins)."""
    ctx = current("hvd.size()")
    return ctx.comm.Get_size() if ctx.joining is None else ctx.joining.size


def rank() -> int:
    """This rank (in a replacement before it joins the running ranks: the rank it will have)."""
    ctx = current("hvd.rank()")
    return ctx.comm.Get_rank() if ctx.joining is None else ctx.joining.rank


def local_size() -> int:
    """The number of ranks on this host."""
    ctx = current("hvd.local_size()")
    return ctx.local.Get_size() if ctx.joining is None else ctx.joining.local_size


def local_rank() -> int:
    """This rank among the ranks on this host."""
    ctx = current("hvd.local_rank()")
    return ctx.local.Get_rank() if ctx.joining is None else ctx.joining.local_rank


def cross_size() -> int:
    """The number of hosts that have a rank with this rank's local rank."""
    ctx = current("hvd.cross_size()")
    return ctx.cross.Get_size() if ctx.joining is None else ctx.joining.cross_size


def cross_rank() -> int:
    """This rank among the ranks with its local rank, one per host, in host order."""
    ctx = current("hvd.cross_rank()")
    return ctx.cross.Get_rank() if ctx.joining is None else ctx.joining.cross_rank


def mpi_threads_supported() -> bool:
    """Whether MPI was initialized with ``MPI_THREAD_MULTIPLE``."""
    current("hvd.mpi_threads_supported()")
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True: every collective here is MPI."""
    return True


def mpi_built() -> bool:
    """True: this package runs on MPI (mpi4py)."""
    return True


def gloo_enabled() -> bool:
    """False: no gloo controller (the ranks are MPI's)."""
    return False


def gloo_built() -> bool:
    """False: no gloo."""
    return False


def nccl_built() -> int:
    """0 (false): device tensors go through MPI (host copies), not NCCL."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """Whether cupy is installed and sees a CUDA device: the package's GPU paths are usable.

    Horovod answers whether it was compiled with CUDA; this package is pure
    Python, so the answer is whether its device arrays (cupy) would work
    here. The torch collectives of this module take CUDA tensors either way
    (through host copies).
    """
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # a CUDA runtime error without a driver or device
        return False


def rocm_built() -> bool:
    """False: no ROCm paths."""
    return False
