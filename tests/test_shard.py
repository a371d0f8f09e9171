"""``reduce_scatter`` and ``Shard.allgather``: coverage, values, balance, dtypes, views, validation, sharded SGD."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer import DistributedGradReducer, RowSparse
from mpi_gradreducer._core.dtypes import supported_dtypes
from mpi_gradreducer._core.planning import ParamSpec, make_plan
from mpi_gradreducer._core.shard import bounds, cuts, layout

SHAPES = [(40, 30), (30,), (300, 1024), (7,), (), (5, 0), (64, 64), (3, 5, 2)]


def _params(dtype=np.float64) -> list[np.ndarray]:
    return [np.zeros(s, dtype) for s in SHAPES]


def _base(shape, i: int) -> np.ndarray:
    """Distinct small integers per element and parameter (exact in every dtype, float16 included)."""
    n = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(n) * 7 + 3 * i) % 61).reshape(shape).astype(np.float64)


def _grads(dtype=np.float64, rank: int | None = None) -> list[np.ndarray]:
    r = WORLD.Get_rank() if rank is None else rank
    return [np.array(_base(s, i) + r, dtype) for i, s in enumerate(SHAPES)]


def _mean(i: int) -> np.ndarray:
    return _base(SHAPES[i], i) + (WORLD.Get_size() - 1) / 2


# -- the layout: a pure function of the plan and the size ---------------------------------

def _random_plan(seed: int):
    rng = np.random.default_rng(seed)
    specs = [ParamSpec(tuple(int(d) for d in rng.integers(0, 40, rng.integers(0, 3))),
                       np.dtype(rng.choice(["float32", "float64", "float16"]))) for _ in range(rng.integers(1, 30))]
    ids = [int(x) for x in rng.integers(0, 3, len(specs))]
    return specs, make_plan(specs, ids, int(rng.integers(64, 4096)), 2048, reverse=True, first_bucket_bytes=512)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_layout_covers_every_element_once_and_is_balanced(seed, size):
    specs, buckets = _random_plan(seed)
    owners = [np.zeros(s.size, np.int64) for s in specs]
    numel = []
    for r in range(size):
        spans = layout(buckets, size, r)
        assert spans == layout(buckets, size, r)  # deterministic
        for s in spans:
            assert 0 <= s.start < s.stop <= specs[s.index].size
            owners[s.index][s.start:s.stop] += 1
        numel.append(sum(s.stop - s.start for s in spans))
        # pieces follow each other, in order, among the values the rank receives for each bucket
        for k, b in enumerate(buckets):
            mine = [s for s in spans if s.bucket == k]
            assert sum(s.stop - s.start for s in mine) == sum(e[r + 1] - e[r] for _, e in cuts(b, size))
            assert [s.offset for s in mine] == list(np.cumsum([0] + [s.stop - s.start for s in mine])[:-1])
    bucketed = {i for b in buckets for i in b.indices}
    for i, o in enumerate(owners):
        assert (o == (1 if i in bucketed else 0)).all(), i
    total = sum(b.count for b in buckets)
    assert sum(numel) == total
    chunks = sum(len(cuts(b, size)) for b in buckets)
    assert max(numel) <= total / size + chunks  # each chunk's slices differ by one element at most


@pytest.mark.parametrize("size", [1, 3, 4])
def test_large_buckets_are_sliced_chunk_by_chunk(size):
    from mpi_gradreducer._core.transport import CHUNK_BYTES

    specs = [ParamSpec((3_000_001,), np.dtype(np.float32)), ParamSpec((5, 7), np.dtype(np.float16))]
    buckets = make_plan(specs, [1, 1], 1 << 20, 1 << 20, reverse=True)
    big = next(b for b in buckets if 0 in b.indices)
    assert len(cuts(big, size)) == -(-big.count * 4 // CHUNK_BYTES) >= 3
    owners = np.zeros(specs[0].size, np.int64)
    for r in range(size):
        spans = [s for s in layout(buckets, size, r) if s.index == 0]
        assert len(spans) == len(cuts(big, size))  # one piece per chunk of the lone tensor
        for s in spans:
            owners[s.start:s.stop] += 1
        held = sum(s.stop - s.start for s in spans)
        assert held <= big.count / size + len(cuts(big, size))
    assert (owners == 1).all()


def test_bounds_are_even():
    assert bounds(10, 4) == [0, 2, 5, 7, 10]
    assert bounds(3, 4) == [0, 0, 1, 2, 3]
    assert bounds(0, 2) == [0, 0, 0]


# -- collective ----------------------------------------------------------------------------

def _all_spans(reducer: DistributedGradReducer) -> list[list[tuple[int, int, int]]]:
    mine = [(p.index, p.start, p.stop) for p in reducer.reduce_scatter(_grads())]
    return WORLD.allgather(mine)


@pytest.mark.mpi
def test_pieces_cover_every_element_exactly_once_across_ranks():
    skip = [i == 1 for i in range(len(SHAPES))]
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10, skip=skip) as reducer:
        spans = _all_spans(reducer)
        owners = [np.zeros(int(np.prod(s, dtype=np.int64)), np.int64) for s in SHAPES]
        for r, pieces in enumerate(spans):
            assert [(i, a, b) for i, a, b in pieces] == [(s.index, s.start, s.stop) for s in
                                                          layout(reducer.buckets, WORLD.Get_size(), r)]
            for i, a, b in pieces:
                owners[i][a:b] += 1
        for i, o in enumerate(owners):
            assert (o == (0 if skip[i] else 1)).all(), i
        numel = [sum(b - a for _, a, b in pieces) for pieces in spans]
        total = sum(o.size for i, o in enumerate(owners) if not skip[i])
        assert max(numel) <= 1.05 * total / WORLD.Get_size() + len(reducer.buckets)


@pytest.mark.mpi
@pytest.mark.parametrize("views", [False, True])
def test_values_are_the_mean_and_grads_are_left_alone(views):
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10) as reducer:
        own = reducer.allocate_grads() if views else []
        for call in range(2):
            grads = _grads()
            if views:
                for o, g in zip(own, grads, strict=True):
                    o[...] = g
                grads = own
            before = [g.copy() for g in grads]
            shard = reducer.reduce_scatter(grads)
            for b, g in zip(before, grads, strict=True):
                assert b.tobytes() == g.tobytes()
            for p in shard:
                assert p.grad.shape == (p.stop - p.start,) and p.grad.dtype == np.float64
                np.testing.assert_allclose(p.grad, _mean(p.index).reshape(-1)[p.start:p.stop], rtol=1e-12)
            assert reducer.contributors == WORLD.Get_size() and reducer.stats.calls == call + 1


def _dtypes():
    return [d for d in supported_dtypes()]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: d.name)
def test_every_dtype_reduces_and_gathers(dtype):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    params = _params(dtype)
    with DistributedGradReducer(params, bucket_bytes=8 << 10) as reducer:
        shard = reducer.reduce_scatter(_grads(dtype))
        wide = np.complex128 if dtype.kind == "c" else np.float64
        for p in shard:
            assert p.grad.dtype == dtype
            exact = _mean(p.index).reshape(-1)[p.start:p.stop]
            if dtype.itemsize == 2:  # summed in float32, rounded once into the piece
                summed = sum(_base(SHAPES[p.index], p.index).reshape(-1)[p.start:p.stop].astype(np.float32)
                             + np.float32(r) for r in range(size))
                expected = (summed.astype(np.float32) * np.float32(1.0 / size)).astype(dtype)
                assert p.grad.astype(np.float64).tolist() == expected.astype(np.float64).tolist()
            else:
                np.testing.assert_allclose(p.grad.astype(wide), exact, rtol=1e-6)
            params[p.index].reshape(-1)[p.start:p.stop] = p.grad + rank  # an update of this rank's own
        shard.allgather(params)
        assert_same_on_all_ranks(WORLD, params)
        layouts = [layout(reducer.buckets, size, r) for r in range(size)]
        for r, spans in enumerate(layouts):
            for s in spans:
                got = params[s.index].reshape(-1)[s.start:s.stop].astype(wide)
                want = (_mean(s.index).reshape(-1)[s.start:s.stop] + r)
                np.testing.assert_allclose(got, want, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)


@pytest.mark.mpi
def test_allgather_into_strided_params_and_skipped_ones_left_alone():
    skip = [i == 0 for i in range(len(SHAPES))]
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10, skip=skip) as reducer:
        # parameters as transposed views (not contiguous), the large one contiguous
        params = [np.full(s[::-1], -1.0).T if len(s) > 1 and i != 2 else np.full(s, -1.0)
                  for i, s in enumerate(SHAPES)]
        shard = reducer.reduce_scatter(_grads())
        for p in shard:
            flat = np.arange(p.start, p.stop, dtype=np.float64) + 1000 * rank
            target = params[p.index]
            if target.ndim == 0:
                target[()] = flat[0]
            else:  # write through the (strided) array itself: reshape(-1) would copy
                target[np.unravel_index(np.arange(p.start, p.stop), target.shape)] = flat
        assert shard.allgather(params) is params
        for r, spans in enumerate(layout(reducer.buckets, size, r) for r in range(size)):
            for s in spans:
                np.testing.assert_array_equal(np.ascontiguousarray(params[s.index]).reshape(-1)[s.start:s.stop],
                                              np.arange(s.start, s.stop) + 1000 * r)
        assert (params[0] == -1).all()
        assert_same_on_all_ranks(WORLD, params)


@pytest.mark.mpi
def test_bad_grads_on_one_rank_raise_everywhere_before_anything_moves():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    bad = size - 1
    at = (lambda r: f"rank {r}: ") if size > 1 else (lambda r: "")  # one process raises its own error
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10) as reducer:
        grads = _grads()
        if rank == bad:
            grads[6] = np.zeros((64, 63))
        before = [g.copy() for g in grads]
        with pytest.raises(ValueError, match=at(bad) + r"grads\[6\]: expected shape \(64, 64\) "
                                             r"\(as parameter 6\), got \(64, 63\)"):
            reducer.reduce_scatter(grads)
        for b, g in zip(before, grads, strict=True):
            assert b.tobytes() == g.tobytes()
        grads = _grads()
        if rank == 0:
            grads[0] = RowSparse(np.array([1]), np.ones((1, 30)), (40, 30))
        with pytest.raises(TypeError, match=at(0) + r"grads\[0\]: reduce_scatter\(\) takes dense arrays only"):
            reducer.reduce_scatter(grads)
        shard = reducer.reduce_scatter(_grads())  # usable afterwards
        params = _params()
        before = [p.copy() for p in params]
        if rank == bad:
            params[3] = np.zeros(7, np.float32)
        with pytest.raises(TypeError, match=at(bad) + r"params\[3\]: expected dtype float64 \(as parameter 3\), "
                                            r"got float32"):
            shard.allgather(params)
        if rank == 0:
            params = params[:-1]
        with pytest.raises(ValueError, match=at(0) + r"params: expected 8 arrays"):
            shard.allgather(params)
        for b, p in zip(before, _params(), strict=True):
            assert b.tobytes() == p.tobytes()


@pytest.mark.mpi(min_size=2)
def test_mixing_reduce_scatter_and_a_plain_call_raises_on_every_rank():
    rank = WORLD.Get_rank()
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10) as reducer:
        grads = _grads()
        with pytest.raises(ValueError, match=r"started call 1 differently: rank 0 with reduce_scatter\(\), "
                                             r"rank 1 with a plain call"):
            reducer.reduce_scatter(grads) if rank == 0 else reducer(grads)
        reducer.reduce_scatter(_grads()).allgather(_params())


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_with_joined_ranks_is_refused_on_every_rank():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10) as reducer:
        pattern = (r"reduce_scatter\(\) \(call 1\) while rank \d+ has joined: "
                   r"reduce_scatter with joined ranks is not supported")
        with pytest.raises(ValueError, match=pattern):
            reducer.join() if rank == size - 1 else reducer.reduce_scatter(_grads())
        # still usable: an ordinary epoch end
        if rank != size - 1:
            reducer(_grads())
        reducer.join()


@pytest.mark.mpi
def test_nonfinite_is_the_same_on_every_rank():
    with DistributedGradReducer(_params(), bucket_bytes=8 << 10, check_finite=True) as reducer:
        reducer.reduce_scatter(_grads())
        assert not reducer.nonfinite
        grads = _grads()
        if WORLD.Get_rank() == 0:
            grads[3][1] = np.inf
        reducer.reduce_scatter(grads)
        assert reducer.nonfinite


@pytest.mark.mpi
def test_torch_tensors_as_grads_and_params(torch):
    """torch tensors, when every rank has torch (the conftest fixture skips on every rank alike)."""
    params = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    with DistributedGradReducer(params, bucket_bytes=8 << 10) as reducer:
        shard = reducer.reduce_scatter([torch.from_numpy(g) for g in _grads()])
        for p in shard:
            np.testing.assert_allclose(p.grad, _mean(p.index).reshape(-1)[p.start:p.stop])
            params[p.index].view(-1)[p.start:p.stop] = torch.from_numpy(p.grad)
        shard.allgather(params)
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.numpy(), _mean(i))


@pytest.mark.mpi
@pytest.mark.parametrize("views", [False, True])
def test_sharded_sgd_with_momentum_equals_the_unsharded_one(views):
    """Momentum kept for this rank's pieces only: the same parameters as the plain reducer, in float64."""
    rank = WORLD.Get_rank()
    rng = np.random.default_rng(5)
    init = [np.array(rng.standard_normal(s)) for s in SHAPES]
    lr, mu = 0.1, 0.9
    plain = [p.copy() for p in init]
    sharded = [p.copy() for p in init]
    velocity_full = [np.zeros(s) for s in SHAPES]
    with DistributedGradReducer(plain, bucket_bytes=8 << 10) as a, \
            DistributedGradReducer(sharded, bucket_bytes=8 << 10) as b:
        buffers = b.allocate_grads() if views else None
        state: dict[tuple[int, int], np.ndarray] = {}
        def grad_of(params, step):  # a deterministic gradient that depends on the parameters, step and rank
            return [np.array(np.sin(p) * (rank + 1) + 0.01 * step) for p in params]

        for step in range(5):
            g = a(grad_of(plain, step))
            for p, v, gi in zip(plain, velocity_full, g, strict=True):
                v *= mu
                v += gi
                p -= lr * v
            gs = grad_of(sharded, step)
            if views:
                for o, x in zip(buffers, gs, strict=True):
                    o[...] = x
                gs = buffers
            shard = b.reduce_scatter(gs)
            for piece in shard:
                v = state.setdefault((piece.index, piece.start), np.zeros(piece.stop - piece.start))
                v *= mu
                v += piece.grad
                sharded[piece.index].reshape(-1)[piece.start:piece.stop] -= lr * v
            shard.allgather(sharded)
        state_elements = sum(v.size for v in state.values())
    for x, y in zip(plain, sharded, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-9)
    total = np.array([state_elements], np.int64)
    WORLD.Allreduce(MPI.IN_PLACE, total)
    assert total[0] == sum(int(np.prod(s, dtype=np.int64)) for s in SHAPES)
