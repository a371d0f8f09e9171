"""The one place that hands gradient data to MPI."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

__all__ = [
    "CHUNK_BYTES", "CHUNK_BYTES_ACROSS_HOSTS", "GATHERED_SUM_BYTES", "GATHER_MEMBERS", "SPLIT_MEAN_BYTES",
    "Exchange", "Gather", "OrderedSum", "Summer", "allreduce", "cuda_support",
]

#: Largest single Allreduce. MPICH's shared-memory Allreduce is markedly slower
#: per byte on messages above a few MiB, and a chunk that was just reduced is
#: still in cache when it is scaled or unpacked.
CHUNK_BYTES = 4 << 20
#: The chunk size where the ranks span several hosts: every collective then
#: crosses a link, and at 1 Gbit/s smaller chunks keep it busier (ResNet-50,
#: 4 ranks, the mean's chunk sweep: 1 MiB within 0.3 % of the best chunk at
#: 2 hosts x 2 ranks and the best at 4 x 1, where 4 MiB was 13 % slower).
CHUNK_BYTES_ACROSS_HOSTS = 1 << 20
#: From this chunk size up, a mean is summed by :class:`OrderedSum` (each rank
#: sums and scales one slice); below it one Allreduce has less latency.
SPLIT_MEAN_BYTES = 256 << 10
#: Chunks up to this size are summed in rank order by gathering them whole on
#: every rank (one collective); larger ones one slice per rank (two).
GATHERED_SUM_BYTES = 128 << 10
#: Members of a host bucket from which :class:`Gather` copies them in and out
#: of its buffer (one MPI call each way) instead of one numpy copy per member.
GATHER_MEMBERS = 8
#: What sums a host chunk in place across ranks, times a scale, and returns the collectives it made
#: (an :class:`OrderedSum`, or a :class:`~mpi_gradreducer._core.compression.CastSum`).
Summer = Callable[[np.ndarray, float], int]


def allreduce(
    comm: MPI.Comm,
    buf: Any,
    scale: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    op: MPI.Op = MPI.SUM,
    after: Callable[[Any], None] | None = None,
    ordered: Summer | None = None,
    every_chunk: bool = False,
) -> int:
    """Sum a 1-D contiguous buffer over ``comm`` in place, chunk by chunk.

    A mean (``scale`` != 1) of a large host chunk is summed in rank order by
    :class:`OrderedSum` (each rank sums one slice, scales it while it is in
    cache, and the slices are shared): each rank multiplies 1/size of the
    data, and the process's memory stays flat (MPICH's
    ``Reduce_scatter_block`` grows it with every call). With ``every_chunk``
    every chunk is summed so, whatever its size: each element is then
    ``((g0 + g1) + g2) + ...`` whatever the chunk boundaries. Other chunks
    take one ``Allreduce`` and are scaled right after it, while in cache.
    Either way the result is bitwise identical on every rank.

    Args:
        comm: the communicator.
        buf: 1-D C-contiguous array (host, or device for a CUDA-aware MPI).
        scale: factor applied to the result (1.0: none).
        chunk_bytes: bytes per collective.
        op: the MPI reduction.
        after: called with each reduced (and scaled) chunk.
        ordered: the summer of ``buf``'s dtype on ``comm`` (rank order, or
            two levels, or 16 bits across hosts: a :data:`Summer`; its scratch
            buffers are reused); a rank-order one is made for this call when needed and None.
        every_chunk: sum every chunk in rank order (host buffers, ``MPI.SUM``).

    Returns:
        The number of collective calls made.
    """
    n = buf.shape[0]
    step = max(1, chunk_bytes // max(1, buf.itemsize))
    host_sum = op == MPI.SUM and isinstance(buf, np.ndarray) and comm.Get_size() > 1
    split = host_sum and (every_chunk or scale != 1.0)
    least = 0 if every_chunk else SPLIT_MEAN_BYTES
    calls = 0
    for start in range(0, n, step):
        chunk = buf[start : start + step]
        if split and chunk.nbytes >= least:
            if ordered is None:
                ordered = OrderedSum(comm, buf.dtype, chunk_bytes)
            calls += ordered(chunk, scale)
        else:
            calls += 1
            comm.Allreduce(MPI.IN_PLACE, chunk, op=op)
            if scale != 1.0:
                _scale(chunk, scale)
        if after is not None:
            after(chunk)
    return calls


class Exchange:
    """The summers' data movement over ``comm``: blocking calls, or nonblocking ones that ``wait`` completes.

    The bytes moved are the same either way (``wait``: e.g. :meth:`.Polling.wait`, the communication
    thread's way of waiting without taking the training thread's core).
    """

    def __init__(self, comm: MPI.Comm, wait: Callable[[MPI.Request], None] | None = None) -> None:
        self.comm, self.wait = comm, wait

    def alltoall(self, send: Any, recv: Any) -> None:
        """``Alltoall(send, recv)``."""
        if self.wait is None:
            self.comm.Alltoall(send, recv)
        else:
            self.wait(self.comm.Ialltoall(send, recv))

    def allgather(self, send: Any, recv: Any) -> None:
        """``Allgather(send, recv)`` (``send`` may be ``MPI.IN_PLACE``)."""
        if self.wait is None:
            self.comm.Allgather(send, recv)
        else:
            self.wait(self.comm.Iallgather(send, recv))

    def complete(self, request: MPI.Request) -> None:
        """Return when ``request`` (a nonblocking call of this exchange's) has completed."""
        if self.wait is None:
            request.Wait()
        else:
            self.wait(request)


class OrderedSum:
    """Sums host chunks of one dtype across ``comm`` in rank order, ``((g0 + g1) + g2) + ...``, then scales.

    Each element's sum is formed by one rank, adding every rank's value in
    rank order in the chunk's dtype, and scaled there; so the result does not
    depend on chunk boundaries, message sizes or the MPI library, and is the
    same on every rank. A chunk of up to :data:`GATHERED_SUM_BYTES` is
    gathered whole on every rank (one ``Allgather``) and summed there; a
    larger one is cut into one equal block per rank (``Alltoall``), each rank
    sums its block, and the blocks are shared (``Allgather``); the last
    ``n % size`` elements, if any, are gathered whole. Scratch buffers are
    kept for the next chunk.

    Two levels (``across``): ``comm`` holds the ranks of one host, and each
    rank's sum of its block over the host is then summed with the other
    hosts' by ``across`` (the summer of the ranks with the same place on every
    host), which also scales it, before the blocks are shared on the host.
    Every element is then ``(host 0's sum + host 1's sum) + ...``, each host's
    in rank order, whatever the chunks; and each host sends
    ``2 (hosts - 1) / hosts`` of the bytes, as a ring does.

    Args:
        comm: the communicator (with ``across``: the ranks of one host).
        dtype: the chunks' dtype (float or complex).
        chunk_bytes: the largest chunk that will come (sizes the scratch buffers).
        across: the summer of the hosts' sums (an :class:`OrderedSum`, or a
            :class:`~mpi_gradreducer._core.compression.CastSum`), or None (``comm`` is all the ranks).
        wait: completes the nonblocking data movement (see :class:`Exchange`); None: blocking calls.
    """

    def __init__(self, comm: MPI.Comm, dtype: Any, chunk_bytes: int = CHUNK_BYTES,
                 across: Summer | None = None, wait: Callable[[MPI.Request], None] | None = None) -> None:
        self.comm = comm
        self._moves = Exchange(comm, wait)
        self.across = across
        self.dtype = np.dtype(dtype)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._type = dtlib.from_numpy_dtype(self.dtype)
        self._step = max(1, chunk_bytes // self.dtype.itemsize)
        self._scratch = np.empty(0, self.dtype)

    def __call__(self, chunk: np.ndarray, scale: float = 1.0) -> int:
        """Sum ``chunk`` (1-D, contiguous) across ranks in place, times ``scale``; returns the collectives made."""
        n, size = chunk.shape[0], self.size
        if n == 0:
            return 0
        if size == 1:
            if self.across is not None:
                return self.across(chunk, scale)
            if scale != 1.0:
                _scale(chunk, scale)
            return 0
        if chunk.nbytes <= GATHERED_SUM_BYTES or n < size:
            return self._gathered(chunk, scale)
        block = n // size
        body = chunk[: block * size]  # equal blocks: MPICH's Allgatherv is far slower than its Allgather
        recv = self._rows(size * block)
        self._moves.alltoall([body, self._type], [recv, self._type])
        calls = 2 + self._sum(recv.reshape(size, block), body[self.rank * block : (self.rank + 1) * block], scale)
        self._moves.allgather(MPI.IN_PLACE, [body, self._type])
        if body.shape[0] == n:
            return calls
        return calls + self._gathered(chunk[body.shape[0] :], scale)  # the last n % size elements

    def _gathered(self, chunk: np.ndarray, scale: float) -> int:
        """Sum ``chunk`` whole on every rank, from one ``Allgather`` of it."""
        n = chunk.shape[0]
        rows = self._rows(self.size * n).reshape(self.size, n)
        self._moves.allgather([chunk, self._type], [rows, self._type])
        return 1 + self._sum(rows, chunk, scale)

    def _sum(self, rows: np.ndarray, out: np.ndarray, scale: float) -> int:
        """``out`` = the rows summed in rank order (then across the hosts), times ``scale``; the collectives made."""
        if self.across is None:
            _sum_rows(rows, out, scale)
            return 0
        _sum_rows(rows, out, 1.0)
        return self.across(out, scale)

    def reduce_scatter(self, chunk: np.ndarray, counts: Sequence[int], displs: Sequence[int], out: np.ndarray) -> int:
        """``out`` = this rank's slice of ``chunk`` (``counts[rank]`` elements from ``displs[rank]``), summed
        over the ranks in rank order; returns the collectives made.

        MPICH's own ``Reduce_scatter`` grows the process's memory with every call, as its
        ``Reduce_scatter_block`` does.
        """
        size, mine = self.size, counts[self.rank]
        recv = self._rows(size * mine)
        self.comm.Alltoallv([chunk, (list(counts), list(displs)), self._type],
                            [recv, ([mine] * size, [r * mine for r in range(size)]), self._type])
        if size == 1:
            np.copyto(out, recv)
        else:
            _sum_rows(recv.reshape(size, mine), out, 1.0)
        return 1

    def _rows(self, count: int) -> np.ndarray:
        if self._scratch.shape[0] < count:
            gathered = self.size * max(1, GATHERED_SUM_BYTES // self.dtype.itemsize)
            sliced = self.size * -(-self._step // self.size)
            self._scratch = np.empty(max(count, gathered, sliced), self.dtype)
        return self._scratch[:count]


def _sum_rows(rows: np.ndarray, out: np.ndarray, scale: float) -> None:
    """``out = (((rows[0] + rows[1]) + rows[2]) + ...) * scale``, in ``out``'s dtype."""
    np.add(rows[0], rows[1], out=out)
    for r in range(2, rows.shape[0]):
        np.add(out, rows[r], out=out)
    if scale != 1.0:
        _scale(out, scale)


def _scale(a: Any, scale: float, out: Any = None) -> None:
    """``out = a * scale`` (in place by default); complex values component-wise: (inf+0j) stays (inf+0j)."""
    out = a if out is None else out
    if a.dtype.kind == "c":
        a, out = a.view(a.real.dtype), out.view(out.real.dtype)
    np.multiply(a, scale, out=out)


class Gather:
    """Copies a bucket's host members into its contiguous buffer, and back, in one MPI call each way.

    An ``hindexed`` datatype over the members' absolute addresses is built
    for each call's members and moved by ``Sendrecv`` on a private duplicate
    of ``COMM_SELF``; it is kept for the next call only when both calls pass
    the same *epoch*: the members are then proven the same objects with the
    same data pointers, shapes and strides (:class:`~.replay.Replay`), so that
    it still covers their memory. For 1000 arrays of 4 KiB MPICH takes
    0.17 ms each way where ``np.copyto`` per member takes 0.73 ms and
    ``np.concatenate`` 0.36 ms (one process; CHANGELOG.rst, 0.3.0).

    Args:
        local: a duplicate of ``COMM_SELF`` for the reducer's local copies.
        tag: the bucket's tag on ``local`` (taken modulo 32768, the least upper bound MPI guarantees).
    """

    def __init__(self, local: MPI.Intracomm, tag: int) -> None:
        self._local, self._tag = local, tag % 32768
        self._epoch: int | None = None
        self._type: MPI.Datatype | None = None

    def pack(self, members: Sequence[Any], buffer: np.ndarray, epoch: int | None = None) -> bool:
        """Copy ``members`` (in order, back to back) into ``buffer``; False (nothing done) when they cannot be.

        ``epoch``: the members are the armed gradients of this replay epoch
        (None: nothing is known of them).
        """
        dt = self._datatype(members, buffer, epoch)
        if dt is None:
            return False
        self._local.Sendrecv([MPI.BOTTOM, 1, dt], 0, self._tag, [buffer, MPI.BYTE], 0, self._tag)
        return True

    def unpack(self, buffer: np.ndarray, members: Sequence[Any], just_packed: bool = False) -> bool:
        """Copy ``buffer`` back into ``members``; False (nothing done) when they cannot be.

        ``just_packed``: the caller vouches that ``members`` are what the last
        successful :meth:`pack` copied, in the same call, so they are not looked at again.
        """
        dt = self._type if just_packed else self._datatype(members, buffer, None)
        if dt is None:
            return False
        self._local.Sendrecv([buffer, MPI.BYTE], 0, self._tag, [MPI.BOTTOM, 1, dt], 0, self._tag)
        return True

    def free(self) -> None:
        """Release the datatype (it is rebuilt when needed)."""
        if self._type is not None:
            self._type.Free()
        self._type, self._epoch = None, None

    def _datatype(self, members: Sequence[Any], buffer: np.ndarray, epoch: int | None) -> MPI.Datatype | None:
        """The datatype over ``members``, or None unless they are C-contiguous numpy arrays filling ``buffer``."""
        if epoch is not None and epoch == self._epoch:
            return self._type  # the same arrays, where they were (None: they cannot be gathered)
        self.free()
        self._epoch = epoch
        if not all(type(g) is np.ndarray and g.flags.c_contiguous for g in members):
            return None
        sizes = [g.nbytes for g in members]
        if sum(sizes) != buffer.nbytes or any(g.base is not None and np.may_share_memory(g, buffer) for g in members):
            return None  # a member that lies in the buffer itself is copied by numpy
        self._type = MPI.BYTE.Create_hindexed(sizes, [MPI.Get_address(g) for g in members]).Commit()
        return self._type


def cuda_support() -> tuple[bool | None, str]:
    """Whether the loaded MPI library accepts CUDA device buffers, and how we know.

    The MPI library is asked through ctypes: ``MPIX_GPU_query_support``
    (MPICH) or ``MPIX_Query_cuda_support`` (Open MPI and MPICH). The
    environment variable that overrides the answer is read by
    :func:`mpi_gradreducer._core.options.cuda_aware_default`.

    Returns:
        ``(answer, source)``: answer is None when nothing could tell.
    """
    for lib in _loaded_mpi_libraries():
        query = getattr(lib, "MPIX_GPU_query_support", None)
        if query is not None:
            flag = ctypes.c_int(0)
            if query(0, ctypes.byref(flag)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
                return bool(flag.value), "MPIX_GPU_query_support(CUDA)"
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            return bool(query()), "MPIX_Query_cuda_support()"
    return None, "the MPI library offers no query"


def _loaded_mpi_libraries() -> list[ctypes.CDLL]:
    """The MPI shared libraries mapped into this process (Linux), else the global namespace."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                name = os.path.basename(path)
                if name.startswith(("libmpi.", "libmpi_", "libmpich")) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    libs = []
    candidates: list[str | None] = [*paths] if paths else [None]  # None: the process's own symbols
    for candidate in candidates:
        try:
            libs.append(ctypes.CDLL(candidate))
        except OSError:
            continue
    return libs
