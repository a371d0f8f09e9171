"""The seams that elastic recovery uses, public on every rebuildable object: ``communicators()``,
``abandon()`` and ``rebuild(comm)``, over real MPI (a reducer moved from the world to the even or odd ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD
from mpi_gradreducer import DistributedGradReducer, Options
from mpi_gradreducer.elastic import Rebuildable

pytestmark = pytest.mark.mpi


def _half() -> MPI.Intracomm:
    """The even or the odd ranks of the world, as this rank's communicator (collective)."""
    return WORLD.Split(WORLD.Get_rank() % 2, key=WORLD.Get_rank())


def _members(comm: MPI.Intracomm) -> list[int]:
    return comm.allgather(WORLD.Get_rank())


@pytest.mark.parametrize("progress", ["deferred", "thread"])
def test_a_rebuilt_reducer_averages_over_its_new_ranks_with_its_options(progress):
    params = [np.zeros((300, 200), np.float32), np.zeros(7, np.float64), np.zeros((3, 3), np.float32)]
    reducer = DistributedGradReducer(params, options=Options(bucket_bytes=4096, progress=progress))
    old = reducer.communicators()
    assert old[0] is reducer.comm and len({c.py2f() for c in old}) == len(old)
    assert all(c != MPI.COMM_NULL for c in old)
    options = reducer.options
    half = _half()
    reducer.rebuild(half)
    assert all(c == MPI.COMM_NULL for c in old), "the old communicators must be released"
    assert reducer.options == options and reducer.comm.Get_size() == half.Get_size()
    assert reducer.degree == half.Get_size()  # a degree never given follows the new size
    for k in (1.0, 3.0):
        grads = [np.full(p.shape, WORLD.Get_rank() + k, p.dtype) for p in params]
        reducer(grads)
        for g in grads:
            np.testing.assert_allclose(g, np.mean(_members(half)) + k, rtol=1e-6)
    assert isinstance(reducer, Rebuildable)
    reducer.free()
    assert reducer.communicators() == []
    half.Free()


def test_an_abandoned_reducer_holds_no_communicator_and_frees_quietly():
    reducer = DistributedGradReducer([np.zeros(5)])
    held = reducer.communicators()
    reducer.abandon()
    assert all(c == MPI.COMM_NULL for c in held)
    assert reducer.communicators() == []
    reducer.abandon()  # idempotent
    reducer.free()


def test_an_explicit_degree_stays_the_divisor_after_a_rebuild():
    reducer = DistributedGradReducer([np.zeros(4)], degree=10)
    half = _half()
    reducer.rebuild(half)
    grads = [np.ones(4)]
    reducer(grads)
    np.testing.assert_allclose(grads[0], half.Get_size() / 10)
    reducer.free()
    half.Free()


def test_rebuild_refuses_what_is_no_intracommunicator():
    reducer = DistributedGradReducer([np.zeros(3)])
    with pytest.raises(TypeError, match="group: expected an mpi4py intracommunicator"):
        reducer.rebuild(MPI.COMM_NULL)
    grads = [np.full(3, float(WORLD.Get_rank()))]
    reducer(grads)  # untouched: still over the world
    np.testing.assert_allclose(grads[0], (WORLD.Get_size() - 1) / 2)
    reducer.free()


def test_a_rebuilt_torch_optimizer_keeps_its_model_state_and_hooks():
    torch = pytest.importorskip("torch")
    from mpi_gradreducer.torch import DistributedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2, dtype=torch.float64)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), bucket_bytes=64)
    x = torch.full((3, 4), float(WORLD.Get_rank() + 1), dtype=torch.float64)
    model(x).sum().backward()
    opt.step()
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    old = opt.communicators()
    half = _half()
    opt.rebuild(half)
    assert all(c == MPI.COMM_NULL for c in old) and opt.comm.Get_size() == half.Get_size()
    kept = zip(model.parameters(), momentum, strict=True)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in kept)
    opt.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    mean_input = np.mean([r + 1 for r in _members(half)])
    np.testing.assert_allclose(model.weight.grad.numpy(), np.full((2, 4), 3 * mean_input))  # d(sum)/dW = sum of rows
    opt.step()
    opt.free()
    half.Free()


def test_powersgd_keeps_its_iteration_q_and_each_ranks_error_through_a_rebuild():
    from mpi_gradreducer import PowerSGD

    rng = np.random.default_rng([3, WORLD.Get_rank()])
    params = [np.zeros((64, 48), np.float32), np.zeros(5, np.float32)]
    reducer = DistributedGradReducer(params, compression=PowerSGD(rank=2, start_iter=0, min_compression_rate=1))
    for _ in range(3):
        reducer([rng.standard_normal(p.shape).astype(np.float32) for p in params])
    before = reducer.state_dict()
    assert any(np.any(e != 0) for e in before["error"].values()), "the error feedback should hold something"
    half = _half()
    reducer.rebuild(half)
    after = reducer.state_dict()
    assert after["iteration"] == before["iteration"] == 3
    for i in before["q"]:
        assert np.array_equal(after["q"][i], before["q"][i])
        assert np.array_equal(after["error"][i].view(np.uint32), before["error"][i].view(np.uint32))
    grads = [np.full(p.shape, float(WORLD.Get_rank()), np.float32) for p in params]
    reducer(grads)  # and it still reduces, over the half
    np.testing.assert_allclose(grads[1], np.mean(_members(half)))
    reducer.free()
    half.Free()


def test_an_auto_bucket_size_stays_chosen_through_a_rebuild():
    shapes = [(200_000,)] * 12 + [(7, 7)]  # 800 KB each, below the in-place size: caps of 512 KiB to 16 MiB differ
    params = [np.zeros(s, np.float32) for s in shapes]
    reducer = DistributedGradReducer(params, bucket_bytes="auto")
    grads = [np.ones(s, np.float32) for s in shapes]
    layouts = []
    for _ in range(30):
        reducer(grads)
        layouts.append([b.indices for b in reducer.buckets])
    assert len({str(layout) for layout in layouts[:10]}) > 1, "the tuning should try several plans"
    assert layouts[-1] == layouts[-8], "the tuning should have finished within 22 calls"
    chosen = layouts[-1]
    half = _half()
    reducer.rebuild(half)
    for _ in range(12):  # a reducer tuning afresh would try the other caps in these calls
        reducer(grads)
        assert [b.indices for b in reducer.buckets] == chosen
    reducer.free()
    half.Free()
