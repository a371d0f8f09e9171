"""Reduce device buffers through rotating pinned host buffers, overlapping copies and MPI.

For an MPI library that cannot read device memory. While bucket k is summed
by MPI in host slot k % 3, bucket k+1 is already being copied device-to-host
into the next slot, and bucket k-1's result is on its way back to the device
from the third: both copies overlap the Allreduce. (With two slots, bucket
k+1's download would have to wait for bucket k-1's upload to finish, and the
host would wait for every upload before the next Allreduce.)
The copies themselves are the backend's (:class:`backend.DeviceOps` on a GPU,
:class:`backend.HostOps` on the CPU, where the same schedule runs in tests).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["SLOTS", "StagingPipeline"]

#: Host slots: one summed by MPI, one being filled, one being emptied.
SLOTS = 3


class StagingPipeline:
    """Reusable host slots (:data:`SLOTS`) and the schedule that moves buckets through them.

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
        while len(slots) < SLOTS:
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
        waited = 0  # uploads up[:waited] are known to be done
        for k in range(n):
            host = self._slot(k % SLOTS, buffers[k].size, buffers[k].dtype)
            if k + 1 < n:
                previous = k + 1 - SLOTS  # the last bucket in slot (k+1) % SLOTS: its upload must be done
                if previous >= 0:
                    self._wait("wait-up", previous, up[previous])
                    waited = previous + 1
                nxt = self._slot((k + 1) % SLOTS, buffers[k + 1].size, buffers[k + 1].dtype)
                down[k + 1] = self._to_host(k + 1, buffers[k + 1], nxt)
            self._wait("wait-down", k, down[k])
            self._emit("allreduce", k)
            reduce_host(k, host)
            self._emit("to-device", k)
            up[k] = self._ops.to_device(host, buffers[k])
        for k in range(waited, n):
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
