"""``mpi_gradreducer.horovod``: gradients through the collectives, sparse tensors, ``SyncBatchNorm``, the
timeline, and the optimizer's Horovod behaviours (its warning, parameter names, state broadcast).

Collective tests (``mpiexec -n 4`` and ``-n 3``, ``--only-mpi``). Expected
values are computed on every rank from data every rank can make (seeded
by rank), with numpy or plain torch on the whole batch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks

SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
LAST = SIZE - 1


def data(r: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, r]).standard_normal(shape)


# -- gradients ---------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gradients(hvd, torch, op):
    """Horovod's gradient: every rank's output gradient gathered, times the size for Sum, times the factors."""
    rows = 2 * SIZE + 1
    grads = [data(r, (rows // SIZE + (1 if r < rows % SIZE else 0), 3), seed=5) for r in range(SIZE)]
    x = torch.from_numpy(data(RANK, (rows, 3), seed=4)).requires_grad_()
    y = hvd.reducescatter(x, op=getattr(hvd, op), prescale_factor=0.5, postscale_factor=3.0)
    (y * torch.from_numpy(grads[RANK])).sum().backward()
    factor = 0.5 * 3.0 * (SIZE if op == "Sum" else 1)
    np.testing.assert_allclose(x.grad.numpy(), np.concatenate(grads) * factor, rtol=1e-13)
    xs = [torch.from_numpy(data(RANK, (SIZE, 2), seed=k)).requires_grad_() for k in range(2)]
    outs = hvd.grouped_reducescatter(xs, op=getattr(hvd, op))
    sum(o.sum() for o in outs).backward()
    for t in xs:
        assert t.grad.tolist() == [[SIZE if op == "Sum" else 1.0] * 2] * SIZE


@pytest.mark.mpi(min_size=2)
def test_alltoall_equal_split_gradient_with_ranks_of_other_sizes(hvd, torch):
    """Without splits each rank sends equal parts, but their sizes differ between ranks: the gradient goes back by
    the splits received."""
    x = torch.arange(SIZE * (RANK + 1), dtype=torch.float64).requires_grad_()
    out = hvd.alltoall(x)
    assert out.shape == (sum(r + 1 for r in range(SIZE)),)
    weights = torch.arange(out.shape[0], dtype=torch.float64) + 100 * RANK
    (out * weights).sum().backward()
    expected = []
    for d in range(SIZE):  # my part for rank d comes back from d's weights, at my place among its sources
        start = sum(r + 1 for r in range(RANK))
        expected += [start + k + 100 * d for k in range(RANK + 1)]
    assert x.grad.tolist() == expected


@pytest.mark.mpi(min_size=3)  # a pair of ranks that is not the global set (Horovod refuses a duplicate)
def test_gradients_in_a_process_set(hvd, torch):
    ranks = [0, LAST]
    pair = hvd.add_process_set(ranks)
    if RANK in ranks:
        x = torch.full((2, 2), float(RANK), dtype=torch.float64).requires_grad_()
        hvd.allreduce(x, op=hvd.Sum, process_set=pair).sum().backward()
        assert x.grad.tolist() == [[2.0, 2.0]] * 2
        x.grad = None
        g = hvd.allgather(x, process_set=pair)
        (g * torch.arange(4, dtype=torch.float64).reshape(4, 1)).sum().backward()
        me = ranks.index(RANK)
        assert x.grad[:, 0].tolist() == [2.0 * me, 2.0 * me + 1]
        x.grad = None
        hvd.broadcast(x, root_rank=LAST, process_set=pair).sum().backward()
        assert x.grad.tolist() == [[1.0 if RANK == LAST else 0.0] * 2] * 2
    assert hvd.remove_process_set(pair)


# -- sparse -----------------------------------------------------------------------------------------------


def _random_sparse(torch, r: int, rows: int, seed: int, sparse_dim: int = 2):
    g = torch.Generator().manual_seed(1000 * seed + r)
    t = torch.rand(rows, 4, generator=g, dtype=torch.float64)
    t[t < 0.7] = 0
    return t.to_sparse(sparse_dim)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sparse_dim", [1, 2])
def test_sparse_allreduce_async_equals_the_dense_allreduce(hvd, torch, sparse_dim):
    tensors = [_random_sparse(torch, RANK, 5 + k, seed=k, sparse_dim=sparse_dim) for k in range(4)]
    averages = [sum(_random_sparse(torch, r, 5 + k, seed=k).to_dense() for r in range(SIZE)) / SIZE
                for k in range(4)]
    handles = [hvd.sparse_allreduce_async(t, name=f"sparse.{k}", op=hvd.Average) for k, t in enumerate(tensors)]
    summed = hvd.synchronize(hvd.sparse_allreduce_async(tensors[0], name="sum", op=hvd.Sum))
    for h, expected in zip(handles, averages, strict=True):
        result = h()
        assert result.layout == torch.sparse_coo and result.sparse_dim() == sparse_dim
        np.testing.assert_allclose(result.to_dense().numpy(), expected.numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(summed.to_dense().numpy(), averages[0].numpy() * SIZE, rtol=1e-14)
    empty = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros((0, 3)), (6, 3),
                                    check_invariants=False)
    mine = empty if RANK == 0 else torch.eye(6, 3).to_sparse(1)
    assert hvd.sparse_allreduce_async(mine, op=hvd.Sum)().to_dense().tolist() == (torch.eye(6, 3) * LAST).tolist()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_optimizer_with_sparse_embedding_gradients(hvd, torch, sparse_as_dense):
    """nn.Embedding(sparse=True) with SparseAdam and SGD: the gradients stay sparse and are every rank's average;
    rank 0 does not use the second embedding in the second step (it gathers no rows of it)."""
    for make in (lambda ps: torch.optim.SparseAdam(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)):
        torch.manual_seed(0)
        first = torch.nn.Embedding(10, 3, sparse=True).double()
        second = torch.nn.Embedding(6, 3, sparse=True).double()
        dense = torch.nn.Linear(3, 1).double()
        opt = hvd.DistributedOptimizer(make([first.weight, second.weight]), sparse_as_dense=sparse_as_dense)
        other = hvd.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=0.1))
        for step in range(2):
            opt.zero_grad()
            other.zero_grad()
            rows = [[(r + step) % 10, 9] for r in range(SIZE)]
            used = [not (step == 1 and r == 0) for r in range(SIZE)]
            hidden = first(torch.tensor(rows[RANK]))
            if used[RANK]:
                hidden = hidden + second(torch.tensor([RANK % 6, 5]))
            w = dense.weight.detach().numpy()[0].copy()  # the same on every rank: averaged steps, the same start
            dense(hidden).sum().backward()
            other.step()
            opt.synchronize()
            expected_first, expected_second = np.zeros((10, 3)), np.zeros((6, 3))
            for r in range(SIZE):
                for row in rows[r]:
                    expected_first[row] += w / SIZE
                if used[r]:
                    for row in (r % 6, 5):
                        expected_second[row] += w / SIZE
            for param, expected in ((first.weight, expected_first), (second.weight, expected_second)):
                assert param.grad is not None and param.grad.layout == torch.sparse_coo
                np.testing.assert_allclose(param.grad.to_dense().numpy(), expected, rtol=1e-12, atol=1e-15)
            with opt.skip_synchronize():
                opt.step()
        assert_same_on_all_ranks(WORLD, [first.weight.detach().numpy(), second.weight.detach().numpy()])
        opt.free()
        other.free()


@pytest.mark.mpi(min_size=2)
def test_sparse_gradients_with_a_rank_in_join_raise_instead_of_waiting(hvd, torch):
    embedding = torch.nn.Embedding(4, 2, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1))
    if RANK == 0:
        opt.join()
    else:
        embedding(torch.tensor([1])).sum().backward()
        with pytest.raises(RuntimeError, match=r"sparse gradients cannot be gathered while a rank is in join"):
            opt.step()
        opt.zero_grad()
        opt.join()
    opt.free()


# -- SyncBatchNorm --------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", [(4,), (4, 3), (4, 2, 3)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_equals_batch_norm_of_the_whole_batch(hvd, torch, shape, momentum):
    """Every rank a batch of its own size; the output, running statistics and gradients are those of
    torch's BatchNorm on all the batches together."""
    counts = [r % 3 + 1 for r in range(SIZE)]
    batches = [torch.from_numpy(data(r, (counts[r], *shape), seed=8) * 3 + r) for r in range(SIZE)]
    whole = torch.cat(batches).requires_grad_()
    mine = batches[RANK].clone().requires_grad_()
    bn = torch.nn.BatchNorm1d(4, momentum=momentum).double() if len(shape) < 3 else \
        torch.nn.BatchNorm2d(4, momentum=momentum).double()
    sync = hvd.SyncBatchNorm(4, momentum=momentum).double()
    with torch.no_grad():
        for m in (bn, sync):
            m.weight.copy_(torch.linspace(0.5, 2.0, 4))
            m.bias.copy_(torch.linspace(-1.0, 1.0, 4))
    upstream = [torch.from_numpy(data(r, (counts[r], *shape), seed=9)) for r in range(SIZE)]
    for _ in range(2):  # twice: the running statistics move twice
        out_all, out = bn(whole), sync(mine)
    start = sum(counts[:RANK])
    np.testing.assert_allclose(out.detach().numpy(), out_all[start:start + counts[RANK]].detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sync.running_mean.numpy(), bn.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(sync.running_var.numpy(), bn.running_var.numpy(), rtol=1e-12)
    (out_all * torch.cat(upstream)).sum().backward()
    (out * upstream[RANK]).sum().backward()
    np.testing.assert_allclose(mine.grad.numpy(), whole.grad[start:start + counts[RANK]].numpy(), rtol=1e-10,
                               atol=1e-12)
    summed = hvd.allreduce(torch.cat([sync.weight.grad, sync.bias.grad]), op=hvd.Sum)  # each rank's share
    np.testing.assert_allclose(summed.numpy(), torch.cat([bn.weight.grad, bn.bias.grad]).numpy(), rtol=1e-10)
    sync.eval()
    bn.eval()
    np.testing.assert_allclose(sync(mine).detach().numpy(), bn(mine).detach().numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match=r"expected at least 2D input"):
        sync(torch.zeros(4))


# -- the timeline ------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_timeline_records_negotiation_and_data_movement(hvd, torch):
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="hvd-timeline-") if RANK == 0 else None)
    first, second = os.path.join(folder, "first.json"), os.path.join(folder, "second.json")
    hvd.start_timeline(first, mark_cycles=True)
    hvd.start_timeline(first, mark_cycles=True)  # again, the same file: nothing changes
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    hvd.allgather(torch.ones(2))
    hvd.start_timeline(second)  # another file: the first is written
    hvd.broadcast(torch.ones(2), root_rank=0, name="b")
    hvd.stop_timeline()
    hvd.stop_timeline()  # not started: nothing
    try:
        if RANK == 0:
            _check_timelines(first, second)
    finally:
        WORLD.barrier()  # every rank has written; then the folder goes
        if RANK == 0:
            shutil.rmtree(folder)
    with pytest.raises(TypeError, match=r"file_path: expected a path, got int"):
        hvd.start_timeline(3)


