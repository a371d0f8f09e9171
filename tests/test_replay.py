"""The replay of a verdict for the same gradients: sound against every way a user can change them in place.

A call whose gradients are the last call's objects, unchanged, skips the local
checks. These tests change the gradients the ways users do (reassigned
shape, strides or dtype, a read-only flag, a resize, a new object, a torch
tensor's storage swapped) on one rank while the others replay: every rank
must then get correct results, or the same clear error with nothing modified.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, everywhere
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core.replay import Replay, numpy_layout, sequence_layout
from mpi_gradreducer._core.validation import check_grads

pytestmark = pytest.mark.mpi

#: Twelve small gradients: one bucket of many members, copied by one MPI call each way.
SHAPES = [(3, 2), (4,), (2, 2, 2)] + [(5,)] * 9


def _value(comm: MPI.Comm) -> float:
    return 1.0 + comm.Get_rank()


def _mean(comm: MPI.Comm) -> float:
    """The result with ``degree = size + 1``: never a rank's own value, even on one rank."""
    n = comm.Get_size()
    return (n + n * (n - 1) / 2) / (n + 1)


def _fill(grads, value: float) -> None:
    for g in grads:
        g[...] = value


def _armed(reducer, grads, comm, fill=_fill) -> None:
    """Three good calls with the same arrays; the last is a replay."""
    for _ in range(3):
        fill(grads, _value(comm))
        reducer(grads)
        assert all(np.allclose(np.asarray(g), _mean(comm)) for g in grads)
    assert reducer._replay.recall(grads) is not None


def _reducer(comm: MPI.Comm) -> DistributedGradReducer:
    return DistributedGradReducer([np.zeros(s, np.float32) for s in SHAPES], group=comm, degree=comm.Get_size() + 1)


def _restore(g: np.ndarray, kept: list) -> None:
    """New memory under the same array object and shape, as unpickling into it gives (``kept``: keeps memory busy).

    (A numpy array that is weakly referenced, as the reducer's are, refuses ``resize``.)
    """
    shape, dtype, at = g.shape, g.dtype, g.__array_interface__["data"][0]
    g.__setstate__(np.zeros(1 << 16, dtype).__reduce__()[2])
    kept.append(np.empty(shape, dtype))  # takes the freed small buffer, which numpy would hand out again
    g.__setstate__(np.zeros(shape, dtype).__reduce__()[2])
    assert g.__array_interface__["data"][0] != at


CHANGES = {
    # kind: (change on the changing rank, expected error or None for correct results)
    "shape": (lambda g, kept: setattr(g[0], "shape", (2, 3)), (ValueError, r"grads\[0\]: expected shape \(3, 2\)")),
    "dtype": (lambda g, kept: setattr(g[1], "dtype", np.int32), (TypeError, r"grads\[1\]: expected dtype float32")),
    "readonly": (lambda g, kept: g[2].setflags(write=False), (ValueError, r"grads\[2\] is read-only")),
    "replaced": (lambda g, kept: g.__setitem__(3, np.zeros(5, np.float32)), None),
    "restored": (lambda g, kept: _restore(g[4], kept), None),
    "aliased": (lambda g, kept: g.__setitem__(5, g[6]), (ValueError, r"grads\[5\] and grads\[6\] share memory")),
}


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_a_rank_whose_arrays_changed_takes_the_full_path(kind):
    comm = WORLD
    changer = comm.Get_size() - 1
    with _reducer(comm) as reducer:
        grads = [np.zeros(s, np.float32) for s in SHAPES]
        _armed(reducer, grads, comm)
        change, expected = CHANGES[kind]
        kept: list = []
        if comm.Get_rank() == changer:
            change(grads, kept)
        _fill([g for g in grads if g.flags.writeable], _value(comm))
        if expected is None:
            reducer(grads)
            assert all(np.allclose(g, _mean(comm)) for g in grads)
        else:
            before = [g.copy() for g in grads]
            with pytest.raises(expected[0], match=expected[1]):
                reducer(grads)
            assert all(map(np.array_equal, grads, before)), "an array was modified"
        grads = [np.zeros(s, np.float32) for s in SHAPES]  # and the reducer goes on
        _armed(reducer, grads, comm)


