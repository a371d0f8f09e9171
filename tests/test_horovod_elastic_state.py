"""Horovod's ``TorchState``: a commit of a model and an optimizer, restored bitwise; its state sent from a root."""

from __future__ import annotations

import pytest

from conftest import WORLD, assert_same_on_all_ranks

pytestmark = pytest.mark.mpi


def _trained(torch, seed: int):
    """A model and an Adam optimizer with state after one step (random data, other on every seed)."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    _step(torch, model, optimizer, gen)
    return model, optimizer, gen


def _step(torch, model, optimizer, gen) -> None:
    optimizer.zero_grad()
    model(torch.randn(7, 5, generator=gen)).pow(2).sum().backward()
    optimizer.step()


def _snapshot(torch, model, optimizer) -> list:
    """Every tensor of the model and the optimizer's state, copied, and the optimizer's plain values."""
    state = optimizer.state_dict()
    tensors = [t.clone() for t in model.state_dict().values()]
    tensors += [v.clone() for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [tensors, [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]]


def _same(torch, a: list, b: list) -> bool:
    return len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and a[1] == b[1]


def test_a_restore_brings_back_the_committed_model_and_optimizer_bitwise_and_again(torch):
    import mpi_gradreducer.horovod as hvd

    hvd.init()
    try:
        model, optimizer, gen = _trained(torch, 7 + WORLD.Get_rank())
        state = hvd.elastic.TorchState(model, optimizer, epoch=3)
        committed = _snapshot(torch, model, optimizer)
        for _ in range(2):  # restored twice: the commit's copies are not what the optimizer loaded
            _step(torch, model, optimizer, gen)
            optimizer.param_groups[0]["lr"] = 0.5
            state.epoch = 9
            assert not _same(torch, _snapshot(torch, model, optimizer), committed)
            state.restore()
            assert _same(torch, _snapshot(torch, model, optimizer), committed)
            assert state.epoch == 3
    finally:
        hvd.shutdown()


def test_a_sync_gives_every_rank_the_root_s_model_and_optimizer_state(torch):
    import mpi_gradreducer.horovod as hvd

    hvd.init()
    try:
        model, optimizer, _ = _trained(torch, 11 + WORLD.Get_rank())  # other values on every rank
        state = hvd.elastic.TorchState(model, optimizer, epoch=WORLD.Get_rank())
        state.sync_from(0)
        tensors, plain = _snapshot(torch, model, optimizer)
        assert_same_on_all_ranks(WORLD, [t.numpy() for t in tensors])
        assert WORLD.allgather(plain) == [plain] * WORLD.Get_size() and state.epoch == 0
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("api", ["horovod", "package"])
def test_a_state_that_some_rank_cannot_load_raises_on_every_rank(torch, api):
    """The last rank's optimizer has two param groups, the root's one: every rank raises, naming the root."""
    import mpi_gradreducer.horovod as hvd
    import mpi_gradreducer.torch as mgr_torch

    if WORLD.Get_size() < 2:
        pytest.skip("needs a rank other than the root")
    hvd.init()
    try:
        model, optimizer, _ = _trained(torch, 3)
        if WORLD.Get_rank() == WORLD.Get_size() - 1:
            first, *rest = list(model.parameters())
            optimizer = torch.optim.Adam([{"params": [first]}, {"params": rest}], lr=0.01)
        with pytest.raises(ValueError, match="load_state_dict of rank 0's optimizer state failed"):
            if api == "horovod":
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            else:
                mgr_torch.broadcast_optimizer_state(optimizer, root=0)
    finally:
        hvd.shutdown()
