"""PowerSGD's options and arithmetic: which gradients it compresses, the draws of Q, orthonormalisation.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) sends a low-rank
approximation of each large gradient matrix instead of the matrix: for a
gradient ``G`` seen as an ``n x m`` matrix, the ranks sum ``P = M Q``
(``n x rank``) and ``Q = M^T P`` (``m x rank``) instead of ``M`` itself.
This module is pure (no MPI): the options object that the caller passes as
``compression=``, the rule that picks the compressed gradients, the seeded
draws of ``Q`` and the Gram-Schmidt step. :mod:`mpi_gradreducer._core.lowrank`
runs them within a reducer's call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .planning import ParamSpec

__all__ = ["PowerSGD", "compute_dtype", "draw_q", "matrix_shape", "orthonormalise"]

_WIDE = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class PowerSGD:
    """Low-rank gradient compression with error feedback: ``compression=PowerSGD(...)``.

    A floating-point gradient (float16, bfloat16, float32, float64) with
    ``ndim >= 2`` and shape ``(n, *rest)`` is the matrix ``M`` of shape ``n x
    m``, ``m = prod(rest)``; it is compressed when ``n*m >=
    min_compression_rate * rank * (n + m)``. Everything else is reduced as
    without compression. Calls numbered below ``start_iter`` (from 0) reduce
    every gradient uncompressed. P, Q and the error are computed and kept in
    float64 for float64 gradients, else in float32.

    Args:
        rank: the rank of the approximation (columns of ``P`` and ``Q``).
        start_iter: the first call that compresses (calls before it reduce
            every gradient uncompressed).
        min_compression_rate: compress a matrix only when its elements are at
            least this many times those of ``P`` and ``Q`` together.
        error_feedback: keep what the approximation missed on this rank and
            add it to the next call's gradient.
        warm_start: start each call from the previous call's ``Q`` (else
            every call draws a fresh one).
        seed: the seed of the standard normal draws of ``Q`` (the same on
            every rank).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range.
    """

    rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name, least in (("rank", 1), ("start_iter", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"PowerSGD: {name}: expected an int, got {type(value).__name__} {value!r}")
            if value < least:
                raise ValueError(f"PowerSGD: {name}: expected an int >= {least}, got {value}")
            object.__setattr__(self, name, int(value))
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
            raise TypeError(f"PowerSGD: min_compression_rate: expected a number, got {type(rate).__name__} {rate!r}")
        if not 0 < rate < math.inf:
            raise ValueError(f"PowerSGD: min_compression_rate: expected a positive finite number, got {rate!r}")
        object.__setattr__(self, "min_compression_rate", float(rate))
        for name in ("error_feedback", "warm_start"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"PowerSGD: {name}: expected a bool, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, bool(value))

    def compresses(self, spec: ParamSpec) -> bool:
        """Whether gradients shaped like ``spec`` are compressed (the same rule on every rank)."""
        if not _floating(spec.dtype) or len(spec.shape) < 2 or spec.size == 0:
            return False
        n, m = matrix_shape(spec.shape)
        return n * m >= self.min_compression_rate * self.rank * (n + m)

    def compressed(self, specs: Sequence[ParamSpec], skip: Sequence[bool] = ()) -> tuple[int, ...]:
        """The positions of the parameters whose gradients are compressed (never skipped ones)."""
        return tuple(i for i, s in enumerate(specs) if not (skip and skip[i]) and self.compresses(s))

    def signature(self) -> tuple[int, ...]:
        """The options as integers, for the cross-rank check of the reducer's construction."""
        return (self.rank, self.start_iter, int(self.min_compression_rate * 1e6), int(self.error_feedback),
                int(self.warm_start), self.seed)


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype of M, P, Q and the error for gradients of ``dtype``: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _floating(dtype: Any) -> bool:
    """float16, bfloat16, float32 or float64."""
    dtype = np.dtype(dtype)
    return dtype in _WIDE or dtype == np.float16 or dtype.name == "bfloat16"


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(n, m)``: the matrix of a gradient of ``shape`` ``(n, *rest)``, ``m = prod(rest)``."""
    return int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))


def draw_q(seed: int, index: int, call: int, m: int, rank: int) -> np.ndarray:
    """The standard normal ``m x rank`` draw for parameter ``index`` first used at call ``call`` (float64).

    A function of its arguments only: the same on every rank, in every run,
    whatever happened before (numpy's ``default_rng`` seeded with
    ``[seed, index, call]``).
    """
    return np.random.default_rng([seed, index, call]).standard_normal((m, rank))


def orthonormalise(p: Any) -> None:
    """Make the columns of ``p`` (``n x rank``) orthonormal in place, by Gram-Schmidt with reorthogonalisation.

    Each column has the earlier ones projected out twice ("twice is
    enough"; once is not where the columns are nearly dependent). A column
    left with no more than rounding noise (a norm below ``4 sqrt(n) eps``
    times its norm before the projections) is dependent on the earlier ones
    and becomes zero: normalising the noise would not give an orthogonal
    direction (with constant data, for one, the noise lies along the earlier
    column), and ``P P^T`` would then not be a projection. This happens
    whenever a gradient's rank is below PowerSGD's. A zero column stays zero,
    never NaN. Each column is divided by its largest magnitude first, so that
    its norm neither overflows nor underflows. Works for numpy and cupy.
    """
    n = p.shape[0]
    noise = 4.0 * math.sqrt(max(n, 1)) * float(np.finfo(p.dtype).eps)
    for j in range(p.shape[1]):
        col = p[:, j]
        biggest = float(abs(col).max()) if n else 0.0
        if biggest == 0.0:
            col[...] = 0
            continue
        if math.isfinite(biggest):
            col /= biggest
        before = float((col @ col) ** 0.5)
        for _ in range(2 if j else 0):
            for k in range(j):
                other = p[:, k]
                col -= (other @ col) * other
        after = float((col @ col) ** 0.5)
        if after <= noise * before:
            col[...] = 0
            continue
        col /= after
