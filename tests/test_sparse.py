"""Row-sparse gradients: validation, densifying, and their gather across ranks.

The references are independent of the code under test: every rank can rebuild
every other rank's input from its seed, and sums are formed row by row in
float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer._core.dtypes import supported_dtypes
from mpi_gradreducer._core.sparse import RowSparse, allgather_rowsparse, signature

pytestmark = pytest.mark.mpi

DTYPES = [d.name for d in supported_dtypes()]


def _dtype(name: str) -> np.dtype:
    return next(d for d in supported_dtypes() if d.name == name)


def _inputs(rank: int, dtype: np.dtype, index_dtype, dense_shape, seed: int = 0, integers: bool = False):
    """Rank ``rank``'s gradient: 0 to 6 rows (rank 1 has none), repeats likely."""
    rng = np.random.default_rng([seed, rank])
    nnz = 0 if rank == 1 else int(rng.integers(1, 7))
    indices = rng.integers(0, dense_shape[0], nnz).astype(index_dtype)
    shape = (nnz,) + tuple(dense_shape[1:])
    if integers:
        values = rng.integers(-8, 9, shape).astype(np.float64)
    else:
        values = rng.standard_normal(shape)
        if dtype.kind == "c":
            values = values + 1j * rng.standard_normal(shape)
    return RowSparse(indices, values.astype(dtype), dense_shape)


def _dense64(rs: RowSparse) -> np.ndarray:
    """Densify in float64 (complex128), one row at a time."""
    work = np.complex128 if rs.values.dtype.kind == "c" else np.float64
    out = np.zeros(rs.dense_shape, dtype=work)
    for k, i in enumerate(rs.indices):
        out[int(i)] += rs.values[k].astype(work)
    return out