def _check_timelines(first: str, second: str) -> None:
    """Rank 0 reads both files: every rank's events, negotiations and data movement, one file each."""
    with open(first) as f:
        text = f.read()
    events = json.loads(text)["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "NEGOTIATE_ALLGATHER", "ALLGATHER", "CYCLE_START"} <= names
    tensors = {e["args"].get("tensor") for e in events if e.get("ph") == "X"}
    assert "allreduce.test_allreduce" in tensors
    assert "start_time_since_epoch_in_micros" in text  # the checks of Horovod's own (skipped) timeline test
    assert {e["pid"] for e in events} == set(range(SIZE))  # every rank's events
    with open(second) as f:
        events = json.loads(f.read())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert "BROADCAST" in names and "CYCLE_START" not in names and "ALLREDUCE" not in names


# -- the optimizer: Horovod's behaviours --------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_step_after_synchronize_warns_outside_skip_synchronize(hvd, torch):
    net = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    for skip in (False, True):
        opt.zero_grad()
        net(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        messages = [str(w.message) for w in caught]
        if skip:
            assert not messages
        else:
            assert len(messages) == 1 and "optimizer.step() called without optimizer.skip_synchronize()" in \
                messages[0]
    opt.free()


@pytest.mark.mpi(min_size=2)
def test_parameter_names_and_state_broadcast_of_parameters_without_gradients(hvd, torch):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names  # Horovod's attribute, which its test suite reads
    assert sorted(names.values()) == [f"allreduce.noname.{i}.{j}" for i in range(2) for j in range(2)]
    assert hvd.allgather_object(sorted(names.values())) == [sorted(names.values())] * SIZE
    opt.free()
    frozen = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    weight = torch.nn.Parameter(torch.rand(4, dtype=torch.float64) + RANK)
    inner = torch.optim.SGD([frozen, weight], lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-6)
    opt = hvd.DistributedOptimizer(inner, named_parameters=[("a", frozen), ("b", weight)])
    before = weight.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None and weight.grad is not None and weight.grad.abs().sum() == 0  # as Horovod leaves it
    assert torch.equal(weight.detach(), before)  # no step was taken
    assert torch.equal(hvd.broadcast(weight.grad, root_rank=0), weight.grad)
    opt.free()
