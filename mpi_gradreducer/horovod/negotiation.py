"""What the ranks of a process set agree on before any data moves: requests in, responses out (no MPI here).

Every operation a rank submits becomes a :class:`Request` under a key: the
name the caller gave, or ``noname.<k>`` for the k-th unnamed operation of
that rank in the process set, so that operations match by name, as in
Horovod, whatever order the ranks submit them in. The process set's first
rank keeps a :class:`Coordinator`; every rank sends it its requests. Once
every rank of the set has submitted a key (or is in ``join()``), the
coordinator makes one :class:`Response` for it and sends it to every rank,
in one order: the order in which the ranks then move the data.

A response is an error instead when a rank's request carries one (a bad
argument there: the lowest such rank's error, on every rank), when the
ranks' requests differ (kind, dtype, shape, operation, root, scaling:
naming two ranks), or when the kind cannot run while some rank is in
``join()`` (as in Horovod, only ``allreduce`` and ``barrier`` can: a rank
in ``join()`` takes part in them with the operation's identity).

Joins are counted per epoch: a rank's requests carry the number of global
``join()`` calls it has seen complete, and a rank counts as joined for the
requests of the epoch it joined in only, so that nothing needs to be reset
when every rank has joined.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Request", "Response", "Coordinator", "JOIN", "RAGGED", "REDUCING", "SERVED", "Sent", "compact",
           "describe", "expand"]

#: The key of ``join()``'s request.
JOIN = "join"
#: Kinds whose tensors' first dimension may differ between ranks.
RAGGED = ("allgather", "alltoall", "sparse")
#: Kinds that reduce (their operation and scaling must agree).
REDUCING = ("allreduce", "reducescatter")
#: Kinds a rank in ``join()`` takes part in.
SERVED = ("allreduce", "barrier")
#: Reduction operations by Horovod's value, for messages.
_OPS = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
#: Kinds whose every rank's request is the reference (same signature): a plain verdict on them travels as its key.
_BY_REFERENCE = ("allreduce", "broadcast", "barrier", "reducescatter", "check")


class Request(NamedTuple):
    """What one rank asks for under one key: enough for the others to check it and to move the data.

    Attributes:
        key: the operation's name, ``noname.<k>`` or :data:`JOIN`.
        kind: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
            ``reducescatter``, ``barrier``, ``sparse``, ``bcast_object``,
            ``gather_object``, ``check`` (an agreement without data) or ``join``.
        what: the call as the user made it (``hvd.allreduce``), for messages.
        entries: per tensor, its dtype name and shape.
        op: the reduction operation (Horovod's value), or -1.
        root: the root's global rank (``hvd.rank()``), or -1.
        splits: ``alltoall``: rows this rank sends to each rank; ``sparse``:
            its number of rows; object kinds: its payload's bytes.
        factors: prescale and postscale factors.
        error: ``(exception class name, message)`` when this rank's arguments were bad.
        epoch: global ``join()`` calls this rank has seen complete.
    """

    key: str
    kind: str
    what: str = ""
    entries: tuple[tuple[str, tuple[int, ...]], ...] = ()
    op: int = -1
    root: int = -1
    splits: tuple[int, ...] = ()
    factors: tuple[float, float] = (1.0, 1.0)
    error: tuple[str, str] | None = None
    epoch: int = 0

    def signature(self) -> tuple[Any, ...]:
        """What must be equal on every rank."""
        shapes = tuple((d, s[1:] if self.kind in RAGGED else s) for d, s in self.entries)
        factors = self.factors if self.kind in REDUCING else ()
        return self.kind, self.op, self.root, shapes, factors

    def describe(self) -> str:
        """The request in words, for messages."""
        return describe(self)


def describe(request: Request) -> str:
    """``hvd.allreduce of [float32 (3,)] with op=Average``, and so on."""
    parts = [f"{d} {tuple(s)}" for d, s in request.entries]
    text = f"{request.what or request.kind} of [{', '.join(parts)}]" if request.entries else \
        (request.what or request.kind)
    if request.op >= 0:
        text += f" with op={_OPS.get(request.op, request.op)}"
    if request.root >= 0:
        text += f" from root_rank={request.root}"
    if request.kind in REDUCING and request.factors != (1.0, 1.0):
        text += f" scaled by {request.factors[0]!r} before and {request.factors[1]!r} after"
    return text


class Response(NamedTuple):
    """The verdict on one key, the same on every rank of the process set.

    Attributes:
        key: the key.
        kind: the kind, or ``join`` when every rank has joined.
        requests: per rank of the set, its request (None for a rank in ``join()``).
        joined: the ranks of the set in ``join()`` that take part.
        error: ``(exception class name, message)`` when the operation fails on every rank that submitted it.
        internal: the error is Horovod's internal one (ranks disagree, or a join), not a bad argument.
        last: ``join``: the rank (of the set) that joined last.
    """

    key: str
    kind: str
    requests: tuple[Request | None, ...] = ()
    joined: tuple[int, ...] = ()
    error: tuple[str, str] | None = None
    internal: bool = False
    last: int = -1

    def reference(self) -> Request:
        """The first submitted request (every submitted one has its signature)."""
        first = self.requests[0]
        return first if first is not None else next(r for r in self.requests if r is not None)


#: A verdict as it travels from the coordinator: a :class:`Response`, or only its key (see :func:`compact`).
Sent = Response | str


def compact(response: Response) -> Sent:
    """What the coordinator sends of ``response``: its key alone when every rank asked the same thing
    without error and none is in ``join()`` (each rank then knows the rest from its own request), else itself.

    Many small operations a cycle are the common case; their verdicts cost a
    few bytes each on the wire, not every rank's request.
    """
    if response.error is None and not response.joined and response.kind in _BY_REFERENCE:
        return response.key
    return response


def expand(sent: Sent, mine: Request | None) -> Response | None:
    """The response that ``sent`` stands for, given this rank's own request under its key (None when this rank
    has none: a key sent alone then concerns no operation of this rank)."""
    if isinstance(sent, Response):
        return sent
    if mine is None:
        return None
    return Response(sent, mine.kind, (mine,))


@dataclass
class Coordinator:
    """The first rank's table of the process set's requests: each key's response once it is ready.

    Args:
        size: the number of ranks in the process set.
        ranks: their global ranks, for messages (default: ``range(size)``).
    """

    size: int
    ranks: tuple[int, ...] = ()
    table: dict[str, dict[int, Request]] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)  # rank -> epoch it joined in
    join_order: list[int] = field(default_factory=list)
    since: dict[str, float] = field(default_factory=dict)  # key -> when a rank first asked for it (monotonic)

    def receive(self, rank: int, requests: list[Request]) -> list[Response]:
        """Take ``rank``'s requests (in the order it submitted them); the responses now ready, in order."""
        out: list[Response] = []
        for request in requests:
            if request.kind == "join":
                self.joined[rank] = request.epoch
                self.join_order.append(rank)
                out += self._ready(list(self.table))  # a join may complete any key
                out += self._all_joined(request.epoch)
                continue
            got = self.table.get(request.key)
            if got is None:
                got = self.table[request.key] = {}
                self.since[request.key] = time.monotonic()
            got[rank] = request
            out += self._ready([request.key])
        return out

    def drop(self) -> list[tuple[str, str]]:
        """Forget every key still waiting for some rank, and the ranks in ``join()`` (a rank left: none of them
        can complete); their keys and kinds, oldest first, then the join's."""
        dropped = [(key, next(iter(got.values())).kind) for key, got in self.table.items() if got]
        if self.joined:
            dropped.append((JOIN, "join"))
        self.table.clear()
        self.since.clear()
        self.joined.clear()
        self.join_order.clear()
        return dropped

    def stalled(self, older_than: float, now: float | None = None) -> dict[str, list[int]]:
        """The keys some rank asked for at least ``older_than`` seconds ago and that still wait, each with the
        ranks (global) that have neither asked for it nor joined, oldest key first."""
        now = time.monotonic() if now is None else now
        name = (lambda r: self.ranks[r]) if self.ranks else (lambda r: r)
        out: dict[str, list[int]] = {}
        for key, since in sorted(self.since.items(), key=lambda item: item[1]):
            got = self.table.get(key)
            if not got or now - since < older_than:
                continue
            epoch = next(iter(got.values())).epoch
            joined = self._joined_in(epoch)
            out[key] = [name(r) for r in range(self.size) if r not in got and r not in joined]
        return out

    def _joined_in(self, epoch: int) -> list[int]:
        return sorted(r for r, e in self.joined.items() if e == epoch)

    def _ready(self, keys: list[str]) -> list[Response]:
        out = []
        for key in keys:
            got = self.table.get(key)
            if not got:
                continue
            joined = [r for r in self._joined_in(next(iter(got.values())).epoch) if r not in got] if self.joined else []
            if len(got) + len(joined) < self.size:
                continue
            del self.table[key]
            self.since.pop(key, None)
            out.append(verdict(key, [got.get(r) for r in range(self.size)], joined, self.ranks))
        return out

    def _all_joined(self, epoch: int) -> list[Response]:
        joined = self._joined_in(epoch)
        if len(joined) < self.size:
            return []
        last = [r for r in self.join_order if self.joined.get(r) == epoch][-1]
        for r in joined:
            del self.joined[r]
        self.join_order = [r for r in self.join_order if r in self.joined]
        return [Response(JOIN, "join", last=last)]


