"""Groups of ranks and the first step of data-parallel training."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agreement, backend
from .dtypes import digest
from .topology import Topology

__all__ = ["LocalRank", "create_group", "broadcast_parameters", "local_rank", "local_size", "select_device"]


def create_group(ranks: Sequence[int], comm: MPI.Intracomm | None = None) -> MPI.Intracomm | None:
    """A communicator of the given ranks of ``comm`` (collective over ``comm``).

    Every rank of ``comm`` calls it with the same ``ranks``; the listed ranks
    get the new communicator, in the listed order, and the others get None.

    Args:
        ranks: distinct ranks of ``comm``.
        comm: the parent; default ``MPI.COMM_WORLD``.

    Returns:
        The new intracommunicator on members, None elsewhere. Free it with
        ``Free()`` when done.

    Raises:
        ValueError: on every rank, if ``ranks`` is invalid on any rank or
            differs between ranks.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    size = comm.Get_size()
    error = None
    members: list[int] = []
    try:
        members = [int(r) for r in ranks]
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in ranks):
            raise TypeError(f"ranks: expected ints, got {list(ranks)!r}")
        if not members:
            raise ValueError("ranks: expected at least one rank, got none")
        if len(set(members)) != len(members) or not all(0 <= r < size for r in members):
            raise ValueError(f"ranks: expected distinct ranks in [0, {size - 1}], got {members}")
    except (TypeError, ValueError) as exc:
        error = exc
    agreement.raise_if_any(comm, error, checks=(digest(members),))
    whole = comm.Get_group()
    chosen = whole.Incl(members)
    try:
        new = comm.Create(chosen)
    finally:
        chosen.Free()
        whole.Free()
    if new == MPI.COMM_NULL:
        return None
    assert isinstance(new, MPI.Intracomm)  # as made from an intracommunicator (mpi4py's stubs say Comm)
    return new


def broadcast_parameters(arrays: Sequence[Any], root: int = 0, group: MPI.Intracomm | None = None) -> Sequence[Any]:
    """Copy rank ``root``'s arrays into every rank's arrays, in place (collective).

    Device (cupy) arrays travel through host memory, so that any MPI library
    will do: each is copied to the host after the work queued on the current
    stream, broadcast, and written back before this returns.

    Args:
        arrays: numpy or cupy arrays of the same shapes and dtypes on every rank.
        root: the rank whose values everyone takes.
        group: the communicator; default ``MPI.COMM_WORLD``.

    Returns:
        ``arrays`` itself.

    Raises:
        ValueError, TypeError: on every rank, if any rank's arrays are not
            writeable arrays, or shapes/dtypes differ between ranks.
    """
    comm = MPI.COMM_WORLD if group is None else group
    error = None
    rows: list[tuple[int, ...]] = []
    try:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < comm.Get_size():
            raise ValueError(f"root: expected a rank in [0, {comm.Get_size() - 1}], got {root!r}")
        for i, a in enumerate(arrays):
            if backend.device_of(a) is None:
                raise TypeError(f"arrays[{i}]: expected an array, got {type(a).__name__}")
            if not getattr(a.flags, "writeable", True):  # cupy arrays have no such flag: always writeable
                raise ValueError(f"arrays[{i}] is read-only, but it is written in place")
            rows.append((digest([np.dtype(a.dtype).str]), a.ndim, *a.shape))
    except (TypeError, ValueError) as exc:
        error = exc
    agreement.raise_if_any(comm, error, checks=(int(root),))
    agreement.check_same(comm, rows, lambda i, r: f"shape {tuple(r[2:])} (dtype code {r[0]})", lambda i: f"arrays[{i}]")
    for a in arrays:
        if not backend.is_host(backend.device_of(a)):
            host = backend.to_numpy(a)
            comm.Bcast(host, root=root)
            backend.copy_from_host(a, host)
            continue
        flat = backend.flat_view(a)
        if flat is not None:
            comm.Bcast(flat, root=root)
        else:
            tmp = np.ascontiguousarray(a)
            comm.Bcast(tmp, root=root)
            a[...] = tmp
    return arrays


class LocalRank(int):
    """The int that :func:`local_rank` returns; unpacking it as ``(rank, size)``, its form before 0.8, still works.

    That unpacking warns (``DeprecationWarning``): use ``local_rank()`` and
    :func:`local_size`.
    """

    size: int

    def __new__(cls, rank: int, size: int) -> LocalRank:
        made = super().__new__(cls, rank)
        made.size = size
        return made

    def __iter__(self) -> Iterator[int]:
        warnings.warn("local_rank() returns an int since 0.8: unpacking it as (rank, size) is deprecated; use "
                      "local_rank() and local_size()", DeprecationWarning, stacklevel=2)
        return iter((int(self), self.size))


def local_rank(comm: MPI.Intracomm | None = None) -> int:
    """This rank's index among the ranks of ``comm`` on the same host (collective; hosts as ``Topology`` finds them).

    Args:
        comm: the ranks; default ``MPI.COMM_WORLD``.

    Returns:
        The local rank, from 0 (an int; ``rank, size = local_rank()``, the
        form before 0.8, still unpacks, with a ``DeprecationWarning``).
    """
    topology = Topology.of(MPI.COMM_WORLD if comm is None else comm)
    return LocalRank(topology.local_rank, topology.local_size)


def local_size(comm: MPI.Intracomm | None = None) -> int:
    """How many ranks of ``comm`` share this rank's host (collective).

    Args:
        comm: the ranks; default ``MPI.COMM_WORLD``.
    """
    return Topology.of(MPI.COMM_WORLD if comm is None else comm).local_size


def select_device(comm: MPI.Intracomm | None = None) -> int:
    """Make GPU ``local_rank % device_count`` cupy's current device (collective).

    Ranks on one node spread over its GPUs; with more ranks than GPUs, several
    ranks share one.

    Returns:
        The device id chosen.

    Raises:
        RuntimeError: when cupy is not installed or sees no GPU.
    """
    rank = int(local_rank(comm))
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or a CUDA runtime error without a GPU
        raise RuntimeError(f"select_device: no usable GPU ({exc})") from exc
    if count == 0:
        raise RuntimeError("select_device: no usable GPU (cupy sees 0 devices)")
    device = rank % count
    cupy.cuda.Device(device).use()
    return device
