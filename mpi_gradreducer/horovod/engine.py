"""The background engine of ``mpi_gradreducer.horovod``: every collective is submitted to it and completes there.

One daemon thread per process (started by ``hvd.init()``, stopped by
``hvd.shutdown()`` or at exit) owns two duplicates of each process set's
communicator: one for the negotiation (small pickled messages), one for the
data. A call returns a :class:`Handle` at once. The engine works in cycles,
as Horovod's does: it collects the requests submitted during
``HOROVOD_CYCLE_TIME`` (or until the caller waits for a handle), sends them
in one message per rank to the set's first rank, whose
:class:`~.negotiation.Coordinator` answers, once every rank of the set has
asked for a key (or is in ``join()``), with one list of verdicts to every
rank, in one order (a plain verdict travels as its key alone:
:func:`~.negotiation.compact`). Every rank then carries out that list in
order, one operation at a time per process set: consecutive allreduce
verdicts of one list with the same operation and scaling are one fused
execution (:func:`~.execute.fused`, Tensor Fusion through the package's
summers), the other kinds nonblocking MPI calls (:mod:`.execute`). ``poll``
is False until an operation has completed.

The thread sleeps while this rank has nothing in flight; otherwise it tests
its messages and requests, napping between rounds that found nothing to do
(:data:`NAP_SECONDS`, shorter while the caller waits for a handle). Fused
reductions make blocking calls whose waits go through the core's
:class:`~mpi_gradreducer._core.polling.Polling` (naps while the caller
computes); they run on the engine's thread while this rank serves one
process set, on a thread of their set otherwise, so that process sets never
wait for each other.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core import polling
from .._core.summers import Summers
from .._core.topology import Topology
from .._core.transport import Gather
from .._core.watchdog import Watchdog
from .exceptions import HorovodInternalError, internal_error_of
from .execute import Blocking, Execution, Local, build, fused, fused_bytes
from .negotiation import Coordinator, Request, Response, Sent, compact, expand
from .settings import Settings
from .stall import StallInspector

__all__ = ["Engine", "Handle", "Op", "NAP_SECONDS", "WAIT_NAP_SECONDS"]

#: The engine's nap between rounds that found nothing to do, while the caller computes (the core's polling nap).
NAP_SECONDS = polling.NAP_SECONDS
#: The nap while the caller waits for a handle.
WAIT_NAP_SECONDS = 0.1e-3
_REQUESTS, _RESPONSES, _LEFT, _SHUTDOWN, _ASK, _TELL = 1, 2, 3, 4, 5, 6
#: How long an idle engine sleeps before it looks at its messages (a peer that left, the stall inspector's).
IDLE_SECONDS = 1.0
#: How long a leaving engine tries to tell the others (a peer that has already gone cannot hear).
FAREWELL_SECONDS = 1.0
_UNNAMED = "noname."


class Handle:
    """An operation in flight: :meth:`poll` says whether it has completed, :meth:`wait` returns its result.

    The result is made on the caller's thread, by the ``finish`` function
    the operation was submitted with, from what the engine received.

    Args:
        finish: makes the result from the response and this rank's outputs.
        signal: the condition the engine notifies when operations complete
            (its :attr:`Engine.signal`; None: one of the handle's own).
    """

    def __init__(self, finish: Callable[[Response, list[Any]], Any],
                 signal: threading.Condition | None = None) -> None:
        self._finish = finish
        self._signal = threading.Condition() if signal is None else signal
        self._done = False
        self._response: Response | None = None
        self._outputs: list[Any] = []
        self._error: BaseException | None = None
        self._result: Any = None
        self._finished = False

    def poll(self) -> bool:
        """True once the operation has completed (then :meth:`wait` does not block)."""
        return self._done

    def _complete(self, response: Response | None, outputs: list[Any], error: BaseException | None = None,
                  notify: bool = True) -> None:
        self._response, self._outputs, self._error = response, outputs, error
        if notify:
            with self._signal:
                self._done = True
                self._signal.notify_all()
        else:  # the caller notifies the signal once for many, under its lock
            self._done = True

    def wait(self, engine: Engine | None = None) -> Any:
        """Block until the operation has completed; its result (raises its error).

        Raises:
            Exception: the operation's error (the same on every rank that submitted it).
        """
        if not self._done:
            if engine is not None:
                engine.waiting(+1)
            try:
                with self._signal:
                    while not self._done:
                        self._signal.wait()
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


def _revoked(comm: MPI.Comm) -> bool:
    """Whether ``comm`` was revoked (ULFM's ``MPIX_Comm_is_revoked``; False where the MPI has none)."""
    try:
        return bool(comm.Is_revoked())
    except (AttributeError, NotImplementedError, MPI.Exception):
        return False


def _refused(key: str, kind: str, error: BaseException) -> Response:
    """The verdict that fails operation ``key`` on every rank of its set with Horovod's internal error."""
    return Response(key, kind, error=("HorovodInternalError", str(error)), internal=True)


class _Set:
    """The engine's side of one process set (made on the caller's thread, collectively over its ranks)."""

    def __init__(self, set_id: int, ranks: tuple[int, ...], comm: MPI.Intracomm,
                 wait: Callable[[MPI.Request], None], settings: Settings,
                 ask: Callable[[_Set, list[int], int], None]) -> None:
        self.id, self.ranks = set_id, ranks
        self.ctl, self.data = comm.Dup(), comm.Dup()
        self.me = comm.Get_rank()
        # This incarnation's mark on its farewells: MPI may give a later set the context of a freed one, and a
        # farewell that nobody received on the old one must not reach the new one.
        self.token = self.ctl.bcast(secrets.randbits(62) if self.me == 0 else None, root=0)
        self.summers = Summers(self.data, Topology.of(self.data), two_levels=settings.hierarchical, wait=wait)
        self.local = MPI.COMM_SELF.Dup()
        self.gather = Gather(self.local, set_id)
        # The package's watchdog times each fused reduction, as it times the reducer's collectives.
        self.watchdog = Watchdog(self.data, settings.timeout, None, hook=False, rank=ranks[self.me])
        self.reductions = 0
        self.coordinator = Coordinator(comm.Get_size(), ranks) if self.me == 0 else None
        self.inspector = StallInspector(settings, ask=lambda ranks, inquiry: ask(self, ranks, inquiry),
                                        set_id=set_id) if self.me == 0 else None
        self.lost: BaseException | None = None  # a peer left (or the job was shut down): every operation fails
        self.pending: dict[str, Op] = {}
        self.outbox: list[Request] = []
        self.since = 0.0  # when the oldest request of the outbox was accepted
        self.queue: deque[deque[Sent]] = deque()  # the coordinator's lists of verdicts, in order
        self.current: tuple[Execution, list[tuple[Response, Op | None]]] | None = None
        self.scratch: dict[np.dtype, np.ndarray] = {}
        self.worker: ThreadPoolExecutor | None = None
        self.removed = False

    def busy(self) -> bool:
        return bool(self.pending or self.outbox or self.queue or self.current)

    def free(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.watchdog.close()
        self.summers.free()
        self.gather.free()
        for c in (self.ctl, self.data, self.local):
            if c != MPI.COMM_NULL:
                c.Free()


class Engine:
    """The thread that negotiates and moves the data of every operation of this process.

    Args:
        rank: this process's global rank (for messages).
        settings: Horovod's settings (fusion threshold, cycle time, stall limits).
        elsewhere: what this process waits in outside the engine, in words
            (the ``DistributedOptimizer`` reductions in progress): the stall
            warning quotes it for a missing rank. Called on the engine's thread.
    """

    def __init__(self, rank: int, settings: Settings | None = None,
                 elsewhere: Callable[[], Sequence[str]] | None = None) -> None:
        self.rank = rank
        self.settings = Settings() if settings is None else settings
        self._elsewhere = elsewhere
        self._polling = polling.Polling(NAP_SECONDS)
        self._polling.computing(True)
        self.epoch = 0  # global join() calls seen complete
        self._cond = threading.Condition()
        #: Notified when operations complete (what handles wait on).
        self.signal = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._sets: dict[int, _Set] = {}
        self._sends: list[MPI.Request] = []
        #: The stall inspector's questions and answers in flight: apart from :attr:`_sends`, so that one to a
        #: rank that is gone never keeps the engine busy nor its end waiting (freed at the end).
        self._asks: list[MPI.Request] = []
        self._in_flight: dict[int, set[str]] = {}
        self._unnamed: dict[int, int] = {}  # per process set: unnamed operations so far (their keys' counts)
        self._waiting = 0
        self._idle = False
        self._stop = False
        self._timeline: Any = None
        self._mark_cycles = False
        self._failure: BaseException | None = None
        self._broken: BaseException | None = None  # the stall shutdown: every operation fails
        self._thread = threading.Thread(target=self._run, name="mpi_gradreducer-horovod", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------------

    def add_set(self, set_id: int, ranks: tuple[int, ...], comm: MPI.Intracomm) -> None:
        """Serve a process set from now on (``comm``: its ranks; duplicated here, collectively over them)."""
        s = _Set(set_id, ranks, comm, self._polling.wait, self.settings, self._ask)
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
            self._polling.computing(self._waiting == 0)
            if delta > 0:
                self._cond.notify_all()  # this cycle's requests go now

    def pending(self) -> list[str]:
        """This rank's operations in flight, in words, a line per process set (``hvd.allreduce 'loss' in process
        set 0, submitted 61.0 s ago``): what the reducer's watchdog tells the other ranks (its ``elsewhere``
        option). Safe from any thread (it reads copies)."""
        now, lines = time.perf_counter(), []
        for s in list(self._sets.values()):
            current = s.current  # agreed, moving the data
            running = [op for _, op in current[1] if op is not None] if current is not None else []
            ops = sorted(list(s.pending.values()) + running, key=lambda op: op.submitted)
            if ops:
                names = ", ".join(f"{op.request.what or op.request.kind} {op.request.key!r}" for op in ops[:3])
                more = f" and {len(ops) - 3} more" if len(ops) > 3 else ""
                lines.append(f"{names}{more} in process set {s.id}, submitted {now - ops[0].submitted:.1f} s ago")
        return lines

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
        for s in self._sets.values():  # their threads too: no MPI call may follow a finalize (local, idempotent)
            s.watchdog.close()
            if s.inspector is not None:
                s.inspector.flush()
        for request in self._asks:
            try:
                request.Free()
            except MPI.Exception:
                pass
        self._asks = []
        self._fail_all(RuntimeError("hvd.shutdown() (or the end of the process) came before this operation "
                                    "completed: some rank of its process set never made the call"))
        self._farewell()

    def _farewell(self) -> None:
        """Tell every other rank of this rank's process sets that it has left: their operations that wait for it
        fail at once (with Horovod's internal error) instead of waiting."""
        if MPI.Is_finalized() or self._failure is not None or any(_revoked(s.ctl) for s in self._sets.values()):
            return  # after the finalize, or a lost process (a recovery revokes the communicators): sending to it
            # may end the job
        if not MPI.Get_library_version().startswith("MPICH"):
            return  # farewells nobody receives stay unmatched on freed communicators: MPICH lets them be; Open MPI
            # 5 aborted the job (tests/test_horovod.py at 4 ranks, where every rank shuts down and inits again)
        sends = []
        for s in self._sets.values():
            if s.lost is None:
                try:
                    sends += [s.ctl.isend((s.token, self.rank), dest=r, tag=_LEFT)
                              for r in range(len(s.ranks)) if r != s.me]
                except MPI.Exception:  # a peer already gone
                    pass
        deadline = time.monotonic() + FAREWELL_SECONDS
        try:
            while sends and not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                time.sleep(1e-3)
        except MPI.Exception:
            pass

    def communicators(self) -> Iterator[MPI.Intracomm]:
        """Every communicator of the engine (two per process set): what a lost rank's recovery revokes."""
        for s in self._sets.values():
            yield from (s.ctl, s.data, *s.summers.communicators(), *s.watchdog.communicators())

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
            if self._broken is not None:
                raise HorovodInternalError(str(self._broken))
            self._inbox.append(job)
            if self._idle:  # else the thread takes it at the end of its nap: submitting stays cheap
                self._cond.notify_all()

    # -- the engine's thread ----------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._inbox or self._sends or any(s.busy() for s in self._sets.values()))

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._busy():
                        self._idle = True
                        if not self._cond.wait(IDLE_SECONDS):
                            break  # look at the messages (a peer that left, another rank's requests)
                    self._idle = False
                    if self._stop or MPI.Is_finalized():  # no MPI call after the finalize (at exit)
                        if self._sends and not MPI.Is_finalized():
                            MPI.Request.Waitall(self._sends)  # small messages: sent eagerly, complete at once
                        return
                    jobs, self._inbox = self._inbox, []
                took = bool(jobs)
                jobs.reverse()
                while jobs:  # popped, so that nothing of them (their arrays) outlives them while the thread sleeps
                    jobs.pop()()
                if self._progress() or took:
                    continue
                with self._cond:  # a nap, cut short by a caller that starts to wait (see waiting())
                    if not self._stop and not (self._waiting and self._inbox):
                        self._cond.wait(self._nap())
        except BaseException as exc:  # never leave a caller waiting: every handle in flight fails with it
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
            self._fail_all(self._failed())

    def _nap(self) -> float:
        """How long the thread may sleep now: until the cycle ends while it only collects requests, else the
        polling nap (shorter while the caller waits)."""
        if self._waiting:
            return WAIT_NAP_SECONDS
        polls = bool(self._sends) or any(len(s.pending) > len(s.outbox) or s.queue or s.current
                                         for s in self._sets.values())  # a request sent and not yet answered
        ends = [s.since + self.settings.cycle_time for s in self._sets.values() if s.outbox]
        if not ends:
            return NAP_SECONDS
        left = max(0.0, min(ends) - time.perf_counter())
        return min(left, NAP_SECONDS) if polls else left

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
            if s.current is not None:
                for _, mine in s.current[1]:
                    if mine is not None:
                        mine.handle._complete(None, [], error)
            s.pending.clear()
            s.current = None

    def _accept(self, op: Op) -> None:
        s = self._sets.get(op.set_id)
        if s is None or s.removed:
            self._done(op, None, [], ValueError(f"process set {op.set_id} was removed"))
            return
        if s.lost is not None:
            self._done(op, None, [], HorovodInternalError(str(s.lost)))
            return
        request = op.request
        if request.epoch != self.epoch:
            request = op.request = request._replace(epoch=self.epoch)
        if request.kind == "join":
            for other in self._sets.values():
                if not other.removed and other.id != s.id:
                    self._enqueue(other, request)
        s.pending[request.key] = op
        self._enqueue(s, request)

    def _enqueue(self, s: _Set, request: Request) -> None:
        if not s.outbox:
            s.since = time.perf_counter()
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
            s.current = None
        s.free()

    def _progress(self) -> bool:
        did = False
        for s in list(self._sets.values()):
            did = self._flush(s) or did
            did = self._listen(s) or did
            if s.coordinator is not None and s.inspector is not None and s.lost is None:
                reason = s.inspector.inspect(s.coordinator)
                if reason is not None:
                    for r in range(1, len(s.ranks)):
                        self._sends.append(s.ctl.isend((s.token, reason), dest=r, tag=_SHUTDOWN))
                    self._halt(reason)
                    did = True
            did = self._execute(s) or did
        if self._sends and MPI.Request.Testall(self._sends):  # one MPI call (each releases the GIL)
            self._sends = []
        if self._asks:
            try:
                done = MPI.Request.Testall(self._asks)
            except MPI.Exception:  # one to a rank that is gone: the others' fate does not matter either
                done = True
            if done:
                self._asks = []
        if did and self._mark_cycles:
            self._record("CYCLE_START", time.perf_counter(), time.perf_counter())
        return did

    def _flush(self, s: _Set) -> bool:
        """Send the requests of this cycle: once ``HOROVOD_CYCLE_TIME`` has passed since the first, or at once
        while the caller waits for a handle (it submits nothing more meanwhile)."""
        if not s.outbox:
            return False
        if not self._waiting and time.perf_counter() - s.since < self.settings.cycle_time:
            return False
        requests, s.outbox = s.outbox, []
        if s.coordinator is not None:
            self._deliver(s, s.coordinator.receive(0, requests))
        else:
            self._sends.append(s.ctl.isend(requests, dest=0, tag=_REQUESTS))
        return True

    def _listen(self, s: _Set) -> bool:
        """Take the set's messages in the order each rank sent them: requests (coordinator), verdicts, a peer that
        left, the stall shutdown."""
        did = False
        status = MPI.Status()
        while True:
            message = s.ctl.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if message is None:
                return did
            body, tag, source = message.recv(), status.Get_tag(), status.Get_source()
            did = True
            if tag == _REQUESTS and s.coordinator is not None:
                if s.lost is None:
                    self._deliver(s, s.coordinator.receive(source, body))
                else:  # a rank left: what is asked for now fails on every rank that asks
                    self._deliver(s, [_refused(q.key, q.kind, s.lost) for q in body])
            elif tag == _RESPONSES:
                s.queue.append(deque(body))
            elif tag in (_LEFT, _SHUTDOWN) and body[0] != s.token:
                continue  # meant for a freed communicator whose context this one reuses
            elif tag == _LEFT and s.lost is None:
                error = HorovodInternalError(
                    f"rank {body[1]} left Horovod (hvd.shutdown(), or the end of its process) while this operation "
                    f"waited for the ranks of process set {s.id} ({list(s.ranks)}) to submit it")
                if s.coordinator is not None:  # the set's first rank says, to every rank, which operations fail
                    self._deliver(s, [_refused(key, kind, error) for key, kind in s.coordinator.drop()])
                    self._lose(s, error)
                elif source == 0:  # the first rank left: no verdict comes any more (those it sent came before)
                    self._lose(s, error)
                # Another rank left: it may have left after an operation that every rank agreed on, and its
                # farewell may come here before the first rank's verdict on it; that rank's verdicts decide.
            elif tag == _SHUTDOWN:
                self._halt(body[1])
            elif tag == _ASK and body[0] == s.token:
                self._send_ask(s, (s.token, body[1], self._waiting_in()), source, _TELL)
            elif tag == _TELL and body[0] == s.token and s.inspector is not None:
                s.inspector.told(s.ranks[source], body[1], body[2])

    def _ask(self, s: _Set, ranks: list[int], inquiry: int) -> None:
        """The stall inspector asks these ranks (global) of set ``s`` what their processes wait in."""
        assert s.inspector is not None
        for r in ranks:
            if r == s.ranks[s.me]:
                s.inspector.told(r, inquiry, self._waiting_in())
            else:
                self._send_ask(s, (s.token, inquiry), s.ranks.index(r), _ASK)

    def _send_ask(self, s: _Set, body: tuple[Any, ...], dest: int, tag: int) -> None:
        """A question or an answer of the stall inspector: never an error of the engine's (the rank may be gone)."""
        try:
            self._asks.append(s.ctl.isend(body, dest=dest, tag=tag))
        except MPI.Exception:
            pass

    def _waiting_in(self) -> list[str]:
        """What this process waits in: outside the engine (its ``elsewhere``), then its own operations."""
        try:
            outside = [] if self._elsewhere is None else list(self._elsewhere())
        except Exception as exc:  # a description must never stop the engine
            outside = [f"(undescribable: {exc!r})"]
        return outside + self.pending()

    def _lose(self, s: _Set, error: BaseException) -> None:
        """The set cannot complete anything more: its operations still waiting for a verdict fail, and later
        ones. Those whose verdict has come still run: every rank agreed on them."""
        s.lost = error
        if s.inspector is not None:
            s.inspector.flush()
        s.outbox.clear()
        agreed = {sent if isinstance(sent, str) else sent.key for verdicts in s.queue for sent in verdicts}
        for key, op in list(s.pending.items()):
            if key not in agreed:
                del s.pending[key]
                self._done(op, None, [], HorovodInternalError(str(error)))

    def _halt(self, reason: str) -> None:
        """The stall shutdown: every operation of every set fails, now and later."""
        self._broken = HorovodInternalError(reason)
        for s in self._sets.values():
            self._lose(s, self._broken)

    def _deliver(self, s: _Set, responses: list[Response]) -> None:
        if not responses:
            return
        sent = [compact(r) for r in responses]
        for r in range(1, len(s.ranks)):
            self._sends.append(s.ctl.isend(sent, dest=r, tag=_RESPONSES))
        s.queue.append(deque(sent))

    def _execute(self, s: _Set) -> bool:
        did = False
        while True:
            if s.current is None:
                if not self._start_next(s):
                    return did
                did = True
                if s.current is None:
                    continue
            execution, items = s.current
            if not execution.test():
                return did
            s.current = None
            did = True
            self._done_all([(op, response, outputs) for (response, op), outputs in
                            zip(items, execution.results(), strict=True) if op is not None])

    def _take(self, s: _Set) -> tuple[Response, Op | None] | None:
        """The next verdict of the set's oldest list, and this rank's operation under its key."""
        while s.queue and not s.queue[0]:
            s.queue.popleft()
        if not s.queue:
            return None
        sent = s.queue[0].popleft()
        key = sent if isinstance(sent, str) else sent.key
        op = s.pending.pop(key, None)
        response = expand(sent, op.request if op is not None else None)
        if response is None:  # a plain verdict on a key this rank has no operation for: nothing to do here
            return self._take(s)
        if op is not None:
            op.agreed = time.perf_counter()
        return response, op

    def _start_next(self, s: _Set) -> bool:
        """Start the next operation of the set (a fused group of allreduces, or one other); False when none.

        Verdicts that need no data (errors, joins) complete at once; ``s.current`` stays None then.
        """
        taken = self._take(s)
        if taken is None:
            return False
        response, op = taken
        if response.kind == "join" and response.error is None:  # (a join is refused when a rank left)
            if op is not None:  # the global set: every rank has joined
                self.epoch += 1
                self._done(op, response, [s.ranks[response.last]])
            return True
        if op is None and response.key.startswith(_UNNAMED):  # from join(): count it as the others do
            with self._cond:
                count = int(response.key[len(_UNNAMED):]) + 1
                self._unnamed[s.id] = max(self._unnamed.get(s.id, 0), count)
        if response.error is not None:
            if op is not None:
                self._done(op, response, [], op.error_of(response))
            return True
        if op is None and s.me not in response.joined:
            return True
        if response.kind == "allreduce":
            items = [(response, op)] + self._fusable(s, response)
            locals_ = [(r, o.local if o is not None else None) for r, o in items]
            threshold = self.settings.fusion_threshold
            s.reductions += 1
            call, count = s.reductions, sum(len(r.reference().entries) for r, _ in items)

            def work() -> list[list[Any]]:
                s.watchdog.arm(lambda: f"hvd allreduce of {count} tensors, process set {s.id}", call)
                try:
                    return fused(s.summers, locals_, threshold, s.scratch, s.gather)
                finally:
                    s.watchdog.disarm()

            s.current = (Blocking(work, self._worker(s)), items)
            return True
        ref = response.reference()
        try:
            root = s.ranks.index(ref.root) if ref.root >= 0 else -1
            s.current = (build(s.data, response, op.local if op is not None else None, root,
                               self.settings.fusion_threshold, self._worker(s)), [(response, op)])
        except Exception as exc:  # a local failure (memory): this rank's caller hears of it
            if op is not None:
                self._done(op, response, [], exc)
        return True

    def _fusable(self, s: _Set, first: Response) -> list[tuple[Response, Op | None]]:
        """The verdicts that follow ``first`` in its list and fuse with it: allreduces without error of the same
        operation and scaling, up to the fusion threshold (the same on every rank: the list is)."""
        if not s.queue:
            return []
        ref = first.reference()
        grouped = not self.settings.group_fusion  # HOROVOD_DISABLE_GROUP_FUSION: a group fuses with nothing
        if grouped and len(ref.entries) > 1:
            return []
        batch, out = s.queue[0], []
        held = fused_bytes(first)
        while batch:
            sent = batch[0]
            key = sent if isinstance(sent, str) else sent.key
            op = s.pending.get(key)
            response = expand(sent, op.request if op is not None else None)
            if response is None or response.kind != "allreduce" or response.error is not None:
                break
            other = response.reference()
            if other.op != ref.op or other.factors != ref.factors or grouped and len(other.entries) > 1:
                break
            if op is None and s.me not in response.joined:
                break
            held += fused_bytes(response)
            if held > self.settings.fusion_threshold:
                break
            batch.popleft()
            if op is not None:
                del s.pending[key]
                op.agreed = time.perf_counter()
            out.append((response, op))
        return out

    def _worker(self, s: _Set) -> ThreadPoolExecutor | None:
        """Where the set's blocking reductions run: the engine's thread (None) while this rank serves one set."""
        if len(self._sets) <= 1:
            return None
        if s.worker is None:
            s.worker = ThreadPoolExecutor(1, thread_name_prefix=f"mpi_gradreducer-horovod-set{s.id}")
        return s.worker

    def _done_all(self, done: list[tuple[Op, Response, list[Any]]]) -> None:
        with self._cond:
            for op, _, _ in done:
                self._in_flight.get(op.set_id, set()).discard(op.request.key)
            self._cond.notify_all()
        with self.signal:
            for op, response, outputs in done:
                self._finished(op, response, outputs, None, notify=False)
            self.signal.notify_all()

    def _done(self, op: Op, response: Response | None, outputs: list[Any], error: BaseException | None = None) -> None:
        with self._cond:
            self._in_flight.get(op.set_id, set()).discard(op.request.key)
            self._cond.notify_all()
        self._finished(op, response, outputs, error)

    def _finished(self, op: Op, response: Response | None, outputs: list[Any], error: BaseException | None,
                  notify: bool = True) -> None:
        end = time.perf_counter()
        if op.agreed and self._timeline is not None:  # read without the lock: _record checks again under it
            kind = op.request.kind.upper()
            name = f"{op.request.kind}.{op.request.key}"
            since_epoch = round((time.time() - (end - op.submitted)) * 1e6)  # the call, on the wall clock
            self._record(f"NEGOTIATE_{kind}", op.submitted, op.agreed, tensor=name,
                         start_time_since_epoch_in_micros=since_epoch)
            self._record(kind, op.agreed, end, tensor=name, error=str(error) if error is not None else "")
        op.handle._complete(response, outputs, error, notify)

    def _record(self, name: str, start: float, end: float, **args: Any) -> None:
        with self._cond:
            if self._timeline is not None:
                self._timeline.record(name, start, end, **args)
