"""``mpi_gradreducer.horovod``'s engine: asynchronous handles, names, join, process sets, Horovod's error types.

Collective tests (``mpiexec -n 4`` and ``-n 3``, ``--only-mpi``; some at
size 1 too). Where a test needs one rank to act before or after the others,
the order is made with messages on ``MPI.COMM_WORLD`` (which the engine does
not use), never with sleeps; every wait on such a message has a deadline.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks

SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
LAST = SIZE - 1
TAG = 4242
DEADLINE = 60.0


def _tell(dest: int, value: object = True) -> None:
    WORLD.send(value, dest=dest, tag=TAG)


def _hear(source: int) -> object:
    """A message from ``source``, or a failure after the deadline (never a hang)."""
    request = WORLD.irecv(source=source, tag=TAG)
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE:
        done, value = request.test()
        if done:
            return value
        time.sleep(0.001)
    request.Cancel()
    raise AssertionError(f"rank {RANK}: no message from rank {source} within {DEADLINE} s")


def _until(condition, what: str) -> None:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < DEADLINE, f"rank {RANK}: {what} within {DEADLINE} s"
        time.sleep(0.001)


# -- asynchronous handles -----------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_poll_is_false_until_every_rank_has_called(hvd, torch):
    """Rank 0's handle stays in flight while the others have not called; then completes without synchronize."""
    x = torch.full((1000,), float(RANK + 1), dtype=torch.float64)
    if RANK == 0:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="late")
        assert not hvd.poll(handle)
        time.sleep(0.2)
        assert not hvd.poll(handle)  # the others have not called: nothing can have completed
        for r in range(1, SIZE):
            _tell(r)
    else:
        _hear(0)
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="late")
    _until(lambda: hvd.poll(handle), "the allreduce completed while the caller did not call in")
    assert hvd.synchronize(handle).tolist() == [SIZE * (SIZE + 1) / 2] * 1000
    assert hvd.synchronize(handle).tolist() == [SIZE * (SIZE + 1) / 2] * 1000  # a second time: the same result


@pytest.mark.mpi(min_size=2)
def test_many_handles_in_flight_and_in_place(hvd, torch):
    tensors = [torch.full((17,) * (1 + k % 3), float(RANK + k)) for k in range(12)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum) if k % 2 else hvd.allreduce_async(t, op=hvd.Sum)
               for k, t in enumerate(tensors)]
    gathers = [hvd.allgather_async(torch.full((RANK + 1, 2), RANK, dtype=torch.int16)) for _ in range(3)]
    assert not all(hvd.poll(h) for h in handles + gathers)
    for k, (t, h) in enumerate(zip(tensors, handles, strict=True)):
        out = hvd.synchronize(h)
        expected = sum(r + k for r in range(SIZE))
        assert float(out.max()) == float(out.min()) == expected
        if k % 2:
            assert out is t
    for h in gathers:
        assert hvd.synchronize(h)[:, 0].tolist() == [r for r in range(SIZE) for _ in range(r + 1)]


@pytest.mark.mpi(min_size=2)
def test_operations_match_by_name_in_any_order(hvd, torch):
    names = ["first", "second", "third"]
    order = names if RANK % 2 == 0 else names[::-1]
    handles = {n: hvd.allreduce_async(torch.full((3,), float(names.index(n) + RANK)), op=hvd.Sum, name=n)
               for n in order}
    for n in names:
        assert hvd.synchronize(handles[n]).tolist() == [sum(names.index(n) + r for r in range(SIZE))] * 3


@pytest.mark.mpi(min_size=2)
def test_duplicate_name_in_flight_raises_on_this_rank_only(hvd, torch):
    """Horovod's pattern: a second operation under a name in flight raises ValueError there; nothing is sent."""
    x = torch.ones(4)
    if RANK != LAST:  # the last rank has not called yet: the first operation cannot complete
        first = hvd.allreduce_async(x, name="duplicate")
        with pytest.raises(ValueError, match=r"name='duplicate' is already in flight"):
            hvd.allreduce_async(x, name="duplicate")
        with pytest.raises(ValueError, match=r"already in flight"):
            hvd.allgather_async(x, name="duplicate")  # another kind, the same name
    hvd.barrier()  # matched by count, while 'duplicate' waits for the last rank
    if RANK == LAST:
        first = hvd.allreduce_async(x, name="duplicate")
    assert hvd.synchronize(first).tolist() == [1.0] * 4
    assert hvd.synchronize(hvd.allreduce_async(x, name="duplicate")).tolist() == [1.0] * 4  # free again


