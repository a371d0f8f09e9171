"""The one place that hands gradient data to MPI."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["CHUNK_BYTES", "GATHER_MEMBERS", "SPLIT_MEAN_BYTES", "Gather", "allreduce", "cuda_support"]

#: Largest single Allreduce. MPICH's shared-memory Allreduce is markedly slower
#: per byte on messages above a few MiB, and a chunk that was just reduced is
#: still in cache when it is scaled or unpacked.
CHUNK_BYTES = 4 << 20
#: From this chunk size up, a mean is formed by reduce-scatter and allgather
#: (each rank scales only its own block); below it one Allreduce has less latency.
SPLIT_MEAN_BYTES = 256 << 10
#: Members of a host bucket from which :class:`Gather` copies them in and out
#: of its buffer (one MPI call each way) instead of one numpy copy per member.
GATHER_MEMBERS = 8


def allreduce(
    comm: MPI.Comm,
    buf: Any,
    scale: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    op: MPI.Op = MPI.SUM,
    after: Callable[[Any], None] | None = None,
) -> int:
    """Sum a 1-D contiguous buffer over ``comm`` in place, chunk by chunk.

    A mean (``scale`` != 1) of a large host chunk is formed as
    ``Reduce_scatter_block``, scaling of this rank's block (just summed, still
    in cache), ``Allgather``: each rank multiplies 1/size of the data instead
    of all of it, so the mean costs almost nothing over the sum. Other chunks
    take one ``Allreduce`` and are scaled right after it, while in cache.
    Either way the result is bitwise identical on every rank.

    Args:
        comm: the communicator.
        buf: 1-D C-contiguous array (host, or device for a CUDA-aware MPI).
        scale: factor applied to the result (1.0: none).
        chunk_bytes: bytes per collective.
        op: the MPI reduction.
        after: called with each reduced (and scaled) chunk.

    Returns:
        The number of collective calls made.
    """
    n = buf.shape[0]
    step = max(1, chunk_bytes // max(1, buf.itemsize))
    split = scale != 1.0 and op == MPI.SUM and isinstance(buf, np.ndarray) and comm.Get_size() > 1
    calls = 0
    for start in range(0, n, step):
        chunk = buf[start : start + step]
        if split and chunk.nbytes >= SPLIT_MEAN_BYTES:
            calls += _scattered_mean(comm, chunk, scale)
        else:
            calls += 1
            comm.Allreduce(MPI.IN_PLACE, chunk, op=op)
            if scale != 1.0:
                _scale(chunk, scale)
        if after is not None:
            after(chunk)
    return calls


def _scattered_mean(comm: MPI.Comm, chunk: np.ndarray, scale: float) -> int:
    """``chunk = sum over ranks * scale`` by reduce-scatter, scaling one block, allgather."""
    size, rank = comm.Get_size(), comm.Get_rank()
    block = chunk.shape[0] // size
    body = chunk[: block * size]
    comm.Reduce_scatter_block(MPI.IN_PLACE, body, op=MPI.SUM)  # this rank's block sums into body[:block]
    mine = body[rank * block : (rank + 1) * block]
    _scale(body[:block], scale, out=mine)  # disjoint for rank > 0, the same block for rank 0
    comm.Allgather(MPI.IN_PLACE, body)
    rest = chunk[block * size :]
    if rest.shape[0]:
        comm.Allreduce(MPI.IN_PLACE, rest, op=MPI.SUM)
        _scale(rest, scale)
        return 3
    return 2


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
    ``np.concatenate`` 0.36 ms (one process; docs/performance.rst).

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
    :func:`mpi_gradreducer.config.cuda_aware_default`.

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
