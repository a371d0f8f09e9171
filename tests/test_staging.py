"""The staging pipeline's schedule, on the CPU, with real MPI sums.

The copies here complete only when waited for, as asynchronous device copies
do: a schedule that reads a host slot before its copy finished, or reuses a
slot whose upload is still pending, produces wrong sums and fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, expected_mean, rank_value
from mpi_gradreducer.backend import HostOps
from mpi_gradreducer.staging import StagingPipeline


class DeferredOps(HostOps):
    """Host "device" copies that take effect only when waited for."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.issued = 0

    def to_host(self, src, dst):
        self.issued += 1
        snapshot = np.array(src, copy=True)  # the device data as of the launch
        self.pending[self.issued] = (snapshot, dst)
        return self.issued

    def to_device(self, src, dst):
        self.issued += 1
        self.pending[self.issued] = (src, dst)
        return self.issued

    def wait(self, token):
        src, dst = self.pending.pop(token)
        np.copyto(dst, src)


@pytest.mark.mpi
@pytest.mark.parametrize("sizes", [[5], [3, 4], [1000, 10, 70000, 1, 300]])
def test_staged_buffers_are_summed_and_scaled_correctly(sizes):
    ops = DeferredOps()
    events: list[tuple[str, int]] = []
    pipeline = StagingPipeline(ops, trace=lambda e, k: events.append((e, k)))
    for k0 in (1.0, 2.0):  # twice: the slots are reused
        buffers = [np.full(n, rank_value(WORLD, k0 + j), np.float64) for j, n in enumerate(sizes)]

        def reduce_host(pos, host):
            WORLD.Allreduce(MPI.IN_PLACE, host)
            host *= 1.0 / WORLD.Get_size()

        pipeline.run(buffers, reduce_host)
        assert not ops.pending, "a copy was left unwaited"
        for j, b in enumerate(buffers):
            np.testing.assert_allclose(b, expected_mean(WORLD, k0 + j))
    # The next bucket's download is issued before the current bucket's Allreduce.
    n = len(sizes)
    for k in range(n - 1):
        assert events.index(("to-host", k + 1)) < events.index(("allreduce", k))


@pytest.mark.mpi
def test_staging_slots_grow_once_and_are_reused():
    pipeline = StagingPipeline(HostOps())
    buffers = [np.ones(100), np.ones(50), np.ones(200)]
    pipeline.run(buffers, lambda pos, host: WORLD.Allreduce(MPI.IN_PLACE, host))
    slots = [s for s in pipeline._slots[np.dtype(np.float64)]]
    pipeline.run(buffers, lambda pos, host: WORLD.Allreduce(MPI.IN_PLACE, host))
    assert all(a is b for a, b in zip(slots, pipeline._slots[np.dtype(np.float64)]))
