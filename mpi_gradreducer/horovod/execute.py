"""How the data of one agreed operation moves: nonblocking MPI calls in steps, on host arrays (no torch here).

An :class:`Execution` is a list of steps; each step starts nonblocking MPI
calls (and may first compute on what the steps before received), and the
next step starts once they have all completed. The engine tests executions
without blocking, so that operations of different process sets (different
communicators) never wait for each other; within a process set they run
one at a time, in the coordinator's order, so that every rank starts the
same calls in the same order on each communicator.

Reductions: Average divides by the process set's size (a rank in
``join()`` counts, as in Horovod), integers in float64 and truncated
toward zero; ``prescale`` multiplies each rank's copy before the reduction,
``postscale`` the result. float16 sums and averages travel as float16 and
are added in float32 in rank order, then rounded once (each rank sums one
slice of every rank's tensor: ``Alltoallv``, then the slices are shared:
``Allgatherv``); bfloat16, and float16 under Min, Max or Product, are reduced
in float32. Data-moving kinds move raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .negotiation import Response

__all__ = ["Execution", "Local", "build", "wire_dtype", "NUMPY"]

#: torch dtype names and the numpy dtype of their host copies (bfloat16: reduced as float32).
NUMPY = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.float32,
         "complex64": np.complex64, "complex128": np.complex128, "int8": np.int8, "uint8": np.uint8,
         "int16": np.int16, "int32": np.int32, "int64": np.int64}
AVERAGE, SUM, MIN, MAX, PRODUCT = 0, 1, 3, 4, 5
_MPI_OPS = {AVERAGE: MPI.SUM, SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD}
Step = Callable[[], list[MPI.Request]]


def wire_dtype(dtype: str, op: int) -> np.dtype:
    """The dtype a tensor of torch dtype ``dtype`` is reduced in with ``op``."""
    if dtype == "float16" and op not in (AVERAGE, SUM):
        return np.dtype(np.float32)
    return np.dtype(NUMPY[dtype])


def half_sum(dtype: str, op: int) -> bool:
    """Whether the tensor travels as float16 and is added in float32 in rank order."""
    return dtype == "float16" and op in (AVERAGE, SUM)


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


def _offsets(counts: Sequence[int]) -> list[int]:
    return [0, *np.cumsum(counts[:-1], dtype=np.int64).tolist()] if len(counts) else []


def _slices(n: int, size: int) -> list[int]:
    """Elements of ``n`` that each rank sums (the first ``n % size`` one more)."""
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


def _half_sum(comm: MPI.Intracomm, buf: np.ndarray, scale: float, out: list[Any], index: int) -> list[Step]:
    """The two steps of a float16 sum: each rank's slice of every rank, added in float32 in rank order, shared."""
    size, me = comm.Get_size(), comm.Get_rank()
    counts = _slices(buf.size, size)
    got = np.empty((size, counts[me]), dtype=np.float16)
    result = np.empty(buf.size, dtype=np.float16)
    raw = buf.view(np.uint8)

    def exchange() -> list[MPI.Request]:
        send = [c * 2 for c in counts]
        return [comm.Ialltoallv([raw, (send, _offsets(send))],
                                [got.view(np.uint8), ([counts[me] * 2] * size, _offsets([counts[me] * 2] * size))])]

    def share() -> list[MPI.Request]:
        total = np.zeros(counts[me], dtype=np.float32)
        for r in range(size):
            total += got[r].astype(np.float32)
        if scale != 1.0:
            total *= np.float32(scale)
        mine = total.astype(np.float16)
        out[index] = result
        byte_counts = [c * 2 for c in counts]
        return [comm.Iallgatherv(mine.view(np.uint8), [result.view(np.uint8), (byte_counts, _offsets(byte_counts))])]

    return [exchange, share]


def _together(steps: list[Step]) -> Step:
    """One step that starts ``steps``'s calls."""
    return lambda: [r for step in steps for r in step()]


