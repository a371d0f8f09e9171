"""Reductions in flight: per-gradient readiness, in-order launch, a communication thread, begin/wait."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from .paths import runs

if TYPE_CHECKING:
    from .call import Call
    from .fusion import FusionPlan
    from .polling import Polling

__all__ = ["CommThread", "Overlap", "ReductionStep"]


class CommThread:
    """A daemon thread that runs submitted jobs one after the other, in order.

    MPI calls made from it release the GIL, so communication proceeds while the
    training thread computes. The thread starts on the first submission and is
    stopped by :meth:`close`, or at interpreter exit, before MPI is finalized.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the thread after the jobs submitted before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="mpi_gradreducer-comm", daemon=True)
            self._thread.start()
            self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread)
        self._jobs.put(job)

    def close(self) -> None:
        """Finish the submitted jobs and stop the thread."""
        if self._finalizer is not None:
            self._finalizer()
        self._thread = self._finalizer = None


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()


def _stop(jobs: queue.SimpleQueue[Callable[[], None] | None], thread: threading.Thread) -> None:
    jobs.put(None)
    thread.join()


class ReductionStep:
    """One reduction in flight, returned by ``begin()`` and ``reduce_async()``.

    Buckets are launched strictly in plan order, each as soon as all of its
    members and all earlier buckets are ready, so that every rank issues the
    same collectives in the same order whatever order ``ready`` is called in.

    Args:
        grads: the gradients being reduced.
        bucket_of: for each gradient index, its bucket, or -1 if it is in none.
        members: the number of members of each bucket.
        launch: starts the given buckets (in order).
        complete: called by :meth:`wait` to finish the step; returns ``grads``.
    """

    def __init__(
        self,
        grads: Sequence[Any],
        bucket_of: Sequence[int],
        members: Sequence[int],
        launch: Callable[[ReductionStep, list[int]], None],
        complete: Callable[[ReductionStep], Sequence[Any]],
    ) -> None:
        self.grads = grads
        self._bucket_of = bucket_of
        self._missing = list(members)
        self._is_ready = [False] * len(bucket_of)
        self._launch = launch
        self._complete = complete
        self._next = 0
        self._finished = 0
        self._errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._result: Sequence[Any] | None = None
        #: True once ``wait()`` has finished (or failed): the reducer takes the next call.
        self.closed = False

    def ready(self, index: int) -> None:
        """Declare ``grads[index]`` final; launches every bucket that became ready.

        Raises:
            IndexError: ``index`` is not a gradient index.
            ValueError: ``index`` was already declared ready.
        """
        if not 0 <= index < len(self._is_ready):
            raise IndexError(f"ready({index}): expected a gradient index in [0, {len(self._is_ready) - 1}]")
        if self._is_ready[index]:
            raise ValueError(f"ready({index}) was already called in this step; call it once per gradient")
        self._is_ready[index] = True
        k = self._bucket_of[index]
        if k >= 0:
            self._missing[k] -= 1
            if k == self._next:
                self._launch_ready()

    def not_ready(self) -> list[int]:
        """Indices not yet declared ready."""
        return [i for i, r in enumerate(self._is_ready) if not r]

    def mark_all_ready(self) -> None:
        """Declare every remaining gradient ready."""
        for i in self.not_ready():
            self.ready(i)

    def done(self) -> bool:
        """True when every bucket has been reduced (``wait`` will not block on MPI)."""
        with self._cond:
            return self._finished == len(self._missing)

    def wait(self) -> Sequence[Any]:
        """Finish the reduction and return the gradients, reduced in place.

        Raises:
            RuntimeError: on every rank, when some rank called ``wait`` before
                declaring all of its gradients ready (the reduction is still
                completed with the values they held, so that no rank hangs).
        """
        if self._result is None:
            self._result = self._complete(self)
        return self._result

    def join(self) -> None:
        """Block until every launched bucket has finished; re-raise a bucket's error."""
        with self._cond:
            while self._finished < self._next:
                self._cond.wait()
        if self._errors:
            raise self._errors[0]

    def bucket_finished(self, error: BaseException | None = None) -> None:
        """Called once per bucket by whoever reduced it."""
        with self._cond:
            self._finished += 1
            if error is not None:
                self._errors.append(error)
            self._cond.notify_all()

    def _launch_ready(self) -> None:
        batch = []
        while self._next < len(self._missing) and self._missing[self._next] == 0:
            batch.append(self._next)
            self._next += 1
        if batch:
            self._launch(self, batch)


