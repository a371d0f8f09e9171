"""The staging pipeline's schedule, on the CPU, with real MPI sums.

The "device" here is host memory driven like a GPU: three streams (the
caller's current stream, a device-to-host and a host-to-device copy stream),
each a queue of operations that runs only when something waits for it, in
order, after the events it waits for. Packs and unpacks are queued on the
current stream, as kernels are. Nothing runs earlier than a real GPU could run
it, and everything as late as possible: a schedule that downloads a bucket
before it is packed, reads a host slot before its copy finished, refills a
slot whose upload is still pending, or hands MPI unfinished data produces
wrong sums and fails.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, expected_mean, rank_value
from mpi_gradreducer._core.backend import HostOps
from mpi_gradreducer._core.staging import StagingPipeline, reduce_direct

Event = tuple[str, int]


class StreamOps(HostOps):
    """Host "device" operations on three lazily run streams (see the module docstring)."""

    def __init__(self) -> None:
        self.queues: dict[str, list[tuple[Callable[[], None], list[Event]]]] = {"current": [], "d2h": [], "h2d": []}
        self.done = {name: 0 for name in self.queues}

    def _enqueue(self, stream: str, fn: Callable[[], None], after: list[Event]) -> Event:
        self.queues[stream].append((fn, after))
        return stream, len(self.queues[stream])

    def _run_to(self, event: Event) -> None:
        stream, index = event
        while self.done[stream] < index:
            fn, after = self.queues[stream][self.done[stream]]
            for e in after:
                self._run_to(e)
            fn()
            self.done[stream] += 1

    def current(self) -> Event:
        return "current", len(self.queues["current"])

    def launch(self, fn: Callable[[], None]) -> None:
        """A kernel on the current stream."""
        self._enqueue("current", fn, [])

    def synchronize(self) -> None:
        for stream in self.queues:
            self._run_to((stream, len(self.queues[stream])))

    def pending(self) -> int:
        return sum(len(q) - self.done[s] for s, q in self.queues.items())

    def to_host(self, src, dst):
        return self._enqueue("d2h", lambda: np.copyto(dst, src), [self.current()])

    def to_device(self, src, dst):
        done = self._enqueue("h2d", lambda: np.copyto(dst, src), [])
        self._enqueue("current", lambda: None, [done])  # the current stream waits for the upload
        return done

    def wait(self, token):
        self._run_to(token)

    def ready_for_mpi(self):
        self._run_to(self.current())


def _allreduce_mean(pos: int, buf: np.ndarray) -> None:
    WORLD.Allreduce(MPI.IN_PLACE, buf)
    buf *= 1.0 / WORLD.Get_size()


def _members(sizes: list[int], k0: float) -> list[np.ndarray]:
    return [np.full(n, rank_value(WORLD, k0 + j), np.float64) for j, n in enumerate(sizes)]


SIZES = [[5], [3, 4], [1000, 10, 70000, 1, 300]]


@pytest.mark.mpi
@pytest.mark.parametrize("sizes", SIZES)
def test_staged_buffers_are_packed_summed_scaled_and_unpacked_correctly(sizes):
    ops = StreamOps()
    events: list[tuple[str, int]] = []
    pipeline = StagingPipeline(ops, trace=lambda e, k: events.append((e, k)))
    buffers = [np.zeros(n) for n in sizes]  # the "device" fusion buffers
    for k0 in (1.0, 2.0):  # twice: the slots and buffers are reused
        events.clear()
        members = _members(sizes, k0)

        def pack(pos: int, members: list[np.ndarray] = members) -> None:
            ops.launch(partial(np.copyto, buffers[pos], members[pos]))

        def unpack(pos: int, members: list[np.ndarray] = members) -> None:
            ops.launch(partial(np.copyto, members[pos], buffers[pos]))

        pipeline.run(buffers, _allreduce_mean, pack, unpack)
        ops.synchronize()  # what the caller's next read of its arrays on the current stream does
        for j, m in enumerate(members):
            np.testing.assert_allclose(m, expected_mean(WORLD, k0 + j))
    n = len(sizes)
    assert [e for e in events if e[0] == "pack"] == [("pack", k) for k in range(n)]
    assert [e for e in events if e[0] == "unpack"] == [("unpack", k) for k in range(n)]
    for k in range(n):
        i = events.index(("pack", k))
        assert events[i + 1] == ("to-host", k), "a bucket is downloaded right after its pack"
        j = events.index(("to-device", k))
        assert events[j + 1] == ("unpack", k), "a bucket is unpacked right after its upload is queued"
    # The first copy starts after the first pack, not after every pack.
    assert events[:2] == [("pack", 0), ("to-host", 0)]
    for k in range(n - 1):
        # the next bucket is packed and downloaded while this one is summed ...
        assert events.index(("to-host", k + 1)) < events.index(("allreduce", k))
        # ... and not earlier than one bucket ahead
        assert events.index(("pack", k + 1)) > events.index(("to-host", k))
    for k in range(2, n - 1):
        # a slot is refilled only after its previous upload is done
        assert events.index(("wait-up", k - 2)) < events.index(("to-host", k + 1))
    assert ops.pending() == 0


@pytest.mark.mpi
def test_a_schedule_that_downloads_before_packing_is_caught():
    """The check above can fail: with every pack queued after the downloads, the sums are wrong."""
    ops = StreamOps()
    sizes = [7, 9, 11]
    buffers = [np.zeros(n) for n in sizes]
    members = _members(sizes, 1.0)
    late: list[int] = []
    StagingPipeline(ops).run(buffers, _allreduce_mean, pack=late.append,  # packs not queued yet
                             unpack=lambda pos: ops.launch(partial(np.copyto, members[pos], buffers[pos])))
    for pos in late:
        ops.launch(lambda pos=pos: np.copyto(buffers[pos], members[pos]))
    ops.synchronize()
    assert not any(np.allclose(m, expected_mean(WORLD, 1.0 + j)) for j, m in enumerate(members))


@pytest.mark.mpi
def test_staging_slots_grow_once_and_are_reused():
    pipeline = StagingPipeline(HostOps())
    buffers = [np.ones(100), np.ones(50), np.ones(200)]
    pipeline.run(buffers, lambda pos, host: WORLD.Allreduce(MPI.IN_PLACE, host))
    slots = [s for s in pipeline._slots[np.dtype(np.float64)]]
    pipeline.run(buffers, lambda pos, host: WORLD.Allreduce(MPI.IN_PLACE, host))
    assert all(a is b for a, b in zip(slots, pipeline._slots[np.dtype(np.float64)], strict=True))


@pytest.mark.mpi
@pytest.mark.parametrize("sizes", SIZES)
def test_direct_path_packs_all_then_synchronises_once_then_reduces_and_unpacks(sizes):
    ops = StreamOps()
    events: list[tuple[str, int]] = []
    buffers = [np.zeros(n) for n in sizes]
    members = _members(sizes, 3.0)

    def pack(pos: int) -> None:
        ops.launch(partial(np.copyto, buffers[pos], members[pos]))

    def unpack(pos: int) -> None:
        ops.launch(partial(np.copyto, members[pos], buffers[pos]))

    # MPI reads the "device" buffers directly: only what ready_for_mpi() ran is there.
    reduce_direct(ops, buffers, _allreduce_mean, pack, unpack, trace=lambda e, k: events.append((e, k)))
    ops.synchronize()
    for j, m in enumerate(members):
        np.testing.assert_allclose(m, expected_mean(WORLD, 3.0 + j))
    n = len(sizes)
    assert events[: n + 1] == [("pack", k) for k in range(n)] + [("ready-for-mpi", -1)]
    assert events[n + 1:] == [e for k in range(n) for e in (("allreduce", k), ("unpack", k))]
