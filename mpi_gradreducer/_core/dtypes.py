"""Dtypes: which are supported, in which each is summed, its range, one scaled copy, one digest."""

from __future__ import annotations

import sys
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_NAMES", "digest", "dtype_code", "largest_finite", "reduction_dtype", "scaled_copy", "supported_dtypes",
]

#: Names of the dtypes the reducer accepts; the position of each is its code in the cross-rank plan signature.
SUPPORTED_NAMES = ("float16", "float32", "float64", "complex64", "complex128", "bfloat16")
_NATIVE = tuple(np.dtype(name) for name in SUPPORTED_NAMES[:-1])


def supported_dtypes() -> tuple[np.dtype, ...]:
    """Dtypes the reducer accepts, in the order of :data:`SUPPORTED_NAMES`.

    This imports ``ml_dtypes`` (about a second on a loaded machine); the
    reducer itself never calls it, and uses :func:`dtype_code` instead.

    Returns:
        float16, float32, float64, complex64, complex128 and, where
        ``ml_dtypes`` is installed, bfloat16.
    """
    try:
        import ml_dtypes
    except ImportError:  # optional dependency
        return _NATIVE
    return (*_NATIVE, np.dtype(ml_dtypes.bfloat16))


def dtype_code(dtype: Any) -> int:
    """The position of ``dtype`` in :data:`SUPPORTED_NAMES`, or -1 when the reducer does not accept it.

    No optional dependency is imported: an array of ``ml_dtypes.bfloat16``
    can only exist once ``ml_dtypes`` has been imported by someone else.
    """
    if not isinstance(dtype, np.dtype):
        return -1
    if dtype.isnative and dtype.kind in "fc":
        for code, native in enumerate(_NATIVE):
            if dtype == native:
                return code
    if dtype.name == "bfloat16":
        ml_dtypes = sys.modules.get("ml_dtypes")
        if ml_dtypes is not None and dtype == np.dtype(ml_dtypes.bfloat16):
            return len(_NATIVE)
    return -1


def reduction_dtype(dtype: Any) -> np.dtype:
    """Dtype in which arrays of ``dtype`` are summed.

    Half-precision floats (float16, bfloat16) are summed in float32 and cast
    back, as MindSpore does; every other supported dtype is summed natively.
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16"):
        return np.dtype(np.float32)
    return dtype


def largest_finite(dtype: Any) -> float:
    """Largest finite magnitude of a float (or complex) dtype, bfloat16 included."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)
    return float(np.finfo(dtype).max)


def scaled_copy(src: Any, dst: Any, scale: float = 1.0, compute: Any = None) -> None:
    """``dst[...] = src * scale``, cast to ``dst``'s dtype: the one copy that packs and unpacks.

    The product is formed in ``compute`` (default: the wider of the two
    dtypes) and rounded once. Complex values are scaled component-wise, so
    that ``inf + 0j`` stays ``inf + 0j``. Values beyond ``dst``'s range become
    infinities, as in IEEE arithmetic. ``src`` and ``dst`` may be the same
    array, and ``src`` may be a host array of another memory layout.

    Args:
        src: the values (host or device array).
        dst: the destination, of ``src``'s shape (or 1-D with as many elements).
        scale: the factor (1.0: a plain cast).
        compute: dtype of the product.
    """
    if dst.shape != src.shape:
        dst = dst.reshape(src.shape)
    xp = np if isinstance(dst, np.ndarray) else sys.modules["cupy"]  # a cupy array: cupy is imported
    # in their one dtype: when no other is asked for, and always for complex values (component-wise)
    same = src.dtype == dst.dtype and (compute is None or compute == src.dtype or src.dtype.kind == "c")
    if same and -1.0 <= scale <= 1.0:  # nothing can overflow: no error state to set
        if scale != 1.0:
            _multiply(xp, src, scale, dst)
        elif src is not dst:
            xp.copyto(dst, src)
        return
    with np.errstate(over="ignore"):
        if scale == 1.0:
            xp.copyto(dst, src, casting="unsafe")
            return
        if compute is None:
            compute = np.promote_types(src.dtype, dst.dtype)
        if same:
            _multiply(xp, src, scale, dst)
        else:
            xp.multiply(src, scale, out=dst, dtype=compute, casting="unsafe")


def _multiply(xp: Any, src: Any, scale: float, dst: Any) -> None:
    """``dst = src * scale`` in their one dtype; complex values component-wise (where both are contiguous)."""
    if dst.dtype.kind == "c" and src.flags.c_contiguous and dst.flags.c_contiguous:
        src, dst = src.view(src.real.dtype), dst.view(dst.real.dtype)
    xp.multiply(src, scale, out=dst)


def digest(values: Sequence[Any]) -> int:
    """A deterministic 62-bit digest of ints and strings: the same on every rank and run."""
    text = repr([v if isinstance(v, str) else int(v) for v in values]).encode()
    return (zlib.crc32(text) << 30) ^ zlib.adler32(text)
