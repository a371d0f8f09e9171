"""How the data of agreed operations moves, on host arrays (no torch here).

Allreduce is Tensor Fusion (:func:`fused`): the consecutive allreduce
operations of one cycle's verdicts with the same operation and scaling are
packed, per wire dtype, into buffers of up to ``HOROVOD_FUSION_THRESHOLD``
bytes, each summed through the package's summers
(:class:`~mpi_gradreducer._core.summers.Summers`: the reducer's chunks, its
rank-order means, its two levels across hosts; float16 through its 16-bit
sums, added in float32 and rounded once) and unpacked. A buffer of one
tensor is reduced where it lies. Average divides by the process set's size
(a rank in ``join()`` counts, as in Horovod: it contributes the operation's
identity), integers in float64 and truncated toward zero; ``prescale``
multiplies each rank's values before the reduction, ``postscale`` the
result. bfloat16, and float16 under Min, Max or Product, are reduced in
float32.

The other kinds are an :class:`Execution`: a list of steps; each step starts
nonblocking MPI calls (and may first compute on what the steps before
received), and the next step starts once they have all completed. The
engine tests executions without blocking, so that operations of different
process sets (different communicators) never wait for each other; within a
process set they run one at a time, in the coordinator's order, so that
every rank starts the same calls in the same order on each communicator.
Data-moving kinds move raw bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core.sparse import gather_rows
from .._core.summers import Summers, allreduce
from .._core.transport import Gather
from .._core.wire import half_format
from .negotiation import Response

__all__ = ["Blocking", "Execution", "Local", "buckets", "build", "fused", "fused_bytes", "wire_dtype", "NUMPY",
           "PACK_BELOW"]

#: A broadcast's tensors below this many bytes travel packed, one message per fusion buffer: a message each
#: costs a round of the engine's tests; larger ones go from their own memory, with no copy.
PACK_BELOW = 1 << 20

#: torch dtype names and the numpy dtype of their host copies (bfloat16: reduced as float32).
NUMPY = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.float32,
         "complex64": np.complex64, "complex128": np.complex128, "int8": np.int8, "uint8": np.uint8,
         "int16": np.int16, "int32": np.int32, "int64": np.int64}
AVERAGE, SUM, MIN, MAX, PRODUCT = 0, 1, 3, 4, 5
_MPI_OPS = {AVERAGE: MPI.SUM, SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD}
Step = Callable[[], list[MPI.Request]]
#: The 16-bit format of float16 sums (the core's :class:`~mpi_gradreducer._core.halves.SliceSum`).
_FP16 = half_format(np.float16)


def wire_dtype(dtype: str, op: int) -> np.dtype:
    """The dtype a tensor of torch dtype ``dtype`` is reduced in with ``op``."""
    if dtype == "float16" and op not in (AVERAGE, SUM):
        return _WIRE["float32"]
    return _WIRE[dtype]


_WIRE = {name: np.dtype(t) for name, t in NUMPY.items()}


class Local:
    """This rank's side of one operation: the host arrays it sends (or receives into), prepared by the caller.

    Args:
        arrays: per tensor, a private host array (reductions: 1-D, in the
            wire dtype; data-moving kinds: raw bytes).
        row_bytes: per tensor, bytes of one row of its first dimension.
    """

    def __init__(self, arrays: Sequence[np.ndarray], row_bytes: Sequence[int] = ()) -> None:
        self.arrays = list(arrays)
        self.row_bytes = list(row_bytes)


class Execution:
    """The steps of one operation on this rank; :meth:`test` advances them without blocking.

    Attributes:
        outputs: what the operation produced on this rank (per tensor), once done.
    """

    def __init__(self, steps: list[Step]) -> None:
        self._steps = steps
        self._requests: list[MPI.Request] | None = None
        self.outputs: list[Any] = []

    def test(self) -> bool:
        """Start the next step when the one before has completed; True once every step has."""
        while True:
            if self._requests is not None:
                if self._requests and not MPI.Request.Testall(self._requests):
                    return False
                self._requests = None
            if not self._steps:
                return True
            self._requests = self._steps.pop(0)()

    def wait(self) -> None:
        """Complete every step, blocking (used when the engine stops)."""
        while not self.test():
            if self._requests:
                MPI.Request.Waitall(self._requests)

    def results(self) -> list[list[Any]]:
        """Per operation of the execution, its outputs on this rank (once done)."""
        return [self.outputs]


class Blocking(Execution):
    """Work that makes blocking MPI calls: run at once when tested (no ``executor``), or on ``executor``'s thread.

    Args:
        work: returns, per operation, its outputs.
        executor: where it runs (None: on the thread that first tests it).
    """

    def __init__(self, work: Callable[[], list[list[Any]]], executor: Executor | None = None) -> None:
        super().__init__([])
        self._work: Callable[[], list[list[Any]]] | None = work
        self._executor = executor
        self._future: Future[list[list[Any]]] | None = None
        self._results: list[list[Any]] = []

    def test(self) -> bool:
        """True once the work has completed (raises its error)."""
        if self._work is not None:
            work, self._work = self._work, None
            if self._executor is None:
                self._results = work()
                return True
            self._future = self._executor.submit(work)
        if self._future is None:
            return True
        if not self._future.done():
            return False
        self._results = self._future.result()
        return True

    def wait(self) -> None:
        """Complete the work, blocking."""
        if self._future is not None:
            self._future.exception()
        self.test()

    def results(self) -> list[list[Any]]:
        """Per operation, its outputs on this rank."""
        return self._results


def _offsets(counts: Sequence[int]) -> list[int]:
    return [0, *np.cumsum(counts[:-1], dtype=np.int64).tolist()] if len(counts) else []


def _slices(n: int, size: int) -> list[int]:
    """Rows of ``n`` that each rank gets (the first ``n % size`` one more)."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def _identity(dtype: np.dtype, count: int, op: int) -> np.ndarray:
    """What a rank in ``join()`` contributes: the operation's identity."""
    if op == MIN:
        fill: Any = np.inf if dtype.kind in "fc" else np.iinfo(dtype).max
    elif op == MAX:
        fill = -np.inf if dtype.kind in "fc" else np.iinfo(dtype).min
    elif op == PRODUCT:
        fill = 1
    else:
        fill = 0
    return np.full(count, fill, dtype=dtype)


