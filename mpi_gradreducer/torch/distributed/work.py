"""The backend's ``Work`` and the communication thread that completes it."""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..._core.polling import Polling
from .basics import BACKEND

#: The point-to-point thread's nap between tests of a posted request while no caller waits in
#: :meth:`MPIWork.wait` (a ``recv`` may wait long for its sender: tests without naps would take a core all that
#: time). The collectives' thread naps not at all: it waits in MPI's own wait, since DDP waits on the future in
#: C++, unseen, and a reduction progressed only by tests between naps took DDP 1.4-1.8x the time of the package's
#: ``DistributedOptimizer`` (``python -m mpi_gradreducer.bench.torch_ddp``; the runs: CHANGELOG, 0.8.0).
NAP_SECONDS = 50e-6


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
    """One thread that runs a process group's jobs in the order they were queued.

    Args:
        name: the thread's name.
        naps: its waits test with naps (:data:`NAP_SECONDS`) while no caller waits in :meth:`MPIWork.wait`;
            False: always MPI's own wait.
    """

    def __init__(self, name: str, naps: bool = True) -> None:
        self.polling = Polling(NAP_SECONDS)
        self.polling.computing(naps)
        self._naps = naps
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
            self.polling.computing(self._naps and self._waiters == 0)

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
