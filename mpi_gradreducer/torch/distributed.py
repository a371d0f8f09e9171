"""A ``torch.distributed`` backend over MPI: ``ProcessGroup`` calls translated onto the package's collectives.

``import mpi_gradreducer.torch`` registers the backend ``"mpi_gradreducer"``
(CPU and CUDA tensors) and the rendezvous ``mpi://``. Under ``mpiexec``::

    import torch.distributed as dist
    import mpi_gradreducer.torch  # registers the backend

    dist.init_process_group("mpi_gradreducer", init_method="mpi://")  # rank and size from MPI

``init_method="mpi://"`` is needed because ``init_process_group`` skips its
rendezvous only for torch's own MPI backend: every other backend gets a
store, by default from ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``), which works as well, as torchrun, Lightning's
``MPIEnvironment`` and Accelerate set it. ``mpi://`` makes that store (a
``TCPStore`` on an address of rank 0 that every rank reaches) from MPI alone.

How a call runs. Every process group owns a duplicate of its communicator
(the world's, or an MPI sub-communicator for ``new_group``), a
communication thread and the package's watchdog. A collective is checked
and staged on the caller's thread (a contiguous host tensor for a strided
or CUDA one), queued, and returns an :class:`MPIWork` at once; the thread
runs the queue in order: the ranks agree (``_core.agreement``:
one small ``Allreduce``; a shape, dtype or operation that differs on one
rank raises the same ``ValueError`` on every rank, naming both ranks), then
nonblocking MPI calls move the bytes, completed the package's way
(``_core.polling.Polling``: tests with naps while the
training thread computes, MPI's own wait while a caller waits). float16 and
bfloat16 sums go through the package's 16-bit summer
(``_core.halves.SliceSum``: float32 sums, rounded once).
Point-to-point calls are posted at once on a second duplicate and completed
by a thread of their own.

Options: ``init_process_group(..., pg_options=mpi_gradreducer.Options(...))``
(or ``new_group(..., pg_options=...)``) reads ``validate`` (``"never"``:
no agreement before each collective, the fastest, but a mismatch then hangs
or corrupts as with any MPI program), ``timeout`` (the watchdog's; default:
the process group's own timeout) and ``stall_warning``.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .._core import agreement, interop
from .._core.dtypes import digest
from .._core.halves import SliceSum
from .._core.options import TIMEOUT_ENV, Options, resolve
from .._core.polling import Polling
from .._core.rendezvous import tcp_rendezvous
from .._core.singleton import check_not_singleton
from .._core.topology import Topology
from .._core.transport import CHUNK_BYTES, CHUNK_BYTES_ACROSS_HOSTS
from .._core.watchdog import Watchdog
from .._core.wire import get_compression

__all__ = ["ACROSS_HOSTS_IN_FLIGHT", "BACKEND", "NAP_SECONDS", "RENDEZVOUS", "ElasticGroup", "MPIProcessGroup",
           "MPIWork", "init_process_group", "register"]

#: The backend's name, as ``init_process_group`` and ``new_group`` take it.
BACKEND = "mpi_gradreducer"
#: The rendezvous scheme whose store comes from MPI alone, as in ``init_method="mpi://"``.
RENDEZVOUS = "mpi"

#: The communication thread's nap between tests of a request while no caller waits in :meth:`MPIWork.wait`
#: (DDP waits on the future, in C++, unseen). DDP over this backend over DDP over gloo
#: (``python -m mpi_gradreducer.bench.torch_ddp``, 2 ranks, interleaved runs on a loaded 2-core machine):
#: 0.81, 0.85, 1.09 with 50 us naps; 0.98, 1.00, 1.09, 1.18 with the reducer's 250 us; 0.81, 1.01 with 10 us.
NAP_SECONDS = 50e-6
#: Where a group spans several hosts, its all-reduces go in chunks of ``CHUNK_BYTES_ACROSS_HOSTS`` (1 MiB), this
#: many in flight. DDP over this backend over DDP over gloo, 2 hosts x 1 rank at 1 Gbit/s
#: (``scripts/cluster.py run --hosts 2 --ppn 1 --rate 1gbit -- python -m mpi_gradreducer.bench.torch_ddp``):
#: 1.07, 1.01 with 1 MiB x 4; 1.05 with 256 KiB x 8; 1.25 with 1 MiB x 2; 1.21, 1.05 with 4 MiB x 1.
ACROSS_HOSTS_IN_FLIGHT = 4

_OPERATIONS = ("allreduce", "broadcast", "reduce", "allgather", "all_gather_into_tensor", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier")
_REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32,
           torch.uint64)
_HALVES = (torch.float16, torch.bfloat16)
#: The MPI datatype in which each dtype that MPI can reduce is reduced (besides the 16-bit floats).
_MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T, torch.uint64: MPI.UINT64_T, torch.bool: MPI.C_BOOL,
}
_MPI_OPS = {"SUM": MPI.SUM, "AVG": MPI.SUM, "PRODUCT": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX,
            "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
#: bool tensors: torch's sum and max are "or", product and min are "and".
_BOOL_OPS = {"SUM": MPI.LOR, "MAX": MPI.LOR, "BOR": MPI.LOR, "PRODUCT": MPI.LAND, "MIN": MPI.LAND,
             "BAND": MPI.LAND, "BXOR": MPI.LXOR}


def register() -> None:
    """Register the backend ``"mpi_gradreducer"`` (CPU and CUDA) and the rendezvous ``mpi://`` with torch.

    Idempotent; ``import mpi_gradreducer.torch`` calls it.
    """
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    try:
        dist.register_rendezvous_handler(RENDEZVOUS, _mpi_rendezvous)
    except RuntimeError:  # registered already
        pass


def _mpi_rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                    **_: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """``mpi://``: rank and size from ``MPI.COMM_WORLD``, a ``TCPStore`` on rank 0 (collective)."""
    check_not_singleton()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    query = parse_qs(urlparse(url).query)
    for key, mine in (("rank", rank), ("world_size", size)):
        given = int(query.get(key, ["-1"])[0])
        if given not in (-1, mine):
            raise ValueError(f"init_process_group: {key}={given} was given, but MPI says {mine} (rank {rank}); "
                             f"with init_method='{RENDEZVOUS}://' leave rank and world_size out")
    meet = tcp_rendezvous(world)
    store = dist.TCPStore(meet.address, meet.port, size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    yield store, rank, size
    raise RuntimeError(f"the {RENDEZVOUS}:// rendezvous cannot be repeated")


def init_process_group(comm: MPI.Intracomm | None = None, options: Options | None = None,
                       timeout: datetime.timedelta | None = None) -> None:
    """Make ``torch.distributed``'s default process group over the ranks of ``comm`` (collective).

    ``init_process_group("mpi_gradreducer", init_method="mpi://")`` does the
    same over ``MPI.COMM_WORLD``; this one takes any intracommunicator, such
    as the survivors' after a lost rank (:class:`ElasticGroup`). Rank ``r`` of
    ``comm`` is rank ``r`` of the group; the store is a ``TCPStore`` on an
    address of ``comm``'s rank 0 that every rank reaches.

    Args:
        comm: the ranks; default ``MPI.COMM_WORLD``.
        options: the group's options (see :class:`MPIProcessGroup`).
        timeout: torch's timeout for the group (default 30 minutes).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    timeout = datetime.timedelta(minutes=30) if timeout is None else timeout
    meet = tcp_rendezvous(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    store = dist.TCPStore(meet.address, meet.port, size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=size, timeout=timeout,
                            pg_options=_Over(comm, options))


class _Over:
    """``pg_options`` that carry the communicator a default group is made over (:func:`init_process_group`)."""

    def __init__(self, comm: MPI.Intracomm, options: Options | None) -> None:
        self.comm, self.options = comm, options


def _create(opts: Any, options: Any) -> MPIProcessGroup:
    """The backend's creator (torch's extended API): the process group of ``opts.global_ranks_in_group``."""
    check_not_singleton()
    rank, size = int(opts.group_rank), int(opts.group_size)
    members = [int(r) for r in opts.global_ranks_in_group]
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(f"{BACKEND}: needs MPI_THREAD_MULTIPLE (its communication thread), which MPI did not "
                           "grant; leave mpi4py.rc.thread_level at its default")
    world = MPI.COMM_WORLD
    if isinstance(options, _Over):
        world, options = options.comm, options.options
        members = []
    if not members or members == list(range(world.Get_size())) and not _is_ours(dist.group.WORLD):
        if world.Get_size() != size:
            raise RuntimeError(
                f"{BACKEND}: torch.distributed says world size {size} (rank {rank}), but the MPI communicator has "
                f"{world.Get_size()} processes: start every rank with mpiexec (or srun --mpi=pmi2), not torchrun")
        comm = world.Split(0, rank)  # our own duplicate, ranked as torch ranks them
    else:
        parent = dist.group.WORLD
        if _is_ours(parent):
            spawner = parent._spawner  # type: ignore[union-attr]
        else:  # the default group is another backend's: its ranks must be MPI's
            spawner = world
            if dist.get_rank() != world.Get_rank():
                raise RuntimeError(f"new_group(backend={BACKEND!r}): the default group's rank {dist.get_rank()} "
                                   f"is not MPI's rank {world.Get_rank()}; start the job with mpiexec")
        made = spawner.Create_group(spawner.Get_group().Incl(members))
        assert isinstance(made, MPI.Intracomm)
        comm = made
    if comm.Get_rank() != rank or comm.Get_size() != size:
        raise RuntimeError(f"{BACKEND}: the communicator has rank {comm.Get_rank()} of {comm.Get_size()} where "
                           f"torch expects rank {rank} of {size}")
    assert isinstance(comm, MPI.Intracomm)
    return MPIProcessGroup(comm, options, timeout=opts.timeout)


def _is_ours(pg: Any) -> bool:
    return isinstance(pg, MPIProcessGroup)


# -- work -----------------------------------------------------------------------------------------


class MPIWork(dist._Work):
    """The handle of one call: completed by the communication thread; ``wait``, ``is_completed``, ``get_future``.

    Args:
        operation: the call's name, for messages.
        outputs: the tensors the call writes (its future's value).
        engine: the thread that completes it (told when a caller waits).
    """

    def __init__(self, operation: str, outputs: list[torch.Tensor], engine: _Engine) -> None:
        super().__init__()
        self.operation = operation
        self._outputs = outputs
        self._engine = engine
        devices: list[int | str | torch.device] = [
            d for d in sorted({str(t.device) for t in outputs if t.device.type == "cuda"})]
        # torch's Future.set_exception stores the exception as the value, which C++ callers (DDP's reducer)
        # take for a result (and crash on): an error raised in a callback of then() is a real one.
        self._inner: torch.futures.Future[tuple[list[torch.Tensor], BaseException | None]] = (
            torch.futures.Future(devices=devices) if devices else torch.futures.Future())
        self._future: torch.futures.Future[list[torch.Tensor]] = self._inner.then(_unwrap)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._source = -1

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the call has completed; raise its error.

        Args:
            timeout: a ``timedelta`` or seconds; None or zero waits for ever.

        Raises:
            RuntimeError: not completed within ``timeout`` (the call goes on).
            ValueError, TypeError, RuntimeError: the call's own error, raised on every rank alike.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._done.is_set():
            with self._engine.waiting():
                finished = self._done.wait(seconds if seconds else None)
            if not finished:
                raise RuntimeError(f"{BACKEND}: {self.operation} did not complete within {seconds:g} s "
                                   "(wait(timeout)); it goes on in the background")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the call has completed (successfully or not)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the call has completed without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The call's error once it has completed with one, else None."""
        return self._error

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future of the call's output tensors, completed by the communication thread."""
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensors (after :meth:`wait`)."""
        return self._outputs

    def source_rank(self) -> int:
        """The rank a ``recv`` from any source received from (-1 before it completed)."""
        return self._source

    _source_rank = source_rank

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        try:
            self._inner.set_result((self._outputs, error))  # runs the future's callbacks (DDP's) on this thread
        finally:
            self._done.set()


def _unwrap(done: torch.futures.Future[tuple[list[torch.Tensor], BaseException | None]]) -> list[torch.Tensor]:
    outputs, error = done.value()
    if error is not None:
        raise error
    return outputs


class _Engine:
    """One thread that runs a process group's jobs in the order they were queued."""

    def __init__(self, name: str) -> None:
        self.polling = Polling(NAP_SECONDS)
        self.polling.computing(True)
        self._waiters = 0
        self._lock = threading.Lock()
        #: The last MPI error a job of this thread raised (a lost rank, a revoked communicator), or None.
        self.mpi_error: MPI.Exception | None = None
        self._jobs: queue.SimpleQueue[tuple[MPIWork, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: MPIWork, job: Callable[[], None]) -> MPIWork:
        self._jobs.put((work, job))
        return work

    def waiting(self) -> _Waiting:
        """While a caller waits: MPI's own wait instead of tests with naps."""
        return _Waiting(self)

    def _enter(self, delta: int) -> None:
        with self._lock:
            self._waiters += delta
            self.polling.computing(self._waiters == 0)

    def close(self, wait: float | None = None) -> None:
        """Stop the thread after the jobs queued (waiting at most ``wait`` seconds; None: for ever)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            work, job = item
            try:
                job()
            except BaseException as exc:  # handed to the caller through the work
                if isinstance(exc, MPI.Exception):
                    self.mpi_error = exc
                work._finish(exc)
            else:
                work._finish(None)


class _Waiting:
    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self.engine._enter(1)

    def __exit__(self, *exc: Any) -> None:
        self.engine._enter(-1)


# -- staging ----------------------------------------------------------------------------------------


class _Host:
    """A contiguous CPU tensor for ``tensor`` (itself when it is one); :meth:`back` writes it back.

    Args:
        tensor: the caller's tensor.
        read: its values are read (False: only written, so a copy need not be filled).
    """

    __slots__ = ("tensor", "host", "copied")

    def __init__(self, tensor: torch.Tensor, read: bool = True) -> None:
        self.tensor = tensor
        t = tensor.detach()
        self.copied = not (t.device.type == "cpu" and t.is_contiguous())
        if not self.copied:
            self.host = t
        elif read:
            self.host = t.to("cpu").contiguous()
        else:
            self.host = torch.empty(t.shape, dtype=t.dtype)

    def bytes(self) -> np.ndarray:
        """The host tensor's bytes, as a 1-D numpy view."""
        view = interop.view(self.host.reshape(-1).view(torch.uint8))
        assert isinstance(view, np.ndarray)
        return view

    def back(self) -> None:
        """Write the host tensor into the caller's (when they differ)."""
        if self.copied:
            with torch.no_grad():
                self.tensor.copy_(self.host)
            if self.tensor.device.type == "cuda":
                torch.cuda.current_stream(self.tensor.device).synchronize()


def _tensor(t: Any, what: str, operation: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{operation}: {what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{operation}: {what}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{operation}: {what}: expected a CPU or CUDA tensor, got one on {t.device}")
    return t


def _row(t: torch.Tensor, shape: bool = True) -> tuple[int, ...]:
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES) + digest([str(t.dtype)]) % 1000
    return (code, t.dim(), *(t.shape if shape else ()))


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "another dtype"


def _reduction(op: Any) -> str:
    """The name of a ``ReduceOp`` (or ``RedOpType``)."""
    for name in _REDUCTIONS:
        if op == getattr(dist.ReduceOp, name):
            return name
    return str(op)


def _check_reducible(operation: str, dtype: torch.dtype, op: str) -> None:
    """Raise unless MPI can reduce ``dtype`` with ``op`` (the message names the operation)."""
    if op == "PREMUL_SUM" or op not in _MPI_OPS:
        raise ValueError(f"{operation}: ReduceOp.{op} is not supported by the {BACKEND} backend; use SUM, AVG, "
                         "PRODUCT, MIN, MAX, BAND, BOR or BXOR")
    if dtype not in _MPI_TYPES and dtype not in _HALVES:
        raise TypeError(f"{operation}: tensors of dtype {dtype} cannot be reduced over MPI (ReduceOp.{op}); "
                        "they can be moved (broadcast, all_gather, scatter, all_to_all, send)")
    if op == "AVG" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{operation}: ReduceOp.AVG needs a floating-point or complex tensor, got {dtype}")
    if op in ("MIN", "MAX") and dtype.is_complex:
        raise TypeError(f"{operation}: ReduceOp.{op} of a complex tensor ({dtype}) is undefined")
    if op in ("BAND", "BOR", "BXOR") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{operation}: ReduceOp.{op} needs an integer or bool tensor, got {dtype}")


def _as_list(tensors: Any) -> list[Any]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _chunks(count: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[slice]:
    step = max(1, chunk_bytes // max(1, itemsize))
    for start in range(0, count, step):
        yield slice(start, min(count, start + step))


# -- the process group --------------------------------------------------------------------------------


class MPIProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group over its own MPI communicator.

    Made by ``init_process_group("mpi_gradreducer", ...)`` and ``new_group(...,
    backend="mpi_gradreducer")``; construction is collective over ``comm``.

    Args:
        comm: the group's ranks, in torch's order; the group takes it over
            (and frees it at :meth:`shutdown`).
        options: a :class:`~mpi_gradreducer.Options` (``validate``,
            ``timeout``, ``stall_warning``, ``abort_on_exception`` are read), or None.
        timeout: torch's timeout for the group: the watchdog's, unless
            ``options`` or ``MPI_GRADREDUCER_TIMEOUT`` give one.
    """

    def __init__(self, comm: MPI.Intracomm, options: Options | None = None,
                 timeout: datetime.timedelta | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())  # type: ignore[call-arg]
        asked = Options() if options is None else options
        error: BaseException | None = None
        resolved = asked
        try:
            if not isinstance(asked, Options):
                raise TypeError(f"pg_options: expected a mpi_gradreducer.Options or None, got {type(asked).__name__}")
            resolved = resolve(asked, (), comm.Get_size())
        except (TypeError, ValueError) as exc:
            error = exc
        agreement.raise_if_any(comm, error)
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._group_name, self._group_desc = "", ""
        self._validate = resolved.validate != "never"
        watchdog_timeout = resolved.timeout
        if asked.timeout == "env" and not _env_has(TIMEOUT_ENV) and timeout is not None:
            watchdog_timeout = timeout.total_seconds()
        self._spawner = comm.Dup()  # new_group's sub-communicators are made on it, from the caller's thread
        self._p2p = comm.Dup()  # point-to-point, posted from the caller's thread
        assert isinstance(watchdog_timeout, float | int | None) and not isinstance(resolved.stall_warning, str)
        self._watchdog = Watchdog(comm, watchdog_timeout, resolved.stall_warning,
                                  hook=bool(resolved.abort_on_exception))
        self._engine = _Engine(f"{BACKEND}-collectives")
        self._p2p_engine = _Engine(f"{BACKEND}-p2p")
        self._halves: dict[torch.dtype, SliceSum] = {}
        across = Topology.of(comm).hosts > 1
        #: Bytes per Iallreduce, and how many are in flight (see ACROSS_HOSTS_IN_FLIGHT).
        self._chunk = CHUNK_BYTES_ACROSS_HOSTS if across else CHUNK_BYTES
        self._window = ACROSS_HOSTS_IN_FLIGHT if across else 1
        self._calls = 0
        self._closed = False

    # -- identity --

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    @property
    def comm(self) -> MPI.Intracomm:
        """The group's communicator (for MPI calls of the caller's own beside torch's)."""
        return self._comm

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    # torch keeps a group's name and description in its C++ backends, of which a Python group has none.

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # -- the core of every collective --

    def _submit(self, operation: str, outputs: list[torch.Tensor], error: BaseException | None,
                rows: list[tuple[int, ...]], body: Callable[[], None]) -> MPIWork:
        """Queue ``body`` after the ranks' agreement on ``rows`` (and on ``error``); return its work."""
        if self._closed:
            raise RuntimeError(f"{operation}: the process group was shut down")
        self._calls += 1
        call = self._calls
        work = MPIWork(operation, outputs, self._engine)

        def job() -> None:
            self._watchdog.arm(lambda: operation, call)  # the agreement is where a missing rank is waited for
            try:
                if self._validate:
                    self._agree(operation, error, rows)
                elif error is not None:
                    raise error
                body()
            finally:
                self._watchdog.disarm()

        return self._engine.submit(work, job)

    def _agree(self, operation: str, error: BaseException | None, rows: list[tuple[int, ...]]) -> None:
        """Raise the same error on every rank when one rank failed or the ranks' rows differ."""
        try:
            agreement.raise_if_any(self._comm, error, checks=(len(rows), digest([v for r in rows for v in r])))
        except agreement.ChecksDiffer:
            def describe(i: int, row: tuple[int, ...]) -> str:
                if i == 0:
                    head = f"{_OPERATIONS[row[0]]}" if row and row[0] < len(_OPERATIONS) else "another operation"
                    more = f" with ReduceOp.{_REDUCTIONS[row[1]]}" if len(row) > 1 and row[1] >= 0 else ""
                    return head + more + (f" (root {row[2]})" if len(row) > 2 and row[2] >= 0 else "")
                return f"dtype {_dtype_name(row[0])}, {row[1]} dims" + (f", shape {tuple(row[2:])}" if len(row) > 2
                                                                      else "")

            agreement.check_same(self._comm, rows, describe,
                                 lambda i: f"{operation}: the call" if i == 0 else f"{operation}: tensor {i - 1}")
            raise

    def _head(self, operation: str, op: str = "", root: int = -1) -> tuple[int, ...]:
        return (_OPERATIONS.index(operation), _REDUCTIONS.index(op) if op in _REDUCTIONS else -1, root)

    def _wait(self, request: MPI.Request) -> None:
        self._engine.polling.wait(request)

    def _summer(self, dtype: torch.dtype) -> SliceSum:
        summer = self._halves.get(dtype)
        if summer is None:
            compression = get_compression("fp16" if dtype == torch.float16 else "bf16")
            summer = SliceSum(self._comm, compression, CHUNK_BYTES, "alltoall", wait=self._wait)
            self._halves[dtype] = summer
        return summer

    def _check_root(self, operation: str, root: int) -> None:
        if not 0 <= root < self._comm.Get_size():
            raise ValueError(f"{operation}: root: expected a rank in [0, {self._comm.Get_size() - 1}], got {root}")

    # -- reductions --

    def _reduce_host(self, h: _Host, op: str) -> None:
        """Reduce ``h.host`` across the ranks in place (every rank gets the result)."""
        t = h.host
        n, size = t.numel(), self._comm.Get_size()
        if n == 0:
            return
        if t.dtype in _HALVES:
            if op in ("SUM", "AVG"):
                summer = self._summer(t.dtype)
                summer.reduce(h.bytes().view(summer.compression.wire_dtype), 1.0 / size if op == "AVG" else 1.0)
                return
            wide = _Host(t.float())
            self._allreduce_bytes(wide, op)
            t.copy_(wide.host)
            return
        self._allreduce_bytes(h, op)
        if op == "AVG":
            t.div_(size)

    def _allreduce_bytes(self, h: _Host, op: str) -> None:
        t = h.host
        if self._comm.Get_size() == 1:
            return
        mpi_type = _MPI_TYPES[t.dtype]
        mpi_op = _BOOL_OPS[op] if t.dtype == torch.bool else _MPI_OPS[op]
        data = h.bytes()
        item = t.element_size()
        flight: list[MPI.Request] = []
        try:
            for part in _chunks(t.numel(), item, self._chunk):
                piece = data[part.start * item: part.stop * item]
                flight.append(self._comm.Iallreduce(MPI.IN_PLACE, [piece, part.stop - part.start, mpi_type],
                                                    op=mpi_op))
                if len(flight) >= self._window:
                    self._wait(flight.pop(0))
            while flight:
                self._wait(flight.pop(0))
        except BaseException:
            MPI.Request.Waitall(flight)  # MPI may still write the buffer
            raise

    def allreduce(self, tensors: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``all_reduce``: every ``ReduceOp`` MPI can do, ``AVG`` included."""
        return self._allreduce("allreduce", _as_list(tensors), opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> MPIWork:
        """``all_reduce_coalesced`` and the coalescing manager's ``all_reduce``: one work for all tensors."""
        return self._allreduce("allreduce", _as_list(tensors), opts)

    def _allreduce(self, operation: str, tensors: list[Any], opts: Any) -> MPIWork:
        op = _reduction(dist.ReduceOp.SUM if opts is None else getattr(opts, "reduceOp", opts))
        error: BaseException | None = None
        hosts: list[_Host] = []
        rows = [self._head(operation, op)]
        try:
            for i, t in enumerate(tensors):
                _tensor(t, f"tensors[{i}]", "all_reduce")
                rows.append(_row(t))
                _check_reducible("all_reduce", t.dtype, op)
                hosts.append(_Host(t))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for h in hosts:
                self._reduce_host(h, op)
            for h in hosts:
                h.back()

        return self._submit(operation, tensors, error, rows, body)

    def reduce(self, tensors: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``reduce``: the root gets the reduction (other ranks' tensors are left as they were)."""
        tensors = _as_list(tensors)
        op = _reduction(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        root = int(getattr(opts, "rootRank", 0))
        error: BaseException | None = None
        hosts: list[_Host] = []
        rows = [self._head("reduce", op, root)]
        try:
            self._check_root("reduce", root)
            for i, t in enumerate(tensors):
                _tensor(t, f"tensors[{i}]", "reduce")
                rows.append(_row(t))
                _check_reducible("reduce", t.dtype, op)
                hosts.append(_Host(t))
        except (TypeError, ValueError) as exc:
            error = exc
        rank = self._comm.Get_rank()

        def body() -> None:
            for h in hosts:
                t = h.host
                if t.dtype in _HALVES or self._comm.Get_size() == 1:
                    scratch = _Host(t.clone()) if rank != root else h
                    self._reduce_host(scratch, op)
                    continue
                mpi_type = _MPI_TYPES[t.dtype]
                mpi_op = _BOOL_OPS[op] if t.dtype == torch.bool else _MPI_OPS[op]
                data, n = h.bytes(), t.numel()
                if rank == root:
                    self._wait(self._comm.Ireduce(MPI.IN_PLACE, [data, n, mpi_type], op=mpi_op, root=root))
                    if op == "AVG":
                        t.div_(self._comm.Get_size())
                else:
                    self._wait(self._comm.Ireduce([data, n, mpi_type], None, op=mpi_op, root=root))
            if rank == root:
                for h in hosts:
                    h.back()

        return self._submit("reduce", tensors, error, rows, body)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``reduce_scatter``: rank ``r`` gets the reduction of every rank's ``input_list[r]``."""
        outputs, lists = _as_list(outputs), [list(x) for x in inputs]
        op = _reduction(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        size = self._comm.Get_size()
        error: BaseException | None = None
        pairs: list[tuple[_Host, _Host]] = []
        rows = [self._head("reduce_scatter", op)]
        try:
            if len(lists) != len(outputs):
                raise ValueError(f"reduce_scatter: expected one input list per output, got {len(lists)} for "
                                 f"{len(outputs)}")
            for i, (out, parts) in enumerate(zip(outputs, lists, strict=True)):
                _tensor(out, f"output[{i}]", "reduce_scatter")
                rows.append(_row(out))
                _check_reducible("reduce_scatter", out.dtype, op)
                if len(parts) != size:
                    raise ValueError(f"reduce_scatter: input_list: expected {size} tensors (one per rank), got "
                                     f"{len(parts)}")
                for j, p in enumerate(parts):
                    _tensor(p, f"input_list[{j}]", "reduce_scatter")
                    if p.dtype != out.dtype or p.numel() != out.numel():
                        raise ValueError(f"reduce_scatter: input_list[{j}]: expected {out.numel()} elements of "
                                         f"{out.dtype} (the output's), got {p.numel()} of {p.dtype}")
                flat = torch.cat([p.detach().reshape(-1).cpu() for p in parts]) if parts else out.new_empty(0)
                pairs.append((_Host(out, read=False), _Host(flat)))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for out, flat in pairs:
                self._reduce_scatter_host(out, flat, op)
                out.back()

        return self._submit("reduce_scatter", outputs, error, rows, body)

    def _reduce_scatter_host(self, out: _Host, flat: _Host, op: str) -> None:
        """``out`` = this rank's block of the reduction of every rank's ``flat``."""
        n, size, rank = out.host.numel(), self._comm.Get_size(), self._comm.Get_rank()
        if n == 0:
            return
        t = flat.host
        if t.dtype in _HALVES or size == 1:
            scratch = _Host(t.clone()) if not flat.copied else flat
            self._reduce_host(scratch, op)
            out.host.reshape(-1).copy_(scratch.host.reshape(-1)[rank * n:(rank + 1) * n])
            return
        mpi_type = _MPI_TYPES[t.dtype]
        mpi_op = _BOOL_OPS[op] if t.dtype == torch.bool else _MPI_OPS[op]
        send = flat.bytes()
        if np.may_share_memory(send, out.bytes()):
            send = send.copy()
        self._wait(self._comm.Ireduce_scatter_block([send, n, mpi_type], [out.bytes(), n, mpi_type],
                                                    op=mpi_op))
        if op == "AVG":
            out.host.div_(size)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        """``reduce_scatter_tensor``: rank ``r`` gets block ``r`` of the reduction of every rank's ``input``."""
        return self._reduce_scatter_tensors([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """The coalesced ``reduce_scatter_tensor``: one work for all pairs."""
        return self._reduce_scatter_tensors(list(outputs), list(inputs), opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def _reduce_scatter_tensors(self, outputs: list[Any], inputs: list[Any], opts: Any) -> MPIWork:
        op = _reduction(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        size = self._comm.Get_size()
        error: BaseException | None = None
        pairs: list[tuple[_Host, _Host]] = []
        rows = [self._head("reduce_scatter_tensor", op)]
        try:
            if len(outputs) != len(inputs):
                raise ValueError(f"reduce_scatter_tensor: expected as many outputs as inputs, got {len(outputs)} "
                                 f"and {len(inputs)}")
            for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
                _tensor(out, f"output[{i}]", "reduce_scatter_tensor")
                _tensor(inp, f"input[{i}]", "reduce_scatter_tensor")
                rows.append(_row(inp))
                _check_reducible("reduce_scatter_tensor", inp.dtype, op)
                if out.dtype != inp.dtype or inp.numel() != size * out.numel():
                    raise ValueError(f"reduce_scatter_tensor: input[{i}]: expected {size} x {out.numel()} elements "
                                     f"of {out.dtype} (the output's, once per rank), got {inp.numel()} of {inp.dtype}")
                pairs.append((_Host(out, read=False), _Host(inp)))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for out, inp in pairs:
                self._reduce_scatter_host(out, inp, op)
                out.back()

        return self._submit("reduce_scatter_tensor", outputs, error, rows, body)

    # -- data movement --

    def broadcast(self, tensors: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``broadcast``: the root's tensor into every rank's."""
        tensors = _as_list(tensors)
        root = int(opts if isinstance(opts, int) else getattr(opts, "rootRank", 0))
        error: BaseException | None = None
        hosts: list[_Host] = []
        rows = [self._head("broadcast", root=root)]
        try:
            self._check_root("broadcast", root)
            for i, t in enumerate(tensors):
                rows.append(_row(_tensor(t, f"tensors[{i}]", "broadcast")))
                hosts.append(_Host(t, read=self._comm.Get_rank() == root))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for h in hosts:
                if h.host.numel() and self._comm.Get_size() > 1:
                    self._wait(self._comm.Ibcast(h.bytes(), root=root))
                h.back()

        return self._submit("broadcast", tensors, error, rows, body)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """``all_gather``: every rank's tensor into every rank's list."""
        return self._allgather_lists([list(o) for o in outputs], _as_list(inputs))

    allgather_coalesced = allgather  # type: ignore[assignment]

    def _allgather_lists(self, outputs: list[list[Any]], inputs: list[Any]) -> MPIWork:
        size = self._comm.Get_size()
        error: BaseException | None = None
        jobs: list[tuple[_Host, list[_Host]]] = []
        rows = [self._head("allgather")]
        try:
            if len(outputs) != len(inputs):
                raise ValueError(f"all_gather: expected one output list per input, got {len(outputs)} for "
                                 f"{len(inputs)}")
            for i, (outs, inp) in enumerate(zip(outputs, inputs, strict=True)):
                rows.append(_row(_tensor(inp, f"input[{i}]", "all_gather")))
                if len(outs) != size:
                    raise ValueError(f"all_gather: tensor_list: expected {size} tensors (one per rank), "
                                     f"got {len(outs)}")
                for j, o in enumerate(outs):
                    _tensor(o, f"tensor_list[{j}]", "all_gather")
                    if o.dtype != inp.dtype or o.numel() != inp.numel():
                        raise ValueError(f"all_gather: tensor_list[{j}]: expected {inp.numel()} elements of "
                                         f"{inp.dtype} (the input's), got {o.numel()} of {o.dtype}")
                jobs.append((_Host(inp), [_Host(o, read=False) for o in outs]))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for inp, outs in jobs:
                nbytes = inp.bytes().nbytes
                gathered = np.empty(size * nbytes, dtype=np.uint8)
                self._wait(self._comm.Iallgather(inp.bytes(), gathered))
                for r, o in enumerate(outs):
                    o.bytes()[:] = gathered[r * nbytes:(r + 1) * nbytes]
                    o.back()

        return self._submit("allgather", [o for outs in outputs for o in outs], error, rows, body)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        """``all_gather_into_tensor``: every rank's tensor, in rank order, into one tensor."""
        return self._allgather_tensors([output], [input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """The coalesced ``all_gather_into_tensor``: one work for all pairs."""
        return self._allgather_tensors(list(outputs), list(inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def _allgather_tensors(self, outputs: list[Any], inputs: list[Any]) -> MPIWork:
        size = self._comm.Get_size()
        error: BaseException | None = None
        pairs: list[tuple[_Host, _Host]] = []
        rows = [self._head("all_gather_into_tensor")]
        try:
            if len(outputs) != len(inputs):
                raise ValueError(f"all_gather_into_tensor: expected as many outputs as inputs, got {len(outputs)} "
                                 f"and {len(inputs)}")
            for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
                _tensor(out, f"output[{i}]", "all_gather_into_tensor")
                rows.append(_row(_tensor(inp, f"input[{i}]", "all_gather_into_tensor")))
                if out.dtype != inp.dtype or out.numel() != size * inp.numel():
                    raise ValueError(f"all_gather_into_tensor: output[{i}]: expected {size} x {inp.numel()} elements "
                                     f"of {inp.dtype} (the input's, once per rank), got {out.numel()} of {out.dtype}")
                pairs.append((_Host(out, read=False), _Host(inp)))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for out, inp in pairs:
                self._wait(self._comm.Iallgather(_apart(inp.bytes(), out.bytes(), self._comm.Get_rank()),
                                                 out.bytes()))
                out.back()

        return self._submit("all_gather_into_tensor", outputs, error, rows, body)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``gather``: every rank's tensor into the root's list."""
        lists, inputs = [list(o) for o in outputs], _as_list(inputs)
        root = int(getattr(opts, "rootRank", 0))
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        error: BaseException | None = None
        inp: _Host | None = None
        outs: list[_Host] = []
        rows = [self._head("gather", root=root)]
        try:
            self._check_root("gather", root)
            if len(inputs) != 1:
                raise ValueError(f"gather: expected one input tensor, got {len(inputs)}")
            t = _tensor(inputs[0], "tensor", "gather")
            rows.append(_row(t))
            if rank == root:
                if len(lists) != 1 or len(lists[0]) != size:
                    raise ValueError(f"gather: gather_list: expected {size} tensors (one per rank) at the root, got "
                                     f"{sum(len(x) for x in lists)}")
                for j, o in enumerate(lists[0]):
                    _tensor(o, f"gather_list[{j}]", "gather")
                    if o.dtype != t.dtype or o.numel() != t.numel():
                        raise ValueError(f"gather: gather_list[{j}]: expected {t.numel()} elements of {t.dtype}, "
                                         f"got {o.numel()} of {o.dtype}")
                outs = [_Host(o, read=False) for o in lists[0]]
            inp = _Host(t)
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert inp is not None
            data = inp.bytes()
            if rank == root:
                gathered = np.empty(size * data.nbytes, dtype=np.uint8)
                self._wait(self._comm.Igather(data, gathered, root=root))
                for r, o in enumerate(outs):
                    o.bytes()[:] = gathered[r * data.nbytes:(r + 1) * data.nbytes]
                    o.back()
            else:
                self._wait(self._comm.Igather(data, None, root=root))

        return self._submit("gather", [o for x in lists for o in x], error, rows, body)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``scatter``: the root's list, one tensor to each rank."""
        outputs, lists = _as_list(outputs), [list(x) for x in inputs]
        root = int(getattr(opts, "rootRank", 0))
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        error: BaseException | None = None
        out: _Host | None = None
        send: _Host | None = None
        rows = [self._head("scatter", root=root)]
        try:
            self._check_root("scatter", root)
            if len(outputs) != 1:
                raise ValueError(f"scatter: expected one output tensor, got {len(outputs)}")
            t = _tensor(outputs[0], "tensor", "scatter")
            rows.append(_row(t))
            if rank == root:
                if len(lists) != 1 or len(lists[0]) != size:
                    raise ValueError(f"scatter: scatter_list: expected {size} tensors (one per rank) at the root, got "
                                     f"{sum(len(x) for x in lists)}")
                for j, p in enumerate(lists[0]):
                    _tensor(p, f"scatter_list[{j}]", "scatter")
                    if p.dtype != t.dtype or p.numel() != t.numel():
                        raise ValueError(f"scatter: scatter_list[{j}]: expected {t.numel()} elements of {t.dtype}, "
                                         f"got {p.numel()} of {p.dtype}")
                send = _Host(torch.cat([p.detach().reshape(-1).cpu() for p in lists[0]]))
            out = _Host(t, read=False)
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert out is not None
            self._wait(self._comm.Iscatter(None if send is None else send.bytes(), out.bytes(), root=root))
            out.back()

        return self._submit("scatter", outputs, error, rows, body)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> MPIWork:
        """``all_to_all_single``: even splits, or uneven ones along dimension 0."""
        error: BaseException | None = None
        pair: tuple[_Host, _Host] | None = None
        counts: tuple[list[int], list[int]] = ([], [])
        rows = [self._head("all_to_all_single")]
        try:
            out = _tensor(output, "output", "all_to_all_single")
            inp = _tensor(input, "input", "all_to_all_single")
            rows.append(_row(inp, shape=False))
            if out.dtype != inp.dtype:
                raise ValueError(f"all_to_all_single: output: expected dtype {inp.dtype} (the input's), got "
                                 f"{out.dtype}")
            counts = (self._splits("input", inp, list(input_split_sizes)),
                      self._splits("output", out, list(output_split_sizes)))
            pair = (_Host(out, read=False), _Host(inp))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert pair is not None
            out, inp = pair
            send, recv = counts
            self._check_counts("all_to_all_single", send, recv)
            self._wait(self._comm.Ialltoallv([inp.bytes(), (send, _displacements(send)), MPI.BYTE],
                                             [out.bytes(), (recv, _displacements(recv)), MPI.BYTE]))
            out.back()

        return self._submit("all_to_all_single", [output], error, rows, body)

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def _splits(self, what: str, t: torch.Tensor, splits: list[int]) -> list[int]:
        """Bytes to or from each rank: ``splits`` rows of dimension 0 (even: none given)."""
        size = self._comm.Get_size()
        rows = t.shape[0] if t.dim() else 1
        row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
        if not splits:
            if rows % size:
                raise ValueError(f"all_to_all_single: {what}: {rows} rows cannot be split evenly over {size} ranks; "
                                 f"pass {what}_split_sizes")
            return [rows // size * row_bytes] * size
        if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: {what}_split_sizes: expected {size} sizes >= 0 that sum to "
                             f"{rows} (the {what}'s first dimension), got {splits}")
        return [int(s) * row_bytes for s in splits]

    def _check_counts(self, operation: str, send: list[int], recv: list[int]) -> None:
        """When validating: what each rank sends this one must be what it expects (else all raise)."""
        if not self._validate or self._comm.Get_size() == 1:
            return
        told = np.empty(self._comm.Get_size(), dtype=np.int64)
        self._wait(self._comm.Ialltoall(np.asarray(send, dtype=np.int64), told))
        error = None
        bad = [r for r in range(len(recv)) if told[r] != recv[r]]
        if bad:
            r = bad[0]
            error = ValueError(f"{operation}: rank {r} sends {int(told[r])} bytes to rank {self._comm.Get_rank()}, "
                               f"which expects {recv[r]}; make the split sizes agree")
        agreement.raise_if_any(self._comm, error)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """``all_to_all``: ``input_list[r]`` to rank ``r``, rank ``r``'s into ``output_list[r]`` (any sizes)."""
        outputs, inputs = list(outputs), list(inputs)
        size = self._comm.Get_size()
        error: BaseException | None = None
        outs: list[_Host] = []
        send: _Host | None = None
        counts: tuple[list[int], list[int]] = ([], [])
        rows = [self._head("all_to_all")]
        try:
            if len(outputs) != size or len(inputs) != size:
                raise ValueError(f"all_to_all: expected {size} output and {size} input tensors (one per rank), got "
                                 f"{len(outputs)} and {len(inputs)}")
            for j, (o, i) in enumerate(zip(outputs, inputs, strict=True)):
                _tensor(o, f"output_tensor_list[{j}]", "all_to_all")
                _tensor(i, f"input_tensor_list[{j}]", "all_to_all")
                if o.dtype != inputs[0].dtype or i.dtype != inputs[0].dtype:
                    raise ValueError(f"all_to_all: expected every tensor of dtype {inputs[0].dtype}, got {o.dtype} "
                                     f"and {i.dtype} at [{j}]")
            rows.append(_row(inputs[0], shape=False) if inputs else (0,))
            counts = ([i.numel() * i.element_size() for i in inputs], [o.numel() * o.element_size() for o in outputs])
            send = _Host(torch.cat([i.detach().reshape(-1).cpu() for i in inputs]))
            outs = [_Host(o, read=False) for o in outputs]
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert send is not None
            sent, expected = counts
            self._check_counts("all_to_all", sent, expected)
            recv = np.empty(sum(expected), dtype=np.uint8)
            places = _displacements(expected)
            self._wait(self._comm.Ialltoallv([send.bytes(), (sent, _displacements(sent)), MPI.BYTE],
                                             [recv, (expected, places), MPI.BYTE]))
            for o, start, n in zip(outs, places, expected, strict=True):
                o.bytes()[:] = recv[start:start + n]
                o.back()

        return self._submit("all_to_all", outputs, error, rows, body)

    def barrier(self, opts: Any = None) -> MPIWork:
        """``barrier``: completes when every rank of the group has called it."""
        return self._submit("barrier", [], None, [self._head("barrier")],
                            lambda: self._wait(self._comm.Ibarrier()))

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that raises ``RuntimeError`` when it does not complete within ``timeout``.

        (torch's ``dist.monitored_barrier`` accepts only gloo groups: call it on the group
        itself. The package's watchdog names the missing ranks of any collective that stalls.)
        """
        self.barrier().wait(timeout)

    # -- point to point --

    def send(self, tensors: Any, dst: int, tag: int = 0) -> MPIWork:
        """``send``/``isend``: posted at once; the work completes when MPI is done with the tensor."""
        tensors = _as_list(tensors)
        self._check_peer("send", "dst", dst, tag, len(tensors))
        h = _Host(_tensor(tensors[0], "tensor", "send"))
        request = self._p2p.Isend(h.bytes(), dest=dst, tag=tag)
        work = MPIWork("send", tensors, self._p2p_engine)
        return self._p2p_engine.submit(work, lambda: self._p2p_engine.polling.wait(request))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> MPIWork:
        """``recv``/``irecv`` from rank ``src``."""
        tensors = _as_list(tensors)
        self._check_peer("recv", "src", src, tag, len(tensors))
        return self._receive(tensors, src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> MPIWork:
        """``recv`` from any rank (``src=None``); the work's ``_source_rank()`` says which."""
        tensors = _as_list(tensors)
        self._check_peer("recv", "src", 0, tag, len(tensors))
        return self._receive(tensors, MPI.ANY_SOURCE, tag)

    def _receive(self, tensors: list[torch.Tensor], src: int, tag: int) -> MPIWork:
        h = _Host(_tensor(tensors[0], "tensor", "recv"), read=False)
        request = self._p2p.Irecv(h.bytes(), source=src, tag=tag)
        work = MPIWork("recv", tensors, self._p2p_engine)

        def job() -> None:
            status = MPI.Status()
            request.Wait(status)
            count = status.Get_count(MPI.BYTE)
            if count != h.host.numel() * h.host.element_size():
                raise ValueError(f"recv: rank {status.Get_source()} sent {count} bytes, but the tensor holds "
                                 f"{h.host.numel() * h.host.element_size()}")
            work._source = status.Get_source()
            h.back()

        return self._p2p_engine.submit(work, job)

    def _check_peer(self, operation: str, what: str, peer: int, tag: int, count: int) -> None:
        if count != 1:
            raise ValueError(f"{operation}: expected one tensor, got {count}")
        if not 0 <= peer < self._comm.Get_size():
            raise ValueError(f"{operation}: {what}: expected a rank in [0, {self._comm.Get_size() - 1}], got {peer}")
        top = self._p2p.Get_attr(MPI.TAG_UB)
        if not 0 <= tag <= (top if isinstance(top, int) else 32767):
            raise ValueError(f"{operation}: tag: expected 0 <= tag <= {top}, got {tag}")

    # -- life --

    @property
    def mpi_error(self) -> MPI.Exception | None:
        """The last MPI error a call of this group raised (a lost rank, a revoked communicator), or None."""
        return self._engine.mpi_error or self._p2p_engine.mpi_error

    def communicators(self) -> Iterator[MPI.Comm]:
        """The group's own communicators: those a failure must revoke (:class:`ElasticGroup`)."""
        yield from (self._comm, self._spawner, self._p2p)

    def shutdown(self) -> None:
        """Finish the queued calls, stop the threads and the watchdog, free the communicators (local).

        After a lost rank, once :mod:`mpi_gradreducer.elastic` has revoked the
        communicators, the queued calls fail at once, and Open MPI with ULFM
        frees a revoked communicator without its peers.
        """
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        self._p2p_engine.close(wait=0.0 if self.mpi_error is not None else None)
        self._watchdog.close()
        for summer in self._halves.values():
            summer.compression.free()
        for comm in (self._p2p, self._spawner, self._comm):
            try:
                comm.Free()
            except MPI.Exception:
                if self.mpi_error is None:
                    raise

    def abort(self) -> None:
        """As :meth:`shutdown` (MPI cannot cancel a collective in flight)."""
        self.shutdown()


class ElasticGroup:
    """``torch.distributed``'s default group of this backend, made again over each new communicator of
    :mod:`mpi_gradreducer.elastic` (Open MPI with ULFM: ``mpiexec --with-ft ulfm``)::

        state = elastic.ArrayState([p.detach().numpy() for p in model.parameters()], step=0)
        group = ElasticGroup(state)          # makes the default group over state.comm, tracked by its world
        state.register_reset_callbacks([make_ddp])  # DDP made again over the new group

        @elastic.run(failure=group.failed)
        def train(state): ...

    Construction is collective over ``state.comm``. Only the default group is
    made again; groups made with ``new_group`` must be made again by a reset
    callback.

    Args:
        state: the elastic state whose world's communicator the group follows.
        options: the group's options (see :class:`MPIProcessGroup`).
        timeout: torch's timeout for the group.
    """

    def __init__(self, state: Any, options: Options | None = None,
                 timeout: datetime.timedelta | None = None) -> None:
        self.options, self.timeout = options, timeout
        init_process_group(state.comm, options, timeout)
        state.world.track(self)

    def communicators(self) -> Iterator[MPI.Comm]:
        """The default group's communicators (revoked by the world after a lost rank)."""
        pg = dist.group.WORLD if dist.is_initialized() else None
        if isinstance(pg, MPIProcessGroup):
            yield from pg.communicators()

    def rebuild(self, comm: MPI.Intracomm) -> None:
        """Drop the default group (no collective) and make it again over ``comm`` (collective)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        init_process_group(comm, self.options, self.timeout)

    @staticmethod
    def failed(exc: BaseException) -> bool:
        """For ``elastic.run(failure=...)``: whether the default group's calls met an MPI error.

        DDP hands the backend's errors on as ``RuntimeError`` with their text
        only; the group keeps the MPI error itself.
        """
        pg = dist.group.WORLD if dist.is_initialized() else None
        return isinstance(pg, MPIProcessGroup) and pg.mpi_error is not None


def _displacements(counts: Sequence[int]) -> list[int]:
    places, at = [], 0
    for c in counts:
        places.append(at)
        at += c
    return places


def _apart(send: np.ndarray, recv: np.ndarray, rank: int) -> Any:
    """``send`` for a gather into ``recv``: ``MPI.IN_PLACE`` where it is this rank's block of ``recv``
    (FSDP2 gathers so), a copy where it overlaps ``recv`` otherwise (MPI forbids aliased buffers)."""
    if not np.may_share_memory(send, recv):
        return send
    start = send.__array_interface__["data"][0] - recv.__array_interface__["data"][0]
    if start == rank * send.nbytes:
        return MPI.IN_PLACE
    return send.copy()


def _env_has(name: str) -> bool:
    return name in os.environ