def _tol(dtype: np.dtype) -> float:
    return {2: 2e-2, 4: 1e-5, 8: 1e-12, 16: 1e-12}[dtype.itemsize if dtype.kind != "c" else dtype.itemsize // 2]


# -- a single RowSparse ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_dense_sums_repeated_rows(dtype):
    dtype = _dtype(dtype)
    rs = RowSparse(np.array([3, 0, 3, 3], np.int32), np.arange(8).reshape(4, 2).astype(dtype), (5, 2))
    dense = rs.to_dense()
    assert dense.dtype == dtype and dense.shape == (5, 2)
    np.testing.assert_array_equal(dense.astype(np.complex128), [[2, 3], [0, 0], [0, 0], [0 + 4 + 6, 1 + 5 + 7], [0, 0]])


def test_coalesce_sorts_and_sums():
    rs = RowSparse(np.array([7, 2, 7, 5, 2], np.int64), np.array([1.0, 2.0, 3.0, 4.0, 5.0]), (9,))
    c = rs.coalesce()
    assert c.indices.dtype == np.int64
    np.testing.assert_array_equal(c.indices, [2, 5, 7])
    np.testing.assert_array_equal(c.values, [7.0, 4.0, 4.0])
    assert c.dense_shape == (9,) and c.nnz == 3
    np.testing.assert_array_equal(c.to_dense(), rs.to_dense())
    assert rs.nnz == 5  # the original is untouched


def test_half_precision_duplicates_are_summed_in_float32():
    # 2048 + 1 + 1 in float16 steps stays 2048; in float32 it is 2050, exactly representable.
    rs = RowSparse(np.zeros(3, np.int64), np.array([2048, 1, 1], np.float16), (1,))
    assert rs.to_dense()[0] == 2050


def test_empty_and_zero_width():
    empty = RowSparse(np.zeros(0, np.int64), np.zeros((0, 3), np.float32), (4, 3))
    np.testing.assert_array_equal(empty.to_dense(), np.zeros((4, 3)))
    assert empty.coalesce().nnz == 0
    narrow = RowSparse(np.array([1, 1]), np.zeros((2, 0), np.float32), (4, 0))
    assert narrow.to_dense().shape == (4, 0)
    assert RowSparse(np.zeros(0, np.int32), np.zeros(0, np.float32), (0,)).to_dense().shape == (0,)


def test_repr_and_properties():
    rs = RowSparse(np.array([1, 2], np.int32), np.ones((2, 3), np.float32), (np.int64(4), 3))
    assert rs.dense_shape == (4, 3) and type(rs.dense_shape[0]) is int
    assert rs.nnz == 2 and rs.dtype == np.float32 and rs.row_shape == (3,)
    assert repr(rs) == "RowSparse(nnz=2, dense_shape=(4, 3), dtype=float32, index_dtype=int32)"


@settings(max_examples=60, deadline=None, database=None)
@given(
    rows=st.integers(1, 6),
    picks=st.lists(st.integers(0, 5), max_size=12),
    data=st.data(),
)
def test_to_dense_and_coalesce_match_add_at(rows, picks, data):
    indices = np.array([p % rows for p in picks], dtype=np.int64)
    values = np.array(data.draw(st.lists(st.integers(-100, 100), min_size=len(picks), max_size=len(picks))),
                      dtype=np.float64).reshape(len(picks))
    rs = RowSparse(indices, values, (rows,))
    expected = np.zeros(rows)
    np.add.at(expected, indices, values)
    np.testing.assert_array_equal(rs.to_dense(), expected)
    c = rs.coalesce()
    assert np.all(np.diff(c.indices) > 0)
    np.testing.assert_array_equal(c.to_dense(), expected)


BAD = [
    ("out of range", lambda: (np.array([0, 5]), np.ones((2, 3), np.float32), (5, 3)),
     ValueError, r"indices: expected row numbers in \[0, 5\) \(dense_shape\[0\]\), got 5 at position 1"),
    ("negative", lambda: (np.array([-1]), np.ones((1, 3), np.float32), (5, 3)),
     ValueError, r"got -1 at position 0"),
    ("float indices", lambda: (np.array([0.0, 1.0]), np.ones((2, 3), np.float32), (5, 3)),
     TypeError, r"indices: expected an integer dtype \(int32 or int64\), got float64"),
    ("bool indices", lambda: (np.array([True]), np.ones((1, 3), np.float32), (5, 3)),
     TypeError, r"expected an integer dtype .*got bool"),
    ("list indices", lambda: ([0, 1], np.ones((2, 3), np.float32), (5, 3)),
     TypeError, r"indices: expected a 1-D numpy array of an integer dtype, got list"),
    ("2-D indices", lambda: (np.zeros((1, 1), np.int64), np.ones((1, 3), np.float32), (5, 3)),
     ValueError, r"indices: expected a 1-D array, got shape \(1, 1\)"),
    ("values shape", lambda: (np.array([0, 1]), np.ones((2, 4), np.float32), (5, 3)),
     ValueError, r"values: expected shape \(2, 3\), i.e. .*got \(2, 4\)"),
    ("values rows", lambda: (np.array([0, 1]), np.ones((3, 3), np.float32), (5, 3)),
     ValueError, r"values: expected shape \(2, 3\)"),
    ("values type", lambda: (np.array([0]), [[1.0, 2.0, 3.0]], (5, 3)),
     TypeError, r"values: expected a numpy array, got list"),
    ("values dtype", lambda: (np.array([0]), np.ones((1, 3), np.int32), (5, 3)),
     TypeError, r"values: dtype int32 is not supported; expected one of float16, float32"),
    ("dense_shape int", lambda: (np.array([0]), np.ones(1, np.float32), 5),
     TypeError, r"dense_shape: expected a tuple of ints, got 5"),
    ("dense_shape float", lambda: (np.array([0]), np.ones(1, np.float32), (5.0,)),
     TypeError, r"dense_shape: expected a tuple of ints"),
    ("dense_shape empty", lambda: (np.zeros(0, np.int64), np.ones((), np.float32), ()),
     ValueError, r"dense_shape: expected at least one dimension"),
]


@pytest.mark.parametrize("name, args, kind, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_or_is_reported(name, args, kind, message):
    with pytest.raises(kind, match=message):
        RowSparse(*args())
    error = RowSparse(*args(), validate=False).check()
    assert isinstance(error, kind)
    with pytest.raises(kind, match=message):
        raise error


def test_signature_ignores_rows_and_index_dtype():
    a = RowSparse(np.array([1], np.int32), np.ones((1, 3), np.float32), (5, 3))
    b = RowSparse(np.array([0, 1, 4], np.int64), np.ones((3, 3), np.float32), (5, 3))
    assert signature(a) == signature(b)
    assert all(isinstance(v, int) for v in signature(a))
    assert signature(a) != signature(RowSparse(a.indices, a.values.astype(np.float64), (5, 3)))
    assert signature(a) != signature(RowSparse(a.indices, a.values, (6, 3)))
    assert signature(a) != signature(RowSparse(a.indices, a.values.reshape(1, 3, 1), (5, 3, 1)))


# -- across ranks ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("coalesce", [False, True])
def test_allgather_equals_sum_of_dense(comm, dtype, index_dtype, coalesce):
    dtype = _dtype(dtype)
    size, rank = comm.Get_size(), comm.Get_rank()
    shape = (11, 2, 3)
    everyone = [_inputs(r, dtype, index_dtype, shape) for r in range(size)]
    for scale in (1.0, 1.0 / 3.0):  # twice, also to catch lazy-initialisation bugs
        out = allgather_rowsparse(comm, everyone[rank], scale=scale, coalesce=coalesce)
        assert isinstance(out, RowSparse) and out.dense_shape == shape and out.dtype == dtype
        assert out.indices.dtype == np.int64
        if coalesce:
            assert np.all(np.diff(out.indices) > 0)
        else:  # every rank's rows, in rank order
            np.testing.assert_array_equal(out.indices, np.concatenate([e.indices for e in everyone]))
        expected = sum(_dense64(e) for e in everyone) * scale
        tol = _tol(dtype) * max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(_dense64(out), expected, rtol=0, atol=tol)
        np.testing.assert_allclose(out.to_dense().astype(expected.dtype), expected, rtol=0, atol=tol)
        assert_same_on_all_ranks(comm, [out.indices, out.values.view(np.uint8)])


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_densify_commutes_with_reduce_exactly(comm, dtype, scale):
    """With integer values and power-of-two scales nothing rounds: the property holds bit for bit."""
    dtype = np.dtype(dtype)
    size, rank = comm.Get_size(), comm.Get_rank()
    shape = (9, 4)
    mine = _inputs(rank, dtype, np.int64, shape, seed=7, integers=True)
    dense = mine.to_dense().astype(np.float64)
    comm.Allreduce(MPI.IN_PLACE, dense)
    dense *= scale
    for coalesce in (False, True):
        out = allgather_rowsparse(comm, mine, scale=scale, coalesce=coalesce)
        np.testing.assert_array_equal(out.to_dense().astype(np.float64), dense)
    assert size == comm.Get_size()


def test_one_dimensional_and_empty_everywhere(comm):
    out = allgather_rowsparse(comm, RowSparse(np.zeros(0, np.int32), np.zeros(0, np.float32), (6,)))
    assert out.nnz == 0 and out.to_dense().shape == (6,)
    out = allgather_rowsparse(comm, RowSparse(np.zeros(0, np.int64), np.zeros((0, 0), np.float64), (3, 0)))
    assert out.nnz == 0 and out.values.shape == (0, 0)
    rank, size = comm.Get_rank(), comm.Get_size()
    rs = RowSparse(np.array([rank % 6], np.int64), np.array([rank + 1.0], np.float32), (6,))
    out = allgather_rowsparse(comm, rs, coalesce=True)
    expected = np.zeros(6)
    for r in range(size):
        expected[r % 6] += r + 1.0
    np.testing.assert_array_equal(out.to_dense(), expected)


def test_non_contiguous_values_and_input_untouched(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    base = np.arange(24, dtype=np.float32).reshape(4, 6) + rank
    values = base[:, ::2]  # strided
    indices = np.array([0, 2, 2, 1], np.int32)
    before = values.copy(), indices.copy()
    out = allgather_rowsparse(comm, RowSparse(indices, values, (3, 3)), scale=2.0)
    np.testing.assert_array_equal(values, before[0])
    np.testing.assert_array_equal(indices, before[1])
    expected = sum(_dense64(RowSparse(indices, before[0] - rank + r, (3, 3))) for r in range(size)) * 2.0
    np.testing.assert_array_equal(out.to_dense(), expected)


@pytest.mark.parametrize("kind", ["range", "dtype", "type", "scale"])
def test_one_bad_rank_raises_everywhere(comm, kind):
    size, rank = comm.Get_size(), comm.Get_rank()
    bad = rank == size - 1
    rows = np.array([1, 4 if bad and kind == "range" else 0], np.int64)
    values = np.ones((2, 2), np.int16 if bad and kind == "dtype" else np.float32)
    rs = RowSparse(rows, values, (4, 2), validate=False)
    if bad and kind == "type":
        rs = rows
    scale = "0.5" if bad and kind == "scale" else 0.5
    message = {
        "range": r"indices: expected row numbers in \[0, 4\)",
        "dtype": r"values: dtype int16 is not supported",
        "type": r"rs: expected a RowSparse, got ndarray",
        "scale": r"scale: expected a real number, got str '0.5'",
    }[kind]
    with pytest.raises((ValueError, TypeError), match=message) as info:
        allgather_rowsparse(comm, rs, scale=scale)
    if size > 1:  # every rank names the one that failed
        assert str(info.value).startswith(f"rank {size - 1}: ")
    out = allgather_rowsparse(comm, RowSparse(np.array([0]), np.ones((1, 2), np.float32), (4, 2)))
    assert out.nnz == size  # the communicator is still usable


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_ranks_disagreeing_on_shape_or_dtype(what):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    odd = rank == size - 1
    shape = (5, 3 + (odd and what == "shape"))
    dtype = np.float64 if odd and what == "dtype" else np.float32
    rs = RowSparse(np.array([0]), np.ones((1, shape[1]), dtype), shape)
    if what == "shape":
        message = rf"dense_shape \(5, 3\) of float32 at rank 0 but dense_shape \(5, 4\) of float32 at rank {size - 1}"
    else:
        message = rf"dense_shape \(5, 3\) of float32 at rank 0 but dense_shape \(5, 3\) of float64 at rank {size - 1}"
    with pytest.raises(ValueError, match=message):
        allgather_rowsparse(WORLD, rs)