@pytest.mark.mpi(min_size=2)
def test_barrier_with_operations_in_flight(hvd, torch):
    b = hvd.broadcast_async(torch.eye(3) * RANK, root_rank=LAST)
    g = hvd.allgather_async(torch.eye(5))
    a = hvd.allreduce_async(torch.eye(5))
    hvd.barrier()
    assert torch.equal(hvd.synchronize(a), torch.eye(5))
    assert torch.equal(hvd.synchronize(b), torch.eye(3) * LAST)
    assert hvd.synchronize(g).shape == (5 * SIZE, 5)


# -- Horovod's error types ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_error_types_are_horovods_here_only(hvd, torch):
    """Ranks that disagree: HorovodInternalError (a RuntimeError) here; the numpy API keeps its ValueError."""
    from mpi_gradreducer import DistributedGradReducer

    handle = hvd.allreduce_async(torch.zeros(2 + (RANK == LAST)))
    with pytest.raises(hvd.HorovodInternalError, match=r"the ranks disagree"):
        hvd.synchronize(handle)
    with pytest.raises(RuntimeError, match=r"the ranks disagree"):
        hvd.broadcast(torch.zeros(3), root_rank=RANK)  # every rank its own root
    with pytest.raises(RuntimeError, match=r"the ranks disagree"):
        hvd.alltoall(torch.zeros(SIZE, 1 + (RANK == 0)))
    with pytest.raises(NotImplementedError, match=r"op=Adasum"):  # a RuntimeError too, as Horovod's tests expect
        hvd.reducescatter(torch.zeros(SIZE), op=hvd.Adasum)
    with pytest.raises(ValueError, match=r"the ranks disagree") as info:  # the package's own API: unchanged
        DistributedGradReducer([np.zeros(2 + (RANK == LAST), np.float32)])
    assert not isinstance(info.value, RuntimeError)


# -- join ------------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=3)  # a pair of ranks that is not the global set (Horovod refuses a duplicate)
def test_join_serves_allreduce_and_barrier_and_refuses_the_rest(hvd, torch):
    pair = hvd.add_process_set([0, LAST])
    if RANK == 0:
        assert hvd.join() == LAST
    else:
        others = range(1, SIZE)
        x = torch.full((5,), float(RANK), dtype=torch.float64)
        assert hvd.allreduce(x).tolist() == [sum(others) / SIZE] * 5  # an average still divides by every rank
        assert hvd.allreduce(x, op=hvd.Sum, name="named").tolist() == [sum(others)] * 5
        assert hvd.allreduce(x, op=hvd.Min).tolist() == [1.0] * 5  # rank 0 adds the identity of each op
        assert hvd.allreduce(x, op=hvd.Max).tolist() == [LAST] * 5
        assert hvd.allreduce(x, op=hvd.Product).tolist() == [float(np.prod(list(others)))] * 5
        ints = hvd.allreduce(torch.full((3,), RANK, dtype=torch.int32), op=hvd.Min)
        assert ints.dtype == torch.int32 and ints.tolist() == [1] * 3
        half = hvd.allreduce(torch.full((4,), float(RANK), dtype=torch.float16), op=hvd.Sum)
        assert half.dtype == torch.float16 and half.tolist() == [sum(others)] * 4
        grouped = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
        assert [g.tolist() for g in grouped] == [[sum(others)] * 5, [2 * sum(others)] * 5]
        hvd.barrier()
        if RANK == LAST:  # rank 0 takes part in its process sets too
            assert hvd.allreduce(x, op=hvd.Sum, process_set=pair).tolist() == [LAST] * 5
        refused = [lambda: hvd.allgather(x), lambda: hvd.broadcast(x, root_rank=1), lambda: hvd.alltoall(x[:0]),
                   lambda: hvd.reducescatter(x), lambda: hvd.broadcast_object(1, root_rank=1),
                   lambda: hvd.allgather_object(RANK), lambda: hvd.synchronize(hvd.allgather_async(x, name="n"))]
        for call in refused:
            with pytest.raises(hvd.HorovodInternalError, match=r"cannot run while ranks \[0\] are in hvd.join\(\)"):
                call()
        if RANK != LAST:
            assert hvd.join() == LAST
        else:
            assert hvd.allreduce(x, op=hvd.Sum).tolist() == [LAST] * 5  # every other rank has joined: they serve it
            assert hvd.join() == LAST
    # every rank counted the unnamed operations of the join: they match again
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]
    assert hvd.allgather_object(RANK) == list(range(SIZE))
    assert hvd.remove_process_set(pair)


