"""The background engine of ``mpi_gradreducer.horovod``: every collective is submitted to it and completes there.

One daemon thread per process (started by ``hvd.init()``, stopped by
``hvd.shutdown()`` or at exit) owns two duplicates of each process set's
communicator: one for the negotiation (small pickled messages: each rank's
:class:`~.negotiation.Request` to the set's first rank, its
:class:`~.negotiation.Response` to every rank), one for the data. A call
returns a :class:`Handle` at once; the engine sends the request, the
coordinator answers when every rank of the set has asked (or is in
``join()``), and every rank then runs the agreed operation's nonblocking
MPI calls (:mod:`.execute`), one operation at a time per process set, in
the coordinator's order. ``poll`` is False until they have completed.

The thread sleeps while this rank has nothing in flight; otherwise it tests
its messages and requests, napping between rounds that found nothing to do
(:data:`NAP_SECONDS`, shorter while the caller waits for a handle).
Blocking MPI calls would poll at full speed and starve ranks that share cores.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from mpi4py import MPI

from .exceptions import internal_error_of
from .execute import Execution, Local, build
from .negotiation import Coordinator, Request, Response

__all__ = ["Engine", "Handle", "Op", "NAP_SECONDS", "WAIT_NAP_SECONDS"]

#: The engine's nap between rounds that found nothing to do, while the caller computes.
NAP_SECONDS = 0.5e-3
#: The nap while the caller waits for a handle.
WAIT_NAP_SECONDS = 0.1e-3
_REQUESTS, _RESPONSES = 1, 2
_UNNAMED = "noname."


class Handle:
    """An operation in flight: :meth:`poll` says whether it has completed, :meth:`wait` returns its result.

    The result is made on the caller's thread, by the ``finish`` function
    the operation was submitted with, from what the engine received.
    """

    def __init__(self, finish: Callable[[Response, list[Any]], Any]) -> None:
        self._finish = finish
        self._done = threading.Event()
        self._response: Response | None = None
        self._outputs: list[Any] = []
        self._error: BaseException | None = None
        self._result: Any = None
        self._finished = False

    def poll(self) -> bool:
        """True once the operation has completed (then :meth:`wait` does not block)."""
        return self._done.is_set()

    def _complete(self, response: Response | None, outputs: list[Any], error: BaseException | None = None) -> None:
        self._response, self._outputs, self._error = response, outputs, error
        self._done.set()

    def wait(self, engine: Engine | None = None) -> Any:
        """Block until the operation has completed; its result (raises its error).

        Raises:
            Exception: the operation's error (the same on every rank that submitted it).
        """
        if not self._done.is_set():
            if engine is not None:
                engine.waiting(+1)
            try:
                self._done.wait()
            finally:
                if engine is not None:
                    engine.waiting(-1)
        if self._error is not None:
            raise self._error
        if not self._finished:
            assert self._response is not None
            self._result = self._finish(self._response, self._outputs)
            self._finished = True
            self._outputs = []
        return self._result


@dataclasses.dataclass
class Op:
    """One submitted operation: its request, this rank's arrays, its handle, and how its error is raised."""

    set_id: int
    request: Request
    local: Local | None
    handle: Handle
    error_of: Callable[[Response], BaseException]
    submitted: float = 0.0
    agreed: float = 0.0


class _Set:
    """The engine's side of one process set."""

    def __init__(self, set_id: int, ranks: tuple[int, ...], comm: MPI.Intracomm) -> None:
        self.id, self.ranks = set_id, ranks
        self.ctl, self.data = comm.Dup(), comm.Dup()
        self.me = comm.Get_rank()
        self.coordinator = Coordinator(comm.Get_size(), ranks) if self.me == 0 else None
        self.pending: dict[str, Op] = {}
        self.outbox: list[Request] = []
        self.queue: deque[Response] = deque()
        self.current: tuple[Execution, Response, Op | None] | None = None
        self.removed = False

    def busy(self) -> bool:
        return bool(self.pending or self.outbox or self.queue or self.current)

    def free(self) -> None:
        for c in (self.ctl, self.data):
            if c != MPI.COMM_NULL:
                c.Free()