def _allreduce(comm: MPI.Intracomm, response: Response, local: Local | None) -> Execution:
    size = comm.Get_size()
    ref = response.reference()
    pre, post = ref.factors
    outputs: list[Any] = [None] * len(ref.entries)
    bufs = []
    for i, (dtype, shape) in enumerate(ref.entries):
        wire = wire_dtype(dtype, ref.op)
        count = int(np.prod(shape, dtype=np.int64))
        if local is None:  # in join(): the identity
            bufs.append(_identity(wire, count, ref.op))
        else:
            bufs.append(local.arrays[i])
            _prescale(bufs[-1], pre)
    halves = [i for i, (dtype, _) in enumerate(ref.entries) if half_sum(dtype, ref.op)]
    natives = [i for i in range(len(bufs)) if i not in halves]
    steps: list[Step] = []

    def start() -> list[MPI.Request]:
        requests = []
        for i in natives:
            outputs[i] = bufs[i]
            if bufs[i].size:
                requests.append(comm.Iallreduce(MPI.IN_PLACE, bufs[i], op=_MPI_OPS[ref.op]))
        return requests

    def finish() -> list[MPI.Request]:
        for i in natives:
            _scale(bufs[i], ref.op, size, post)
        return []

    steps.append(start)
    scale = (post / size) if ref.op == AVERAGE else post
    halves_steps = [_half_sum(comm, bufs[i], scale, outputs, i) for i in halves]
    for k in range(2):  # the halves' exchanges together, then their shares together
        steps.append(_together([hs[k] for hs in halves_steps]))
    steps.append(finish)
    execution = Execution(steps)
    execution.outputs = outputs
    return execution


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


def _broadcast(comm: MPI.Intracomm, response: Response, local: Local, root: int) -> Execution:
    def start() -> list[MPI.Request]:
        return [comm.Ibcast(a, root=root) for a in local.arrays if a.size]

    execution = Execution([start])
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


def _sparse(comm: MPI.Intracomm, response: Response, local: Local) -> Execution:
    """Every rank's rows (indices and values) of a row-sparse tensor, concatenated in rank order."""
    nnz = [q.splits[0] if q is not None else 0 for q in response.requests]
    row = local.row_bytes[0]
    indices = np.empty(sum(nnz), dtype=np.int64)
    values = np.empty(sum(nnz) * row, dtype=np.uint8)

    def start() -> list[MPI.Request]:
        value_counts = [n * row for n in nnz]
        return [comm.Iallgatherv(local.arrays[0], [indices, (nnz, _offsets(nnz))]),
                comm.Iallgatherv(local.arrays[1], [values, (value_counts, _offsets(value_counts))])]

    execution = Execution([start])
    execution.outputs = [indices, values]
    return execution


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


def build(comm: MPI.Intracomm, response: Response, local: Local | None, root: int) -> Execution:
    """The execution of ``response`` on this rank (``local`` None: this rank takes part from ``join()``).

    Args:
        comm: the process set's data communicator.
        response: the agreed operation (not an error).
        local: this rank's arrays, or None in ``join()`` (allreduce and barrier only).
        root: the root's rank in ``comm`` (broadcasts), or -1.
    """
    kind = response.kind
    if kind == "allreduce":
        return _allreduce(comm, response, local)
    if kind == "barrier":
        return Execution([lambda: [comm.Ibarrier()]])
    if kind in ("check", "join"):
        return Execution([])
    assert local is not None, f"{kind} from join()"
    if kind == "allgather":
        return _allgather(comm, response, local)
    if kind == "broadcast":
        return _broadcast(comm, response, local, root)
    if kind == "alltoall":
        return _alltoall(comm, response, local)
    if kind == "reducescatter":
        return _reducescatter(comm, response, local)
    if kind == "sparse":
        return _sparse(comm, response, local)
    if kind in ("bcast_object", "gather_object"):
        return _objects(comm, response, local, root if kind == "bcast_object" else -1)
    raise AssertionError(f"unknown kind {kind!r}")