@pytest.mark.mpi(min_size=2)
def test_join_twice_in_a_row_and_no_collective(hvd, torch):
    for _ in range(2):
        assert 0 <= hvd.join() < SIZE
    values = hvd.allgather_object(hvd.join())
    assert len(set(values)) == 1


# -- process sets ------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_process_sets_restrict_every_collective(hvd, torch):
    evens = [r for r in range(SIZE) if r % 2 == 0]
    odds = [r for r in range(SIZE) if r % 2 == 1]
    even, odd = hvd.add_process_set(evens), hvd.add_process_set(hvd.ProcessSet(odds))
    mine, ranks = (even, evens) if RANK % 2 == 0 else (odd, odds)
    me = ranks.index(RANK)
    assert (mine.size(), mine.rank(), mine.included()) == (len(ranks), me, True)
    other = odd if mine is even else even
    assert other.included() is False and other.size() == SIZE - len(ranks)
    with pytest.raises(ValueError, match=rf"rank {RANK} is not part of"):
        other.rank()
    with pytest.raises(ValueError, match=rf"hvd.allreduce: process_set: rank {RANK} is not in"):
        hvd.allreduce(torch.zeros(1), process_set=other)  # this rank only: nothing was sent
    x = torch.full((3,), float(RANK), dtype=torch.float64)
    assert hvd.allreduce(x, op=hvd.Sum, process_set=mine).tolist() == [sum(ranks)] * 3
    assert hvd.allreduce(x, process_set=mine).tolist() == [sum(ranks) / len(ranks)] * 3
    assert [g.tolist() for g in hvd.grouped_allreduce([x, x], op=hvd.Max, process_set=mine)] == [[max(ranks)] * 3] * 2
    gathered = hvd.allgather(torch.full((RANK + 1, 2), RANK), process_set=mine)
    assert gathered[:, 0].tolist() == [r for r in ranks for _ in range(r + 1)]
    root = ranks[-1]  # a global rank, as in Horovod
    assert hvd.broadcast(x, root_rank=root, process_set=mine).tolist() == [root] * 3
    out, received = hvd.alltoall(torch.arange(len(ranks)).float() + 10 * RANK, splits=[1] * len(ranks),
                                 process_set=mine)
    assert out.tolist() == [10 * r + me for r in ranks] and received.tolist() == [1] * len(ranks)
    scattered = hvd.reducescatter(torch.ones(2 * len(ranks)) * (RANK + 1), op=hvd.Sum, process_set=mine)
    assert scattered.tolist() == [sum(r + 1 for r in ranks)] * 2
    assert hvd.broadcast_object(("from", root), root_rank=root, process_set=mine) == ("from", root)
    assert hvd.allgather_object(RANK, process_set=mine) == ranks
    hvd.barrier(process_set=mine)
    with pytest.raises(ValueError, match=r"root_rank: expected a rank in"):
        hvd.broadcast(x, root_rank=other.ranks[0], process_set=mine)  # every rank of the set: the same error
    assert not hvd.remove_process_set(hvd.global_process_set)
    assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
    assert even.process_set_id is None and not hvd.remove_process_set(even)
    with pytest.raises(ValueError, match=r"is not registered"):
        hvd.allreduce(x, process_set=even)