class Engine:
    """The thread that negotiates and moves the data of every operation of this process.

    Args:
        rank: this process's global rank (for messages).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epoch = 0  # global join() calls seen complete
        self._cond = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._sets: dict[int, _Set] = {}
        self._sends: list[MPI.Request] = []
        self._in_flight: dict[int, set[str]] = {}
        self._unnamed: dict[int, int] = {}  # per process set: unnamed operations so far (their keys' counts)
        self._waiting = 0
        self._stop = False
        self._timeline: Any = None
        self._mark_cycles = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mpi_gradreducer-horovod", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------------

    def add_set(self, set_id: int, ranks: tuple[int, ...], comm: MPI.Intracomm) -> None:
        """Serve a process set from now on (``comm``: its ranks; duplicated here, collectively over them)."""
        s = _Set(set_id, ranks, comm)
        with self._cond:
            self._in_flight[set_id] = set()
        self._post(lambda: self._sets.__setitem__(set_id, s))

    def remove_set(self, set_id: int) -> None:
        """Stop serving a process set: its operations still in flight fail; its communicators are freed."""
        self._post(lambda: self._remove(set_id))

    def reserve(self, set_id: int, key: str | None) -> str | None:
        """Mark ``key`` in flight in the set (None: the next unnamed key); the key, or None for a duplicate name.

        Unnamed operations match by their count: a rank in ``join()``
        counts the unnamed operations it takes part in (or refuses) too, so
        that the counts agree again once every rank has joined.
        """
        with self._cond:
            if key is None:
                count = self._unnamed.get(set_id, 0)
                self._unnamed[set_id] = count + 1
                key = f"{_UNNAMED}{count}"
            keys = self._in_flight.setdefault(set_id, set())
            if key in keys:
                return None
            keys.add(key)
            return key

    def submit(self, op: Op) -> Handle:
        """Hand ``op`` to the engine (its key reserved with :meth:`reserve`); its handle."""
        op.submitted = time.perf_counter()
        self._post(lambda: self._accept(op))
        return op.handle

    def waiting(self, delta: int) -> None:
        """The caller starts (+1) or stops (-1) waiting for a handle: the engine naps shorter meanwhile."""
        with self._cond:
            self._waiting += delta

    def timeline(self, timeline: Any, mark_cycles: bool = False) -> Any:
        """Record into ``timeline`` from now on (None: stop); the timeline recorded into before."""
        with self._cond:
            before, self._timeline, self._mark_cycles = self._timeline, timeline, mark_cycles
            return before

    def close(self, limit: float = 30.0) -> None:
        """Stop the thread once nothing is in flight (at most ``limit`` seconds); what is left then fails."""
        deadline = time.monotonic() + limit
        with self._cond:
            while any(self._in_flight.values()) and self._thread.is_alive() and time.monotonic() < deadline:
                self._cond.wait(0.01)
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._fail_all(RuntimeError("hvd.shutdown() (or the end of the process) came before this operation "
                                    "completed: some rank of its process set never made the call"))

    def communicators(self) -> Iterator[MPI.Intracomm]:
        """Every communicator of the engine (two per process set): what a lost rank's recovery revokes."""
        for s in self._sets.values():
            yield from (s.ctl, s.data)

    def free(self) -> None:
        """Free every process set's communicators (after :meth:`close`)."""
        for s in self._sets.values():
            s.free()
        self._sets.clear()

    def _post(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._failure is not None:
                raise self._failed() from self._failure
            if self._stop:
                raise RuntimeError("mpi_gradreducer.horovod was shut down; call hvd.init() again")
            self._inbox.append(job)
            self._cond.notify_all()

    # -- the engine's thread ----------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._inbox or self._sends or any(s.busy() for s in self._sets.values()))

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._busy():
                        self._cond.wait()
                    if self._stop:
                        MPI.Request.Waitall(self._sends)  # small messages: sent eagerly, complete at once
                        return
                    jobs, self._inbox = self._inbox, []
                    nap = WAIT_NAP_SECONDS if self._waiting else NAP_SECONDS
                for job in jobs:
                    job()
                if not self._progress() and not jobs:
                    time.sleep(nap)
        except BaseException as exc:  # never leave a caller waiting: every handle in flight fails with it
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
            self._fail_all(self._failed())

    def _failed(self) -> BaseException:
        """The error of every operation after the thread failed: Horovod's internal error for a lost rank (what
        ``hvd.elastic.run`` recovers from), else a ``RuntimeError`` naming the failure."""
        assert self._failure is not None
        return internal_error_of(self._failure) or RuntimeError(
            f"the engine of mpi_gradreducer.horovod failed: {self._failure!r}")

    def _fail_all(self, error: BaseException) -> None:
        for s in self._sets.values():
            for op in list(s.pending.values()):
                op.handle._complete(None, [], error)
            if s.current is not None and s.current[2] is not None:
                s.current[2].handle._complete(None, [], error)
            s.pending.clear()
            s.current = None

    def _accept(self, op: Op) -> None:
        s = self._sets.get(op.set_id)
        if s is None or s.removed:
            self._done(op, None, [], ValueError(f"process set {op.set_id} was removed"))
            return
        request = dataclasses.replace(op.request, epoch=self.epoch)
        if request.kind == "join":
            for other in self._sets.values():
                if not other.removed and other.id != s.id:
                    other.outbox.append(request)
        s.pending[request.key] = op
        s.outbox.append(request)

    def _remove(self, set_id: int) -> None:
        s = self._sets.pop(set_id, None)
        if s is None:
            return
        s.removed = True
        for op in list(s.pending.values()):
            self._done(op, None, [], ValueError(f"process set {set_id} was removed before this operation completed"))
        s.pending.clear()
        if s.current is not None:
            s.current[0].wait()
        s.free()

    def _progress(self) -> bool:
        did = False
        for s in list(self._sets.values()):
            did = self._flush(s) or did
            if s.coordinator is not None:
                did = self._coordinate(s) or did
            else:
                did = self._receive(s) or did
            did = self._execute(s) or did
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]
        if did and self._mark_cycles:
            self._record("CYCLE_START", time.perf_counter(), time.perf_counter())
        return did

    def _flush(self, s: _Set) -> bool:
        if not s.outbox:
            return False
        requests, s.outbox = s.outbox, []
        if s.coordinator is not None:
            self._deliver(s, s.coordinator.receive(0, requests))
        else:
            self._sends.append(s.ctl.isend(requests, dest=0, tag=_REQUESTS))
        return True

    def _coordinate(self, s: _Set) -> bool:
        assert s.coordinator is not None
        did = False
        status = MPI.Status()
        while True:
            message = s.ctl.improbe(source=MPI.ANY_SOURCE, tag=_REQUESTS, status=status)
            if message is None:
                return did
            requests = message.recv()
            self._deliver(s, s.coordinator.receive(status.Get_source(), requests))
            did = True

    def _deliver(self, s: _Set, responses: list[Response]) -> None:
        if not responses:
            return
        for r in range(1, len(s.ranks)):
            self._sends.append(s.ctl.isend(responses, dest=r, tag=_RESPONSES))
        s.queue.extend(responses)

    def _receive(self, s: _Set) -> bool:
        did = False
        while True:
            message = s.ctl.improbe(source=0, tag=_RESPONSES)
            if message is None:
                return did
            s.queue.extend(message.recv())
            did = True

    def _execute(self, s: _Set) -> bool:
        did = False
        while True:
            if s.current is None:
                if not s.queue:
                    return did
                response = s.queue.popleft()
                did = True
                op = s.pending.pop(response.key, None)
                if op is not None:
                    op.agreed = time.perf_counter()
                if response.kind == "join":
                    if op is not None:  # the global set: every rank has joined
                        self.epoch += 1
                        self._done(op, response, [s.ranks[response.last]])
                    continue
                if op is None and response.key.startswith(_UNNAMED):  # from join(): count it as the others do
                    with self._cond:
                        count = int(response.key[len(_UNNAMED):]) + 1
                        self._unnamed[s.id] = max(self._unnamed.get(s.id, 0), count)
                if response.error is not None:
                    if op is not None:
                        self._done(op, response, [], op.error_of(response))
                    continue
                if op is None and s.me not in response.joined:
                    continue
                ref = response.reference()
                try:
                    root = s.ranks.index(ref.root) if ref.root >= 0 else -1
                    s.current = (build(s.data, response, op.local if op is not None else None, root), response, op)
                except Exception as exc:  # a local failure (memory): this rank's caller hears of it
                    if op is not None:
                        self._done(op, response, [], exc)
                    continue
            execution, response, op = s.current
            if not execution.test():
                return did
            s.current = None
            did = True
            if op is not None:
                self._done(op, response, execution.outputs)

    def _done(self, op: Op, response: Response | None, outputs: list[Any], error: BaseException | None = None) -> None:
        with self._cond:
            self._in_flight.get(op.set_id, set()).discard(op.request.key)
            self._cond.notify_all()
        end = time.perf_counter()
        if op.agreed:
            kind = op.request.kind.upper()
            name = f"{op.request.kind}.{op.request.key}"
            since_epoch = round((time.time() - (end - op.submitted)) * 1e6)  # the call, on the wall clock
            self._record(f"NEGOTIATE_{kind}", op.submitted, op.agreed, tensor=name,
                         start_time_since_epoch_in_micros=since_epoch)
            self._record(kind, op.agreed, end, tensor=name, error=str(error) if error is not None else "")
        op.handle._complete(response, outputs, error)

    def _record(self, name: str, start: float, end: float, **args: Any) -> None:
        with self._cond:
            if self._timeline is not None:
                self._timeline.record(name, start, end, **args)