class Overlap:
    """``begin()`` and ``wait()`` of one reducer: batches on a communication thread, or all in ``wait()``.

    Construction is collective (a duplicate of ``comm`` carries ``wait()``'s
    readiness check, apart from the data).

    Args:
        comm: the reducer's communicator.
        polling: reduce launched buckets on a communication thread
            (``progress="thread"``), whose waits it is told when the training
            thread computes; None: in ``wait()``.
    """

    def __init__(self, comm: MPI.Intracomm, polling: Polling | None) -> None:
        self._control = comm.Dup()
        self._size = comm.Get_size()
        self._use_thread = polling is not None
        self._polling = polling
        self._thread: CommThread | None = None
        self._deferred: list[int] = []  # buckets launched but not yet reduced ("deferred" progress)

    def begin(self, call: Call, plan: FusionPlan, paths: Sequence[Any], sparse: Any,
              finish: Callable[[Call], None]) -> ReductionStep:
        """The step of ``call``: buckets launch in plan order as their gradients become ready.

        Args:
            call: the call, validated.
            plan: the reducer's plan.
            paths: the path of each bucket.
            sparse: the RowSparse path, run in ``wait()``.
            finish: called with ``call`` when ``wait()`` succeeds.
        """
        if self._use_thread and self._thread is None:
            self._thread = CommThread()
        call.on_thread = self._thread is not None
        self._training(busy=True)
        return ReductionStep(
            call.caller, plan.bucket_of, [len(b.indices) for b in plan.buckets],
            lambda step, batch: self._launch(call, paths, step, batch),
            lambda step: self._complete(call, paths, sparse, finish, step),
        )

    def agree_on_readiness(self, missing: Sequence[int]) -> np.ndarray:
        """How many gradients each rank had not declared ready at ``wait()`` (collective)."""
        counts = np.array([len(missing)], dtype=np.int64)
        if self._size > 1:
            counts = np.zeros(self._size, dtype=np.int64)
            self._control.Allgather(np.array([len(missing)], dtype=np.int64), counts)
        return counts

    def _training(self, busy: bool) -> None:
        """Tell the thread's waits whether the training thread computes (see :class:`.Polling`)."""
        if self._polling is not None:
            self._polling.computing(busy)

    def communicators(self) -> list[MPI.Intracomm]:
        """The control communicator, until closed."""
        return [] if self._control == MPI.COMM_NULL else [self._control]

    def close(self) -> None:
        """Stop the thread and free the control communicator (collective). Idempotent."""
        self._training(busy=False)
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        if self._control != MPI.COMM_NULL:
            self._control.Free()

    def _launch(self, call: Call, paths: Sequence[Any], step: ReductionStep, batch: list[int]) -> None:
        """Buckets ``batch`` became ready: reduce them on the thread, or keep them for ``wait()``."""
        if self._thread is None:
            self._deferred.extend(batch)
            return
        launched = [(path, path.before_launch()) for path in {id(paths[k]): paths[k] for k in batch}.values()]
        self._thread.submit(lambda: self._run_batch(call, paths, step, batch, launched))

    @staticmethod
    def _run_batch(call: Call, paths: Sequence[Any], step: ReductionStep, batch: list[int],
                   launched: Sequence[tuple[Any, Any]] = ()) -> None:
        error: BaseException | None = None
        try:
            for path, token in launched:
                path.launched = token
            for path, ks in runs(paths, batch):
                path.reduce(ks, call)
        except BaseException as exc:  # reported by wait()
            error = exc
        for _ in batch:
            step.bucket_finished(error)

    def _complete(self, call: Call, paths: Sequence[Any], sparse: Any, finish: Callable[[Call], None],
                  step: ReductionStep) -> Sequence[Any]:
        """``wait()``: agree on readiness, reduce what is left, report a rank that was not ready."""
        self._training(busy=False)  # it waits for the reduction now: the thread polls at full speed
        missing = step.not_ready()
        counts = self.agree_on_readiness(missing)
        if counts.any():
            step.mark_all_ready()  # every rank still issues every collective: no one hangs
        try:
            if self._deferred:
                batch, self._deferred = self._deferred, []
                self._run_batch(call, paths, step, batch)
            step.join()
            for path in {id(p): p for p in paths}.values():
                path.after_wait()
            if not counts.any():
                sparse.reduce(call)
        finally:
            step.closed = True
        if counts.any():
            ranks = ", ".join(f"rank {r} ({c})" for r, c in enumerate(counts) if c)
            raise RuntimeError(
                f"wait() was called before ready() for every gradient on {ranks}"
                + (f"; here: grads{missing[:8]}" if missing else "")
                + ". The buckets were reduced anyway, with the values those gradients held at wait(), "
                "so that no rank hangs; call ready(i) for every gradient before wait()"
            )
        finish(call)
        return call.caller
