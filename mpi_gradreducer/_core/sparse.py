"""Row-sparse gradients (an embedding's), and their collective reduction.

A :class:`RowSparse` holds some rows of a dense array: ``values[k]`` belongs
to row ``indices[k]`` of an array of shape ``dense_shape``; rows that appear
several times are summed. Reducing such gradients across ranks is a gather,
not a sum: :func:`allgather_rowsparse` concatenates every rank's rows (in rank
order), which densifies to the sum of the densified inputs. No arithmetic
happens inside MPI, so half-precision values travel as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agreement
from .dtypes import SUPPORTED_NAMES, digest, dtype_code, reduction_dtype, scaled_copy

__all__ = ["RowSparse", "allgather_rowsparse", "gather_rows", "signature"]


class RowSparse:
    """Rows ``indices`` of an array of shape ``dense_shape``, holding ``values``.

    Nothing is copied: the object refers to the arrays it is given.

    Args:
        indices: 1-D numpy array of an integer dtype (typically int32 or
            int64): row numbers in ``[0, dense_shape[0])``. Repeats are allowed
            and mean that the rows are summed.
        values: numpy array of shape ``(len(indices),) + dense_shape[1:]``, of
            a floating dtype (float16, float32, float64, bfloat16) or complex.
        dense_shape: shape of the dense array (at least one dimension).
        validate: check the arguments now and raise on the first problem.
            With False, nothing is raised here; :meth:`check` tells.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a shape mismatch, or a row number out of range.

    Example::

        g = RowSparse(np.array([3, 0, 3]), np.ones((3, 4), np.float32), (10, 4))
        g.to_dense()[3]   # array([2., 2., 2., 2.], dtype=float32)
    """

    def __init__(self, indices: Any, values: Any, dense_shape: Sequence[int], *, validate: bool = True) -> None:
        self.indices = indices
        self.values = values
        shape: Sequence[int]
        try:
            shape = tuple(dense_shape)
            if all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in shape):
                shape = tuple(int(d) for d in shape)
        except TypeError:
            shape = dense_shape  # reported by check()
        self.dense_shape = shape
        if validate:
            error = self.check()
            if error is not None:
                raise error

    # -- inspection ---------------------------------------------------------------------

    @property
    def nnz(self) -> int:
        """Number of stored rows (repeated row numbers counted each time)."""
        return int(self.indices.shape[0])

    @property
    def dtype(self) -> np.dtype:
        """The values' dtype."""
        return self.values.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row, ``dense_shape[1:]``."""
        return tuple(self.dense_shape[1:])

    def __repr__(self) -> str:
        dtype = getattr(self.values, "dtype", type(self.values).__name__)
        index_dtype = getattr(self.indices, "dtype", type(self.indices).__name__)
        nnz = len(self.indices) if hasattr(self.indices, "__len__") else "?"
        return f"RowSparse(nnz={nnz}, dense_shape={self.dense_shape}, dtype={dtype}, index_dtype={index_dtype})"

    def check(self) -> Exception | None:
        """Validate without raising, so that ranks can agree on the outcome first.

        Returns:
            None when the object is well formed, else the ``TypeError`` or
            ``ValueError`` that the constructor would raise.
        """
        shape = self.dense_shape
        if not isinstance(shape, tuple) or not all(isinstance(d, int) for d in shape):
            return TypeError(f"dense_shape: expected a tuple of ints, got {shape!r}")
        if len(shape) == 0 or any(d < 0 for d in shape):
            return ValueError(f"dense_shape: expected at least one dimension, none negative, got {shape}")
        idx, val = self.indices, self.values
        if not isinstance(idx, np.ndarray):
            return TypeError(f"indices: expected a 1-D numpy array of an integer dtype, got {type(idx).__name__}")
        if idx.dtype.kind not in "iu":
            return TypeError(
                f"indices: expected an integer dtype (int32 or int64), got {idx.dtype}"
            )
        if idx.ndim != 1:
            return ValueError(f"indices: expected a 1-D array, got shape {idx.shape}")
        if not isinstance(val, np.ndarray):
            return TypeError(f"values: expected a numpy array, got {type(val).__name__}")
        if dtype_code(val.dtype) < 0:
            return TypeError(
                f"values: dtype {val.dtype} is not supported; expected one of "
                + ", ".join(SUPPORTED_NAMES) + " (bfloat16: that of ml_dtypes)"
            )
        expected = (idx.shape[0],) + shape[1:]
        if val.shape != expected:
            return ValueError(
                f"values: expected shape {expected}, i.e. (len(indices),) + dense_shape[1:], got {val.shape}"
            )
        if idx.shape[0]:
            lo, hi = idx.min(), idx.max()
            if lo < 0 or hi >= shape[0]:
                pos = int(np.flatnonzero((idx < 0) | (idx >= shape[0]))[0])
                return ValueError(
                    f"indices: expected row numbers in [0, {shape[0]}) (dense_shape[0]), "
                    f"got {int(idx[pos])} at position {pos}"
                )
        return None

    # -- conversions --------------------------------------------------------------------

    def to_dense(self) -> np.ndarray:
        """The dense array: zeros, plus each stored row added to its row number.

        Repeated rows are summed in their stored order (in float32 for
        half-precision values), so the result is deterministic.

        Returns:
            A new array of shape ``dense_shape`` and the values' dtype.
        """
        out = np.zeros(self.dense_shape, dtype=self.values.dtype)
        rows, summed = _coalesced(self.indices, self.values)
        out[rows] = summed
        return out

    def coalesce(self) -> RowSparse:
        """The same gradient with sorted, unique row numbers.

        Returns:
            A new :class:`RowSparse` (new arrays, int64 indices) whose repeated
            rows have been summed in their stored order.
        """
        rows, summed = _coalesced(self.indices, self.values)
        return RowSparse(rows, summed, self.dense_shape, validate=False)


def signature(rs: RowSparse) -> tuple[int, ...]:
    """What every rank must have in common to reduce ``rs`` together.

    Args:
        rs: a (valid) row-sparse gradient.

    Returns:
        ``(dtype code, ndim, *dense_shape)``: the code is the dtype's position
        in :data:`~mpi_gradreducer._core.dtypes.SUPPORTED_NAMES` (-1 if absent).
        The index dtype and the number of rows may differ between ranks.
    """
    code = dtype_code(getattr(rs.values, "dtype", None))
    shape = rs.dense_shape if isinstance(rs.dense_shape, tuple) else ()
    return (code, len(shape), *(int(d) for d in shape))


def allgather_rowsparse(
    comm: MPI.Comm, rs: RowSparse, scale: float = 1.0, coalesce: bool = False
) -> RowSparse:
    """Every rank's rows, on every rank: the sum of row-sparse gradients.

    Collective over ``comm``. One ``Allgather`` exchanges the row counts
    together with a check that every rank's ``rs`` is valid and has the same
    ``signature()``; when one is not, every rank raises the same error and
    no data moves. Then one ``Allgatherv`` of the indices (as int64) and one
    of the values (raw, in their own dtype). Nothing is pickled.

    ``to_dense()`` of the result equals the sum over the ranks of each
    rank's ``to_dense()``, times ``scale`` (each rank's values are scaled
    before they are sent, in the copy that is made for sending).

    Args:
        comm: the communicator.
        rs: this rank's gradient (any number of rows, also none).
        scale: factor applied to every value (e.g. ``1 / size`` for a mean).
        coalesce: sort the rows and sum repeats (identically on every rank).

    Returns:
        A new :class:`RowSparse` with int64 indices: rank 0's rows, then rank
        1's, and so on; or its coalesced form.

    Raises:
        TypeError, ValueError: on every rank, when any rank's ``rs`` is
            invalid or the ranks' dense shapes or dtypes differ.
    """
    error: Exception | None
    if not isinstance(rs, RowSparse):
        error = TypeError(f"rs: expected a RowSparse, got {type(rs).__name__}")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        error = TypeError(f"scale: expected a real number, got {type(scale).__name__} {scale!r}")
    else:
        error = rs.check()
    sig = signature(rs) if error is None else (-1,)
    head = np.array([rs.nnz if error is None else 0, digest(sig), int(error is not None)], dtype=np.int64)
    table = np.empty((comm.Get_size(), head.shape[0]), dtype=np.int64)
    comm.Allgather(head, table)
    if table[:, 2].any():
        agreement.raise_if_any(comm, error)  # collective: every rank takes this branch
    if (table[:, 1] != table[0, 1]).any():
        agreement.check_same(comm, [sig], _describe, lambda i: "the RowSparse gradient")  # raises

    indices, values = gather_rows(comm, [int(c) for c in table[:, 0]], rs.indices, _send_values(rs.values, scale))
    if coalesce:
        indices, values = _coalesced(indices, values)
    return RowSparse(indices, values, rs.dense_shape, validate=False)


def gather_rows(comm: MPI.Comm, counts: Sequence[int], indices: np.ndarray,
                values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's rows, in rank order, when every rank's row count is known (collective over ``comm``).

    One ``Allgatherv`` of the indices (as int64), one of the values' rows
    (raw, in their own dtype: one MPI datatype a row). Nothing is checked
    here: the ranks agreed on the counts, the rows' shape and dtype before.

    Args:
        comm: the communicator.
        counts: every rank's number of rows (this rank's: ``len(indices)``).
        indices: this rank's row indices.
        values: this rank's rows, shape ``(len(indices), *row_shape)``, C-contiguous.

    Returns:
        The indices (int64) and the rows of every rank, rank 0's first.
    """
    displs = [int(d) for d in np.cumsum([0, *counts[:-1]])] if len(counts) else []
    total = sum(counts)
    gathered = np.empty(total, dtype=np.int64)
    comm.Allgatherv(np.ascontiguousarray(indices, dtype=np.int64), [gathered, (list(counts), displs)])
    rows = np.empty((total, *values.shape[1:]), dtype=values.dtype)
    row_bytes = int(np.prod(values.shape[1:], dtype=np.int64)) * values.dtype.itemsize
    if row_bytes:
        row_type = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        try:
            comm.Allgatherv([values, values.shape[0], row_type], [rows, (list(counts), displs), row_type])
        finally:
            row_type.Free()
    return gathered, rows


def _send_values(values: np.ndarray, scale: float) -> np.ndarray:
    """A C-contiguous array of ``values * scale``; no copy when neither is needed."""
    if scale == 1.0:
        return np.ascontiguousarray(values)
    out = np.empty(values.shape, dtype=values.dtype)
    scaled_copy(values, out, scale, reduction_dtype(values.dtype))  # half precision: in float32, round once
    return out


def _coalesced(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique int64 row numbers, and the rows summed in stored order."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    n = idx.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.int64), np.empty(values.shape, dtype=values.dtype)
    order = np.argsort(idx, kind="stable")
    rows = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    picked = values[order]
    if starts.shape[0] == n:  # no repeats
        return rows, picked
    work = reduction_dtype(values.dtype)
    summed = np.add.reduceat(picked, starts, axis=0, dtype=work)
    return rows[starts], summed.astype(values.dtype, copy=False)


def _describe(index: int, row: tuple[int, ...]) -> str:
    code, ndim, *shape = row
    dtype = SUPPORTED_NAMES[code] if 0 <= code < len(SUPPORTED_NAMES) else "an unsupported dtype"
    return f"dense_shape {tuple(shape)} of {dtype}"