@pytest.mark.mpi(min_size=3)  # the last rank alone and ranks 1.. differ (Horovod refuses a duplicate)
def test_process_set_barrier_does_not_wait_for_the_others(hvd, torch):
    """Rank 0 waits for a message from the last rank, sent after the last rank's own set passed its barrier."""
    alone = hvd.add_process_set([LAST])
    pair = hvd.add_process_set(list(range(1, SIZE)))
    if RANK == 0:
        assert _hear(LAST) == "passed"
    else:
        hvd.barrier(pair)  # without rank 0
        if RANK == LAST:
            hvd.barrier(alone)
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=alone).tolist() == [1.0]
            _tell(0, "passed")
    hvd.barrier()
    assert hvd.remove_process_set(pair) and hvd.remove_process_set(alone)


@pytest.mark.mpi(min_size=2)
def test_adding_process_sets_raises_on_every_rank(hvd, torch):
    with pytest.raises(ValueError, match=rf"expected distinct ranks in \[0, {LAST}\], got \[0, {SIZE}\]"):
        hvd.add_process_set([0, SIZE])
    with pytest.raises(RuntimeError, match=r"the ranks disagree"):
        hvd.add_process_set([LAST] if RANK == 0 else [0])
    with pytest.raises(ValueError, match=r"expected a list of ranks"):
        hvd.ProcessSet("01")
    first = hvd.add_process_set([0])
    with pytest.raises(ValueError, match=r"a process set of ranks \[0\] exists already"):
        hvd.add_process_set([0])
    with pytest.raises(NotImplementedError, match=r"can only be given to hvd.init"):
        hvd.add_process_set(hvd.ProcessSet(WORLD))
    assert hvd.remove_process_set(first)


@pytest.mark.mpi(min_size=3)  # [0, last] is not the global set (Horovod refuses a duplicate)
def test_init_with_process_sets(hvd, torch):
    hvd.shutdown()
    sub = WORLD.Split(0 if RANK >= 1 else MPI.UNDEFINED, RANK)
    listed, made = hvd.ProcessSet([0, LAST]), hvd.ProcessSet(sub if sub != MPI.COMM_NULL else MPI.COMM_NULL)
    hvd.init(process_sets=[listed, made])
    try:
        assert listed.ranks == [0, LAST] and made.ranks == list(range(1, SIZE))
        if RANK in (0, LAST):
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=listed).tolist() == [2.0]
        if RANK >= 1:
            assert hvd.allgather_object(RANK, process_set=made) == list(range(1, SIZE))
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
        hvd.shutdown()
        hvd.init()
    assert hvd.size() == SIZE


@pytest.mark.mpi(min_size=4)
def test_optimizer_over_a_process_set(hvd, torch):
    """Even ranks average their gradients; odd ranks make the optimizer too and step alone (as in Horovod)."""
    even = hvd.add_process_set([r for r in range(SIZE) if r % 2 == 0])
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   process_set=even)
    g = torch.Generator().manual_seed(RANK)
    net(torch.randn(4, 3, generator=g, dtype=torch.float64)).square().sum().backward()
    local = [p.grad.clone().numpy() for p in net.parameters()]
    opt.step()
    gathered = WORLD.allgather(local)
    members = [r for r in range(SIZE) if r % 2 == 0]
    for i, p in enumerate(net.parameters()):
        expected = np.mean([gathered[r][i] for r in members], axis=0) if RANK % 2 == 0 else local[i]
        np.testing.assert_allclose(p.grad.numpy(), expected, rtol=1e-13, atol=1e-15)
    opt.free()
    assert hvd.remove_process_set(even)


@pytest.mark.mpi(min_size=4)
def test_join_takes_part_in_optimizer_steps(hvd, torch):
    """Rank 0 runs out of data first: hvd.join() takes part in the others' steps and hvd collectives."""
    torch.manual_seed(1)
    net = torch.nn.Linear(4, 1).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), named_parameters=net.named_parameters())
    steps = 1 if RANK == 0 else 3
    for s in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * s + RANK)
        net(torch.randn(5, 4, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()
        if s == 2:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [SIZE - 1]  # rank 0 adds zero
    last = hvd.join()
    assert last != 0
    assert_same_on_all_ranks(WORLD, [p.detach().numpy() for p in net.parameters()])
    opt.free()