def test_strides_reassigned_over_a_larger_buffer_are_followed():
    """A view whose strides are reassigned covers other memory: results land there, nowhere else."""
    comm = WORLD
    with _reducer(comm) as reducer:
        block = np.zeros(64, np.float32)
        grads = [block[:6].reshape(3, 2)] + [np.zeros(s, np.float32) for s in SHAPES[1:]]
        _armed(reducer, grads, comm)
        if comm.Get_rank() == comm.Get_size() - 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2.4 deprecates it, and allows it
                grads[0].strides = (16, 8)
        block[...] = -7.0
        _fill(grads, _value(comm))
        reducer(grads)
        assert all(np.allclose(g, _mean(comm)) for g in grads)
        outside = np.ones(64, bool)
        step0, step1 = (s // 4 for s in grads[0].strides)
        outside[[step0 * i + step1 * j for i in range(3) for j in range(2)]] = False
        assert np.all(block[outside] == -7.0), "memory outside the gradient was written"


def test_a_collected_gradient_voids_the_memory():
    comm = WORLD
    with _reducer(comm) as reducer:
        grads = [np.zeros(s, np.float32) for s in SHAPES]
        _armed(reducer, grads, comm)
        del grads[7]
        assert reducer._replay._dead.dead  # whatever lies where the collected one did is never taken for it
        grads.insert(7, np.zeros(5, np.float32))  # may lie where the old one did
        assert reducer._replay.recall(grads) is None
        _fill(grads, _value(comm))
        reducer(grads)
        assert all(np.allclose(g, _mean(comm)) for g in grads)


@pytest.mark.parametrize("layout", [True, False])
@pytest.mark.parametrize("count", [len(SHAPES), 2 * len(SHAPES)])
def test_replay_refuses_every_change_in_place(layout, count):
    """Serially, both ways of reading numpy's state, few arrays and many: each change voids the replay, and only that.

    (From 16 arrays, which objects a list or tuple holds is read from it in one copy.)
    """
    shapes = (SHAPES * 2)[:count]
    local = MPI.COMM_SELF.Dup()
    try:
        params = [np.zeros(s, np.float32) for s in shapes]
        with DistributedGradReducer(params, group=MPI.COMM_SELF, timeout=None) as reducer:
            plan = reducer._plan
            for change in [lambda g: setattr(g[0], "shape", (6,)), lambda g: setattr(g[1], "dtype", np.int32),
                           lambda g: g[2].setflags(write=False),
                           lambda g: g[4].__setstate__(np.zeros(9, np.float32).__reduce__()[2]),
                           lambda g: g.__setitem__(3, np.zeros(5, np.float32))]:
                replay = Replay(local, layout=layout)
                grads = [np.zeros(s, np.float32) for s in shapes]
                for _ in range(2):
                    assert replay.recall(grads) is None
                    replay.remember(grads, check_grads(grads, plan, True))
                assert replay.recall(grads) is not None
                assert replay.recall(list(grads)) is not None  # a new list of the same arrays
                assert replay.recall(tuple(grads)) is not None
                assert replay.recall(grads[::-1]) is None
                assert replay.recall([*grads[:5], grads[6], grads[5], *grads[7:]]) is None
                change(grads)
                assert replay.recall(grads) is None
                replay.forget()
    finally:
        local.Free()


def test_layouts_are_confirmed_here():
    """On CPython with numpy's ABI the states and the entries are read from the objects (the fast proof is tested)."""
    assert numpy_layout() is not None
    assert sequence_layout() is not None


# -- torch --------------------------------------------------------------------------------------


@pytest.fixture
def torch():
    """torch, when every rank has it; else the test skips on every rank."""
    try:
        import torch as th
    except Exception:  # missing or broken: the same skip everywhere, decided together
        th = None
    if not everywhere(th is not None):
        pytest.skip("needs torch on every rank")
    return th


def _torch_fill(grads, value: float) -> None:
    for g in grads:
        g.fill_(value)


TORCH_CHANGES = {
    "data": (lambda th, g: setattr(g[0], "data", th.zeros(3, 2)), None),
    "set_": (lambda th, g: g[1].set_(th.zeros(4)), None),
    "resize_": (lambda th, g: g[4].resize_(2), (ValueError, r"grads\[4\]: expected shape \(5,\)")),
    "t_": (lambda th, g: g[0].t_(), (ValueError, r"grads\[0\]: expected shape \(3, 2\)")),
    "requires_grad": (lambda th, g: g[2].requires_grad_(), (TypeError, r"grads\[2\]: .*requires grad")),
    "dtype": (lambda th, g: setattr(g[3], "data", g[3].view(th.int32)), (TypeError, r"grads\[3\]: expected dtype")),
}


@pytest.mark.parametrize("kind", sorted(TORCH_CHANGES))
def test_a_torch_tensor_changed_in_place_takes_the_full_path(torch, kind):
    comm = WORLD
    changer = comm.Get_size() - 1
    with DistributedGradReducer([torch.zeros(s) for s in SHAPES], group=comm, degree=comm.Get_size() + 1) as reducer:
        grads = [torch.zeros(s) for s in SHAPES]
        _armed(reducer, grads, comm, _torch_fill)
        kept = [g.data for g in grads]  # the storages as they were
        change, expected = TORCH_CHANGES[kind]
        if comm.Get_rank() == changer:
            change(torch, grads)
        with torch.no_grad():
            _torch_fill(grads, _value(comm))
        _torch_fill(kept, _value(comm))
        if expected is None:
            reducer(grads)
            assert all(torch.allclose(g, torch.tensor(_mean(comm))) for g in grads)
            moved = [k for k, g in zip(kept, grads, strict=True) if k.data_ptr() != g.data_ptr()]
            assert all(bool(torch.all(k == _value(comm))) for k in moved), "an old storage was written"
        else:
            before = [g.detach().clone() for g in grads]
            with pytest.raises(expected[0], match=expected[1]):
                reducer(grads)
            assert all(torch.equal(g.detach(), b) for g, b in zip(grads, before, strict=True)), "a tensor was modified"


def test_views_after_ordinary_arrays_write_nothing_else():
    """A bucket of many members that travels whole with the header, packed by one MPI copy each way: once the
    reducer's own views come instead, they are reduced where they lie, and the earlier arrays stay untouched."""
    comm = WORLD
    shapes = [(10,)] * 16
    params = [np.zeros(s, np.float32) for s in shapes]
    with DistributedGradReducer(params, group=comm, degree=comm.Get_size() + 1) as reducer:
        assert reducer._ctx.first.whole and reducer._plan.buffers[0]._gather is not None
        earlier = [np.zeros(s, np.float32) for s in shapes]
        _armed(reducer, earlier, comm)  # packed and unpacked by the copies' datatype, then replayed
        _fill(earlier, -7.0)
        views = reducer.allocate_grads()
        for _ in range(2):
            _fill(views, _value(comm))
            reducer(views)
            assert all(np.allclose(v, _mean(comm)) for v in views)
        assert all(np.all(a == -7.0) for a in earlier), "an array of an earlier call was written"


@pytest.mark.parametrize("first_bucket", ["whole-with-header", "larger"])
def test_a_random_sequence_of_call_kinds_writes_each_calls_arrays_only(first_bucket):
    """Calls of every kind in a random order (the same order on every rank): new arrays, the same arrays again
    (replayed), the reducer's own views, arrays lying back to back in one block, a None on odd ranks. Each call's
    arrays get the mean; every array of other calls keeps its value (no state of an earlier call leaks into a
    later one), except the reducer's views, which are its buffers: other arrays are packed there."""
    comm = WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    shapes = [(5,)] * 9 + [(3, 2)] + ([(20000,)] if first_bucket == "larger" else [])
    rng = np.random.default_rng(2024)  # the same sequence on every rank
    params = [np.zeros(s, np.float32) for s in shapes]
    with DistributedGradReducer(params, group=comm, degree=size + 1, bucket_bytes=1 << 20) as reducer:
        assert (reducer._ctx.first.whole) == (first_bucket == "whole-with-header")
        same = [np.zeros(s, np.float32) for s in shapes]
        views: list = []
        block = np.zeros(sum(int(np.prod(s)) for s in shapes), np.float32)
        starts = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        lying = [block[a:b].reshape(s) for a, b, s in zip(starts[:-1], starts[1:], shapes, strict=True)]
        seen: list[np.ndarray] = []  # every array handed to the reducer so far, holding -7 between its calls
        for step in range(40):
            kind = rng.choice(["fresh", "same", "views", "block", "none"])
            if kind == "views" and not views:
                views = reducer.allocate_grads()
            if kind == "fresh":
                grads: list = [np.zeros(s, np.float32) for s in shapes]
            elif kind == "none":
                grads = [None if i == 1 and rank % 2 else np.zeros(s, np.float32) for i, s in enumerate(shapes)]
            else:
                grads = {"same": same, "views": views, "block": lying}[kind]
            mine = [g for g in grads if g is not None]
            for g in mine:
                g[...] = rank + 1 + step
            others = [a for a in seen if not any(a is g for g in mine)]
            result = reducer(list(grads))
            want = sum(q + 1 + step for q in range(size)) / (size + 1)
            for i, g in enumerate(result):
                if kind == "none" and i == 1:
                    giving = [q for q in range(size) if q % 2 == 0]
                    want_i = sum(q + 1 + step for q in giving) / (size + 1)
                    np.testing.assert_allclose(g, want_i, rtol=1e-6, err_msg=f"step {step} ({kind}), grads[1]")
                else:
                    np.testing.assert_allclose(g, want, rtol=1e-6, err_msg=f"step {step} ({kind}), grads[{i}]")
            assert all(np.all(a == -7.0) for a in others), f"step {step} ({kind}): another call's array was written"
            for g in result:
                g[...] = -7.0
                if kind != "views" and not any(g is a for a in seen):
                    seen.append(g)
