"""Reduce device buffers through rotating pinned host buffers, overlapping packs, copies and MPI.

For an MPI library that cannot read device memory. While bucket k is summed
by MPI in host slot k % 3, bucket k+1 has just been packed and is being
copied device-to-host into the next slot, and bucket k-1's result is on its
way back to the device from the third (on a stream of its own): both copies
overlap the Allreduce and each other. Each bucket is packed just before its
download, so the first copy starts after the first pack, not after all of
them; each bucket is unpacked as soon as its upload is queued. (With two
slots, bucket k+1's download would have to wait for bucket k-1's upload to
finish, and the host would wait for every upload before the next Allreduce.)

The copies themselves are the backend's (:class:`backend.DeviceOps` on a GPU,
:class:`backend.HostOps` on the CPU, where the same schedule runs in tests).
:func:`reduce_direct` is the counterpart for a CUDA-aware MPI.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["SLOTS", "StagingPipeline", "reduce_direct"]

#: Host slots: one summed by MPI, one being filled, one being emptied.
SLOTS = 3

#: ``trace(event, bucket_position)``: called for each scheduled step, in program order.
Trace = Callable[[str, int], None]


def _nothing(position: int) -> None:
    """The default pack/unpack step: the buffer already holds the data (reduced in place)."""


class StagingPipeline:
    """Reusable host slots (:data:`SLOTS`) and the schedule that moves buckets through them.

    Args:
        ops: the backend's copy operations (``pinned``, ``to_host``,
            ``to_device``, ``wait``).
        trace: optional callable receiving ``(event, bucket_position)`` for
            each scheduled step, in program order (used by tests and timelines).
    """

    def __init__(self, ops: Any, trace: Trace | None = None) -> None:
        self._ops = ops
        self._trace = trace
        self._slots: dict[np.dtype, list[np.ndarray]] = {}

    def _slot(self, which: int, count: int, dtype: np.dtype) -> np.ndarray:
        slots = self._slots.setdefault(np.dtype(dtype), [])
        while len(slots) < SLOTS:
            slots.append(self._ops.pinned(0, dtype))
        if slots[which].size < count:  # grows to the largest bucket, once
            slots[which] = self._ops.pinned(count, dtype)
        return slots[which][:count]

    def run(
        self,
        buffers: Sequence[Any],
        reduce_host: Callable[[int, np.ndarray], None],
        pack: Callable[[int], None] = _nothing,
        unpack: Callable[[int], None] = _nothing,
    ) -> None:
        """Reduce each 1-D device buffer in place, in order, through host memory.

        For buckets 0 … n-1, with ``P`` pack, ``D`` device-to-host copy, ``A``
        the host reduction, ``U`` host-to-device copy, ``X`` unpack::

            P0 D0
            k:  [wait U(k-2)] P(k+1) D(k+1) ; wait D(k) ; A(k) ; U(k) X(k)
            end: wait the uploads not yet waited for

        Packs and unpacks are queued on the calling thread's current stream;
        a download waits (on the device) for the work queued before it, an
        unpack for its upload.

        Args:
            buffers: the device buffers, in the order their collectives are issued.
            reduce_host: ``reduce_host(position, host_view)`` sums the host copy
                in place (the MPI call); called in order of ``buffers``.
            pack: ``pack(position)`` queues the kernel that fills buffer
                ``position``; called just before its download.
            unpack: ``unpack(position)`` queues the kernel that empties buffer
                ``position``; called just after its upload is queued.
        """
        n = len(buffers)
        if n == 0:
            return
        down: list[Any] = [None] * n  # device-to-host events
        up: list[Any] = [None] * n  # host-to-device events
        down[0] = self._download(0, buffers[0], self._slot(0, buffers[0].size, buffers[0].dtype), pack)
        waited = 0  # uploads up[:waited] are known to be done
        for k in range(n):
            host = self._slot(k % SLOTS, buffers[k].size, buffers[k].dtype)
            if k + 1 < n:
                previous = k + 1 - SLOTS  # the last bucket in slot (k+1) % SLOTS: its upload must be done
                if previous >= 0:
                    self._wait("wait-up", previous, up[previous])
                    waited = previous + 1
                nxt = self._slot((k + 1) % SLOTS, buffers[k + 1].size, buffers[k + 1].dtype)
                down[k + 1] = self._download(k + 1, buffers[k + 1], nxt, pack)
            self._wait("wait-down", k, down[k])
            self._emit("allreduce", k)
            reduce_host(k, host)
            self._emit("to-device", k)
            up[k] = self._ops.to_device(host, buffers[k])
            self._emit("unpack", k)
            unpack(k)
        for k in range(waited, n):
            self._wait("wait-up", k, up[k])

    def _download(self, k: int, buf: Any, host: np.ndarray, pack: Callable[[int], None]) -> Any:
        self._emit("pack", k)
        pack(k)
        self._emit("to-host", k)
        return self._ops.to_host(buf, host)

    def _wait(self, what: str, k: int, token: Any) -> None:
        self._emit(what, k)
        self._ops.wait(token)

    def _emit(self, event: str, k: int) -> None:
        if self._trace is not None:
            self._trace(event, k)


def reduce_direct(
    ops: Any,
    buffers: Sequence[Any],
    reduce_device: Callable[[int, Any], None],
    pack: Callable[[int], None] = _nothing,
    unpack: Callable[[int], None] = _nothing,
    trace: Trace | None = None,
) -> None:
    """Reduce device buffers with a CUDA-aware MPI: pack all, one synchronisation, then MPI on each.

    MPI knows nothing of streams, so the packs must be finished before it
    reads the buffers: they are all queued first and the current stream is
    synchronised once (``ops.ready_for_mpi()``). Each buffer's unpack is
    queued right after its reduction, so that it runs while MPI sums the
    next buffer.

    Args:
        ops: the backend's operations (``ready_for_mpi``).
        buffers: the device buffers, in the order their collectives are issued.
        reduce_device: ``reduce_device(position, buffer)`` sums (and scales)
            the device buffer in place (the MPI call).
        pack: ``pack(position)`` queues the kernel that fills buffer ``position``.
        unpack: ``unpack(position)`` queues the kernel that empties it.
        trace: optional ``trace(event, position)``, as for :class:`StagingPipeline`.
    """
    emit = trace if trace is not None else (lambda event, k: None)
    for k in range(len(buffers)):
        emit("pack", k)
        pack(k)
    if buffers:
        emit("ready-for-mpi", -1)
        ops.ready_for_mpi()
    for k, buf in enumerate(buffers):
        emit("allreduce", k)
        reduce_device(k, buf)
        emit("unpack", k)
        unpack(k)
