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