def verdict(key: str, requests: list[Request | None], joined: list[int], ranks: tuple[int, ...] = ()) -> Response:
    """The response to ``requests`` (per rank of the set; None for a rank in ``join()``).

    Messages name global ranks (``ranks[r]`` for rank ``r`` of the set).
    """
    given = tuple(requests)
    ref = given[0]
    if ref is not None and ref.error is None and not joined and given.count(ref) == len(given):
        return Response(key, ref.kind, given)  # the common case: every rank asked the same, at once
    name = (lambda r: ranks[r]) if ranks else (lambda r: r)
    mine = [(r, q) for r, q in enumerate(requests) if q is not None]
    for r, q in mine:
        if q.error is not None:
            return Response(key, q.kind, given, tuple(joined), (q.error[0], f"rank {name(r)}: {q.error[1]}"))
    first, ref = mine[0]
    for r, q in mine[1:]:
        if q != ref and (q.signature() != ref.signature() or q.epoch != ref.epoch):
            ragged = " (only the first dimension may differ)" if ref.kind in RAGGED else ""
            return Response(key, ref.kind, given, tuple(joined), (
                "RuntimeError",
                f"the ranks disagree on {key!r}: rank {name(first)} called {ref.describe()} but rank {name(r)} called "
                f"{q.describe()}; make the same calls, with tensors of the same dtype and shape{ragged}, on every "
                "rank of the process set"), internal=True)
    if joined and ref.kind not in SERVED:
        return Response(key, ref.kind, given, tuple(joined), (
            "RuntimeError",
            f"{ref.describe()} cannot run while ranks {[name(r) for r in joined]} are in hvd.join(): as in "
            "Horovod, only allreduce and barrier can (a joined rank takes part in them)"), internal=True)
    return Response(key, ref.kind, given, tuple(joined))
