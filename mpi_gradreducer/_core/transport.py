"""Where gradient data is handed to MPI: the summers' data movement, the buckets' MPI copies, CUDA-awareness."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["CHUNK_BYTES", "CHUNK_BYTES_ACROSS_HOSTS", "GATHER_MEMBERS", "Exchange", "Gather", "cuda_support"]

#: Largest single collective. MPICH's shared-memory Allreduce is markedly slower
#: per byte on messages above a few MiB, and a chunk that was just reduced is
#: still in cache when it is scaled or unpacked.
CHUNK_BYTES = 4 << 20
#: The chunk size where the ranks span several hosts: every collective then
#: crosses a link, and smaller chunks keep it busier (the sweep that chose it:
#: ``docs/performance.rst``, "The constants").
CHUNK_BYTES_ACROSS_HOSTS = 1 << 20
#: Members of a host bucket from which :class:`Gather` copies them in and out
#: of its buffer (one MPI call each way) instead of one numpy copy per member.
GATHER_MEMBERS = 8


class Exchange:
    """The summers' data movement over ``comm``: blocking calls, or nonblocking ones that ``wait`` completes.

    The bytes moved are the same either way (``wait``: e.g. :meth:`.Polling.wait`, the communication
    thread's way of waiting without taking the training thread's core).
    """

    def __init__(self, comm: MPI.Comm, wait: Callable[[MPI.Request], None] | None = None) -> None:
        self.comm, self.wait = comm, wait

    def allreduce(self, buf: Any, op: MPI.Op = MPI.SUM) -> None:
        """``Allreduce(IN_PLACE, buf, op)`` (always blocking: it is the chunk loop's plain sum)."""
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=op)

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


class Gather:
    """Copies a bucket's host members into its contiguous buffer, and back, in one MPI call each way.

    An ``hindexed`` datatype over the members' absolute addresses is built
    for each call's members and moved by ``Sendrecv`` on a private duplicate
    of ``COMM_SELF``. It serves the next call too when both calls pass the
    same *epoch*: the members are then proven the same objects with the same
    data pointers, shapes and strides (:class:`~.replay.Replay`), so that it
    still covers their memory, and nothing is looked at. Without an epoch it
    serves a call whose members and buffer lie at the same addresses with the
    same sizes: a datatype is no more than those. One C call moves many
    members faster than a numpy copy each (``CHANGELOG.rst``, 0.3.0).

    Args:
        local: a duplicate of ``COMM_SELF`` for the reducer's local copies.
        tag: the bucket's tag on ``local`` (taken modulo 32768, the least upper bound MPI guarantees).
    """

    def __init__(self, local: MPI.Intracomm, tag: int) -> None:
        self._local, self._tag = local, tag % 32768
        self._epoch: int | None = None
        self._type: MPI.Datatype | None = None
        self._key: tuple[Any, ...] = ()  # the buffer's and members' addresses and sizes that _type covers

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
        self._type, self._epoch, self._key = None, None, ()

    def _datatype(self, members: Sequence[Any], buffer: np.ndarray, epoch: int | None) -> MPI.Datatype | None:
        """The datatype over ``members``, or None unless they are C-contiguous numpy arrays filling ``buffer``."""
        if epoch is not None and epoch == self._epoch:
            return self._type  # the same arrays, where they were (None: they cannot be gathered)
        if not all(type(g) is np.ndarray and g.flags.c_contiguous for g in members):
            self.free()
            return None
        sizes = [g.nbytes for g in members]
        addresses = [MPI.Get_address(g) for g in members]
        key = (MPI.Get_address(buffer), buffer.nbytes, addresses, sizes)
        if epoch is None and self._type is not None and key == self._key:
            return self._type  # the same memory as the last call's (whichever objects)
        self.free()
        self._epoch = epoch
        if sum(sizes) != buffer.nbytes or any(g.base is not None and np.may_share_memory(g, buffer) for g in members):
            return None  # a member that lies in the buffer itself is copied by numpy
        self._type = MPI.BYTE.Create_hindexed(sizes, addresses).Commit()
        self._key = key
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