def _scale(arr: np.ndarray, op: int, size: int, post: float) -> None:
    """Average and postscale ``arr`` in place (integers in float64, truncated toward zero)."""
    if op != AVERAGE and post == 1.0:
        return
    if arr.dtype.kind in "iu":
        value = arr.astype(np.float64)
        if op == AVERAGE:
            value /= size
        if post != 1.0:
            value *= post
        np.copyto(arr, np.trunc(value), casting="unsafe")
        return
    if op == AVERAGE and post == 1.0:
        np.divide(arr, size, out=arr)
    else:
        np.multiply(arr, (post / size) if op == AVERAGE else post, out=arr, casting="unsafe")


def _prescale(arr: np.ndarray, pre: float) -> None:
    if pre == 1.0:
        return
    if arr.dtype == np.float16:  # in float32, rounded once
        np.multiply(arr, pre, out=arr, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(arr, pre, out=arr, casting="unsafe")


def fused_bytes(response: Response) -> int:
    """The bytes an allreduce response takes in fusion buffers."""
    ref = response.reference()
    return _layout(ref.entries, ref.op)[0]


@functools.lru_cache(maxsize=256)
def _layout(entries: tuple[tuple[str, tuple[int, ...]], ...], op: int) -> tuple[int, tuple[tuple[np.dtype, int], ...]]:
    """The bytes that tensors of ``entries`` take in fusion buffers under ``op``, and per tensor its wire dtype and
    element count (kept for the next calls: a step repeats its calls)."""
    members = tuple((wire_dtype(dtype, op), math.prod(shape)) for dtype, shape in entries)
    return sum(wire.itemsize * count for wire, count in members), members


def fused(summers: Summers, items: Sequence[tuple[Response, Local | None]], threshold: int,
          scratch: dict[np.dtype, np.ndarray], gather: Gather | None = None) -> list[list[Any]]:
    """Reduce the allreduce operations ``items`` (one operation and scaling; this rank's arrays, or None in
    ``join()``) in fusion buffers of up to ``threshold`` bytes per wire dtype (blocking); each operation's outputs.

    The buffers, their order and their members depend only on the
    operations' entries, so every rank makes the same collectives. A buffer
    of one tensor is that tensor's own array; fusion buffers are ``scratch``'s,
    kept for the next call.

    Args:
        summers: the process set's summers (their ``comm``: its data communicator).
        items: the operations, in the coordinator's order.
        threshold: ``HOROVOD_FUSION_THRESHOLD`` (0: every tensor alone).
        scratch: the process set's fusion buffers by wire dtype.
        gather: copies a fusion buffer's members into it and back in one MPI call each (the core's
            :class:`~mpi_gradreducer._core.transport.Gather`, whose datatype serves the next call on the
            same memory; None: numpy copies).
    """
    ref = items[0][0].reference()
    op, (pre, post) = ref.op, ref.factors
    outputs: list[list[Any]] = []
    parts: dict[np.dtype, list[tuple[np.ndarray | None, int]]] = {}
    for response, local in items:
        layout = _layout(response.reference().entries, op)[1]
        outputs.append([None] * len(layout) if local is None else list(local.arrays))
        arrays = [None] * len(layout) if local is None else local.arrays
        for (wire, count), array in zip(layout, arrays, strict=True):
            parts.setdefault(wire, []).append((array, count))
    size = summers.comm.Get_size()
    for wire, members in parts.items():
        for bucket in buckets(members, wire.itemsize, threshold):
            _reduce(summers, bucket, wire, op, pre, post, size, scratch, gather)
    return outputs


def buckets(members: list[tuple[np.ndarray | None, int]], itemsize: int,
             threshold: int) -> list[list[tuple[np.ndarray | None, int]]]:
    """Consecutive members in buckets of up to ``threshold`` bytes (a larger member alone)."""
    out: list[list[tuple[np.ndarray | None, int]]] = []
    current: list[tuple[np.ndarray | None, int]] = []
    held = 0
    for member in members:
        nbytes = member[1] * itemsize
        if current and held + nbytes > threshold:
            out.append(current)
            current, held = [], 0
        current.append(member)
        held += nbytes
    if current:
        out.append(current)
    return out


def _reduce(summers: Summers, bucket: list[tuple[np.ndarray | None, int]], wire: np.dtype, op: int, pre: float,
            post: float, size: int, scratch: dict[np.dtype, np.ndarray], gather: Gather | None) -> None:
    """Reduce one bucket: pack it (a bucket of one: its own array), sum, unpack."""
    if len(bucket) == 1:
        array, count = bucket[0]
        buf = array if array is not None else _identity(wire, count, op)
        _prescale(buf, pre)
        _sum(summers, buf, op, post, size)
        return
    total = sum(count for _, count in bucket)
    held = scratch.get(wire)
    if held is None or held.shape[0] < total:
        held = scratch[wire] = np.empty(total, dtype=wire)
    buf = held[:total]
    arrays = [array for array, _ in bucket if array is not None]
    if len(arrays) == len(bucket):  # packed and unpacked in one MPI call each where it can, else numpy's
        packed = gather is not None and gather.pack(arrays, buf)
        if not packed:
            np.concatenate(arrays, out=buf)
        _prescale(buf, pre)
        _sum(summers, buf, op, post, size)
        if not packed:
            _unpack(buf, bucket)
        else:
            assert gather is not None
            gather.unpack(buf, arrays, just_packed=True)
        return
    at = 0
    for array, count in bucket:
        if array is None:
            buf[at:at + count] = _identity(wire, 1, op)[0]
        else:
            buf[at:at + count] = array
        at += count
    _prescale(buf, pre)
    _sum(summers, buf, op, post, size)
    _unpack(buf, bucket)


def _unpack(buf: np.ndarray, bucket: list[tuple[np.ndarray | None, int]]) -> None:
    at = 0
    for array, count in bucket:
        if array is not None:
            array[...] = buf[at:at + count]
        at += count


def _sum(summers: Summers, buf: np.ndarray, op: int, post: float, size: int) -> None:
    """Reduce ``buf`` over the summers' communicator in place, then average and postscale."""
    if buf.size == 0:
        return
    if op in (AVERAGE, SUM) and buf.dtype.kind in "fc":
        scale = (post / size) if op == AVERAGE else post
        if buf.dtype == np.float16:
            summers.sliced(_FP16).reduce(buf, scale)
        else:
            allreduce(summers.comm, buf, scale, summers.chunk_bytes, ordered=summers.ordered(buf.dtype),
                      split_sums=summers.split_sums)
        return
    allreduce(summers.comm, buf, 1.0, summers.chunk_bytes, op=_MPI_OPS[op])
    _scale(buf, op, size, post)


def _allgather(comm: MPI.Intracomm, response: Response, local: Local) -> Execution:
    ref = response.reference()
    outputs: list[Any] = []
    requests_of = response.requests

    def start() -> list[MPI.Request]:
        requests = []
        for i in range(len(ref.entries)):
            counts = [q.entries[i][1][0] * local.row_bytes[i] if q is not None else 0 for q in requests_of]
            recv = np.empty(sum(counts), dtype=np.uint8)
            outputs.append((recv, [c // local.row_bytes[i] if local.row_bytes[i] else 0 for c in counts]))
            requests.append(comm.Iallgatherv(local.arrays[i], [recv, (counts, _offsets(counts))]))
        return requests

    execution = Execution([start])
    execution.outputs = outputs
    return execution


def _broadcast(comm: MPI.Intracomm, local: Local, root: int, threshold: int) -> Execution:
    """One ``Ibcast`` per tensor of :data:`PACK_BELOW` bytes or more (from its own array), and one per bucket of
    up to ``threshold`` bytes of the smaller ones, packed (the root packs, the others unpack); the same messages
    on every rank: the sizes are agreed."""
    arrays = [a for a in local.arrays if a.size]
    groups = buckets([(a, a.size) for a in arrays if a.size < PACK_BELOW], 1, threshold) if threshold > 0 else []
    packed = [g for g in groups if len(g) > 1]
    in_packed = {id(a) for g in packed for a, _ in g}
    alone = [a for a in arrays if id(a) not in in_packed]
    me = comm.Get_rank()
    bufs: list[np.ndarray] = []

    def start() -> list[MPI.Request]:
        bufs.extend(np.concatenate([a for a, _ in g if a is not None]) if me == root else
                    np.empty(sum(n for _, n in g), np.uint8) for g in packed)
        return [comm.Ibcast(a, root=root) for a in alone] + [comm.Ibcast(b, root=root) for b in bufs]

    def unpack() -> list[MPI.Request]:
        if me != root:
            for g, buf in zip(packed, bufs, strict=True):
                _unpack(buf, g)
        return []

    execution = Execution([start, unpack])
    execution.outputs = local.arrays
    return execution


def _alltoall(comm: MPI.Intracomm, response: Response, local: Local) -> Execution:
    me = comm.Get_rank()
    row = local.row_bytes[0]
    mine = response.requests[me]
    assert mine is not None
    received = [q.splits[me] if q is not None else 0 for q in response.requests]
    recv = np.empty(sum(received) * row, dtype=np.uint8)

    def start() -> list[MPI.Request]:
        send = [s * row for s in mine.splits]
        got = [s * row for s in received]
        return [comm.Ialltoallv([local.arrays[0], (send, _offsets(send))], [recv, (got, _offsets(got))])]

    execution = Execution([start])
    execution.outputs = [(recv, received)]
    return execution


def _reducescatter(comm: MPI.Intracomm, response: Response, local: Local) -> Execution:
    size, me = comm.Get_size(), comm.Get_rank()
    ref = response.reference()
    pre, post = ref.factors
    outputs: list[Any] = []
    for i, (_, shape) in enumerate(ref.entries):
        _prescale(local.arrays[i], pre)
        row = int(np.prod(shape[1:], dtype=np.int64))
        counts = [c * row for c in _slices(shape[0], size)]
        outputs.append((np.empty(counts[me], dtype=local.arrays[i].dtype), counts))

    def start() -> list[MPI.Request]:
        return [comm.Ireduce_scatter(local.arrays[i], recv, counts, op=_MPI_OPS[ref.op])
                for i, (recv, counts) in enumerate(outputs)]

    def finish() -> list[MPI.Request]:
        for recv, _ in outputs:
            _scale(recv, ref.op, size, post)
        return []

    execution = Execution([start, finish])
    execution.outputs = [recv for recv, _ in outputs]
    return execution


def _sparse(comm: MPI.Intracomm, response: Response, local: Local, executor: Executor | None) -> Execution:
    """Every rank's rows (indices and values) of a row-sparse tensor, concatenated in rank order: the core's
    :func:`~mpi_gradreducer._core.sparse.gather_rows` (blocking, on ``executor``), the counts agreed."""
    nnz = [q.splits[0] if q is not None else 0 for q in response.requests]
    indices, raw = local.arrays
    row = local.row_bytes[0]

    def work() -> list[list[Any]]:
        rows = raw.reshape(-1, row) if row else np.zeros((indices.size, 0), np.uint8)
        gathered, values = gather_rows(comm, nnz, indices, rows)
        return [[gathered, values.reshape(-1)]]

    return Blocking(work, executor)


def _objects(comm: MPI.Intracomm, response: Response, local: Local, root: int) -> Execution:
    """Pickled payloads: the root's to every rank (``root >= 0``), or every rank's to every rank."""
    sizes = [q.splits[0] if q is not None else 0 for q in response.requests]
    if root >= 0:
        buf = local.arrays[0] if comm.Get_rank() == root else np.empty(sizes[root], dtype=np.uint8)
        execution = Execution([lambda: [comm.Ibcast(buf, root=root)] if buf.size else []])
        execution.outputs = [buf]
        return execution
    recv = np.empty(sum(sizes), dtype=np.uint8)
    execution = Execution([lambda: [comm.Iallgatherv(local.arrays[0], [recv, (sizes, _offsets(sizes))])]])
    execution.outputs = [(recv, sizes)]
    return execution


def build(comm: MPI.Intracomm, response: Response, local: Local | None, root: int, threshold: int = 0,
          executor: Executor | None = None) -> Execution:
    """The execution of ``response`` on this rank (``local`` None: this rank takes part from ``join()``).

    Args:
        comm: the process set's data communicator.
        response: the agreed operation (not an error, not an allreduce: see :func:`fused`).
        local: this rank's arrays, or None in ``join()`` (barrier only).
        root: the root's rank in ``comm`` (broadcasts), or -1.
        threshold: ``HOROVOD_FUSION_THRESHOLD``: a broadcast's small tensors travel packed in buffers of up to
            this many bytes (0: each alone).
        executor: where blocking work runs (the sparse gather; None: the thread that tests the execution).
    """
    kind = response.kind
    if kind == "barrier":
        return Execution([lambda: [comm.Ibarrier()]])
    if kind in ("check", "join"):
        return Execution([])
    assert local is not None, f"{kind} from join()"
    if kind == "allgather":
        return _allgather(comm, response, local)
    if kind == "broadcast":
        return _broadcast(comm, local, root, threshold)
    if kind == "alltoall":
        return _alltoall(comm, response, local)
    if kind == "reducescatter":
        return _reducescatter(comm, response, local)
    if kind == "sparse":
        return _sparse(comm, response, local, executor)
    if kind in ("bcast_object", "gather_object"):
        return _objects(comm, response, local, root if kind == "bcast_object" else -1)
    raise AssertionError(f"unknown kind {kind!r}")
