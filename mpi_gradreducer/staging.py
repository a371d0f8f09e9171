"""Reduce device buffers through double-buffered host buffers, overlapping copies and MPI.

For an MPI library that cannot read device memory. While bucket k is summed
by MPI in host slot k % 2, bucket k+1 is already being copied device-to-host
into the other slot, and bucket k-1's result is on its way back to the device.
The copies themselves are the backend's (:class:`backend.DeviceOps` on a GPU,
:class:`backend.HostOps` on the CPU, where the same schedule runs in tests).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["StagingPipeline"]


class StagingPipeline:
    """Two reusable host slots and the schedule that moves buckets through them.

    Args:
        ops: the backend's copy operations (``pinned``, ``to_host``,
            ``to_device``, ``wait``).
        trace: optional callable receiving ``(event, bucket_position)`` for
            each scheduled step, in program order (used by tests and timelines).
    """

    def __init__(self, ops: Any, trace: Optional[Callable[[str, int], None]] = None) -> None:
        self._ops = ops
        self._trace = trace
        self._slots: dict[np.dtype, list[np.ndarray]] = {}

    def _slot(self, which: int, count: int, dtype: np.dtype) -> np.ndarray:
        slots = self._slots.setdefault(np.dtype(dtype), [])
        while len(slots) < 2:
            slots.append(self._ops.pinned(0, dtype))
        if slots[which].size < count:  # grows to the largest bucket, once
            slots[which] = self._ops.pinned(count, dtype)
        return slots[which][:count]

    def run(self, buffers: Sequence[Any], reduce_host: Callable[[int, np.ndarray], None]) -> None:
        """Reduce each 1-D device buffer in place, in order, through host memory.

        Args:
            buffers: the device buffers, in the order their collectives are issued.
            reduce_host: ``reduce_host(position, host_view)`` sums the host copy
                in place (the MPI call); called in order of ``buffers``.
        """
        n = len(buffers)
        if n == 0:
            return
        down: list[Any] = [None] * n  # device-to-host events
        up: list[Any] = [None] * n  # host-to-device events
        down[0] = self._to_host(0, buffers[0], self._slot(0, buffers[0].size, buffers[0].dtype))
        for k in range(n):
            host = self._slot(k % 2, buffers[k].size, buffers[k].dtype)
            if k + 1 < n:
                if k >= 1:  # slot (k+1) % 2 was bucket k-1's: its upload must be done
                    self._wait("wait-up", k - 1, up[k - 1])
                nxt = self._slot((k + 1) % 2, buffers[k + 1].size, buffers[k + 1].dtype)
                down[k + 1] = self._to_host(k + 1, buffers[k + 1], nxt)
            self._wait("wait-down", k, down[k])
            self._emit("allreduce", k)
            reduce_host(k, host)
            self._emit("to-device", k)
            up[k] = self._ops.to_device(host, buffers[k])
        for k in range(max(0, n - 2), n):
            self._wait("wait-up", k, up[k])

    def _to_host(self, k: int, buf: Any, host: np.ndarray) -> Any:
        self._emit("to-host", k)
        return self._ops.to_host(buf, host)

    def _wait(self, what: str, k: int, token: Any) -> None:
        self._emit(what, k)
        self._ops.wait(token)

    def _emit(self, event: str, k: int) -> None:
        if self._trace is not None:
            self._trace(event, k)
