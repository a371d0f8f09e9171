"""``mpi_gradreducer.torch``: the DistributedOptimizer against DDP (a whole job), misuse, join, state, clipping.

The comparison with ``DistributedDataParallel`` over gloo runs as one MPI
job of 4 ranks in a subprocess with a hard time limit (``tests/jobs/torch_ddp.py``:
every case in one job, since torch jobs are slow to start). The rest runs
collectively under ``mpiexec -n 4`` only: misuse on one rank must raise the
same error on every rank, and leave the optimizer usable. (The first torch
optimizer made in a process imports ``torch._dynamo``, 5 s on this machine:
the tests run in one of the suite's three runs; they skip, on every rank
alike, in the others.)
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from conftest import HAS_TORCH, WORLD, assert_same_on_all_ranks, run_job

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
JOB = os.path.join(ROOT, "tests", "jobs", "torch_ddp.py")
JOB_LIMIT = 300
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def dt(torch):
    """The module under test."""
    import mpi_gradreducer.torch as module

    return module


def _net(torch, seed: int = 0, width: int = 4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)).double()


def _backward(torch, net, step: int = 0) -> None:
    g = torch.Generator().manual_seed(100 * step + WORLD.Get_rank())
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    net(x).square().mean().backward()


def _params(net) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in net.parameters()]


# -- against DDP (one job) ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_matches_ddp_over_gloo():
    """Overlap, unused parameters, accumulation (two ways) and clipping: 4 ranks, float64, 20 steps."""
    proc = run_job(JOB, "--steps", "20", limit=JOB_LIMIT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = {m[0]: (float(m[1]), float(m[2]), float(m[3])) for m in
             re.findall(r"case=(\w+) max_difference=(\S+) moved=(\S+) never_moved=(\S+)", proc.stdout)}
    assert set(cases) == {"overlap", "unused", "accumulate", "no_sync", "clip"}, proc.stdout
    for name, (difference, moved, never) in cases.items():
        assert difference <= TOLERANCE, (name, proc.stdout)
        assert moved > 1e-3, (name, proc.stdout)  # every used parameter was trained
        assert never == 0.0, (name, proc.stdout)  # a parameter no rank used: .grad None, momentum left it alone


# -- collective tests ---------------------------------------------------------------------------


@pytest.mark.mpi(min_size=4)
def test_steps_average_and_keep_bucket_views(torch, dt):
    net = _net(torch)
    dt.broadcast_parameters(net)
    with dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5)) as opt:
        for step in range(3):
            opt.zero_grad(set_to_none=step == 1)
            _backward(torch, net, step)
            local = [p.grad.clone() for p in net.parameters()]
            opt.step()
            expected = [WORLD.allreduce(g.numpy()) / WORLD.Get_size() for g in local]
            for p, e in zip(net.parameters(), expected, strict=True):
                np.testing.assert_allclose(p.grad.numpy(), e, rtol=1e-13, atol=1e-15)
            assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(net.parameters(), opt._grads, strict=True))
        assert opt.synchronized is False
        assert "SGD" in repr(opt) and opt.param_groups is opt.optimizer.param_groups
    assert_same_on_all_ranks(WORLD, _params(net))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("progress", ["deferred", "thread"])
@pytest.mark.parametrize("misuse", ["second backward", "written in place", "no backward", "added parameter",
                                    "backward after synchronize"])
def test_misuse_on_one_rank_raises_on_every_rank(torch, dt, misuse, progress):
    net = _net(torch)
    dt.broadcast_parameters(net)
    culprit = WORLD.Get_size() - 1
    here = WORLD.Get_rank() == culprit
    extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), progress=progress) as opt:
        before = _params(net)
        opt.zero_grad()
        if not (here and misuse == "no backward"):
            _backward(torch, net)
        if here and misuse == "second backward":
            _backward(torch, net, 1)
        if here and misuse == "written in place":
            net[0].weight.grad.mul_(2)
        if here and misuse == "added parameter":
            opt.optimizer.add_param_group({"params": [extra]})
        expected = {"second backward": r"param_groups\[0\]\['params'\]\[\d\]: its gradient was computed more than "
                                       r"backward_passes_per_step=1 times",
                    "written in place": r"param_groups\[0\]\['params'\]\[0\]: its gradient was written after its "
                                        r"hook fired",
                    "no backward": r"without a backward pass since the last step\(\)",
                    "added parameter": r"the optimizer has 5 parameters, but DistributedOptimizer was made with 4",
                    "backward after synchronize": r"its gradient was computed after synchronize\(\) and before step"}
        with pytest.raises(RuntimeError, match=rf"^rank {culprit}: .*{expected[misuse]}"):
            if misuse == "backward after synchronize":
                opt.synchronize()
                if here:
                    _backward(torch, net, 1)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        for a, b in zip(before, _params(net), strict=True):  # nothing stepped
            np.testing.assert_array_equal(a, b)
        if here and misuse == "added parameter":
            opt.optimizer.param_groups.pop()
        # usable afterwards, on every rank
        opt.zero_grad()
        _backward(torch, net, 2)
        opt.step()
    assert_same_on_all_ranks(WORLD, _params(net))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("progress", ["deferred", "thread"])
def test_step_inside_skip_synchronize_without_synchronize_raises(torch, dt, progress):
    """Every rank steps without reducing: refused (the models would part), in either progress mode."""
    net = _net(torch)
    dt.broadcast_parameters(net)
    with dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), progress=progress) as opt:
        before = _params(net)
        opt.zero_grad()
        _backward(torch, net)
        with pytest.raises(RuntimeError, match=r"inside skip_synchronize\(\) after a backward pass that was not "
                                               r"reduced"), opt.skip_synchronize():
            opt.step()
        for a, b in zip(before, _params(net), strict=True):  # nothing stepped
            np.testing.assert_array_equal(a, b)
        opt.synchronize()  # usable afterwards
        with opt.skip_synchronize():
            opt.step()
    assert_same_on_all_ranks(WORLD, _params(net))


@pytest.mark.mpi(min_size=4)
def test_different_models_raise_on_every_rank(torch, dt):
    net = _net(torch, width=5 if WORLD.Get_rank() == 1 else 4)
    theirs = r"is shape \(4, 3\) float64 on cpu at rank 0 but shape \(5, 3\) float64 on cpu at rank 1"
    with pytest.raises(ValueError, match=rf"the ranks disagree: parameter '0.weight' {theirs}"):
        dt.broadcast_parameters(net)
    with pytest.raises(ValueError, match=rf"the ranks disagree: param_groups\[0\]\['params'\]\[0\] {theirs}"):
        dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))


@pytest.mark.mpi(min_size=4)
def test_bad_arguments_and_added_groups(torch, dt):
    net = _net(torch)
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer"):
        dt.DistributedOptimizer(net)
    with pytest.raises(ValueError, match="backward_passes_per_step: expected an int >= 1, got 0"):
        dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match=r"skip: expected 4 bools"):
        dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), skip=[False])
    with dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1)) as opt:
        with pytest.raises(ValueError, match="cannot take parameters added later"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        with pytest.raises(ValueError, match="closures are not supported"):
            opt.step(lambda: 0.0)
        with pytest.raises(RuntimeError, match="call opt.synchronize"):
            dt.clip_grad_norm_(opt, 1.0)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("progress", ["deferred", "thread"])
def test_join_averages_over_the_ranks_that_step(torch, dt, progress):
    """Rank r has r + 1 batches; loss = c . p with c = rank + 1: each step moves p by the contributors' mean c."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with dt.DistributedOptimizer(torch.optim.SGD([p], lr=1.0, momentum=0.5), progress=progress) as opt:
        for _ in range(rank + 1):
            opt.zero_grad()
            (p * (rank + 1.0)).sum().backward()
            opt.step()
        assert opt.join() == size - 1
        assert opt.reducer.contributors == 0
    # momentum 0.5 over the means of c over ranks s..size-1 at step s
    buf, value = 0.0, 0.0
    for s in range(size):
        g = float(np.mean([r + 1.0 for r in range(s, size)]))
        buf = g if s == 0 else 0.5 * buf + g
        value -= buf
    np.testing.assert_allclose(p.detach().numpy(), value, rtol=1e-14)
    assert_same_on_all_ranks(WORLD, [p.detach().numpy()])


