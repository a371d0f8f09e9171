"""The one place that knows numpy from cupy: devices, buffers, copies."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["device_of", "byte_bounds", "flat_view", "empty", "is_host"]


def device_of(a: Any) -> Optional[str]:
    """Where ``a`` lives: ``"cpu"`` for a numpy array, ``"cuda:N"`` for a cupy array.

    Returns:
        The device string, or None when ``a`` is not an array of either kind.
    """
    if isinstance(a, np.ndarray):
        return "cpu"
    if type(a).__module__.startswith("cupy") and hasattr(a, "device"):
        return f"cuda:{a.device.id}"
    return None


def is_host(device: str) -> bool:
    """True for arrays in host memory."""
    return device == "cpu"


def byte_bounds(a: Any) -> tuple[int, int]:
    """First and one-past-last byte address that ``a`` may touch."""
    if isinstance(a, np.ndarray):
        ptr = a.__array_interface__["data"][0]
    else:
        ptr = a.data.ptr
    lo = hi = ptr
    for n, s in zip(a.shape, a.strides):
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + a.itemsize


def flat_view(a: Any) -> Any:
    """A 1-D view of a C-contiguous array (no copy); None if it is not contiguous."""
    if not a.flags.c_contiguous:
        return None
    return a.reshape(-1)


def empty(count: int, dtype: np.dtype, device: str) -> Any:
    """A new 1-D buffer of ``count`` elements on ``device``."""
    if is_host(device):
        return np.empty(count, dtype=dtype)
    import cupy

    with cupy.cuda.Device(int(device.split(":")[1])):
        return cupy.empty(count, dtype=dtype)