@pytest.mark.mpi(min_size=4)
def test_optimizer_state_and_buffers_come_from_rank_0(torch, dt):
    rank = WORLD.Get_rank()
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            t.fill_(rank + 1)
    dt.broadcast_parameters(net)
    assert_same_on_all_ranks(WORLD, [t.detach().numpy() for t in [*net.parameters(), *net.buffers()]])
    inner = torch.optim.Adam(net.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:  # only rank 0 has stepped: its state exists, the others' does not yet
        net(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        inner.step()
    with dt.DistributedOptimizer(inner) as opt:
        dt.broadcast_optimizer_state(opt)
        state = opt.state_dict()
        assert state["param_groups"][0]["lr"] == 0.01
        assert len(state["state"]) == 4
        assert_same_on_all_ranks(WORLD, [v.numpy() for s in state["state"].values() for v in s.values()])
        opt.load_state_dict(state)


@pytest.mark.mpi(min_size=4)
def test_clip_grad_norm_of_a_shard_is_that_of_the_whole(torch, dt):
    from mpi_gradreducer import DistributedGradReducer

    rng = np.random.default_rng(WORLD.Get_rank())
    shapes = [(30, 7), (5,), (64,), (3, 3)]
    grads = [rng.standard_normal(s) for s in shapes]
    with DistributedGradReducer([np.zeros(s) for s in shapes]) as reducer:
        whole = [g.copy() for g in grads]
        reducer(whole)
        norm = float(np.sqrt(sum(np.sum(g * g) for g in whole)))
        biggest = max(float(np.abs(g).max()) for g in whole)
        shard = reducer.reduce_scatter(grads)
        assert dt.clip_grad_norm_(shard, norm / 2) == pytest.approx(norm, rel=1e-12)
        for piece in shard:
            expected = whole[piece.index].reshape(-1)[piece.start : piece.stop] * (norm / 2) / (norm + 1e-6)
            np.testing.assert_allclose(piece.grad, expected, rtol=1e-12)
        shard = reducer.reduce_scatter(grads)
        assert dt.clip_grad_norm_(shard, 10 * biggest, norm_type=float("inf")) == biggest
    with pytest.raises(TypeError, match="expected a DistributedOptimizer or a Shard"):
        dt.clip_grad_norm_([], 1.0)
