"""The one place that knows numpy from cupy: devices, buffers, copies, streams.

Host arrays are numpy arrays. Device arrays are cupy arrays; cupy is imported
only when one is met, so the package works without it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import numpy as np

__all__ = [
    "DeviceOps",
    "HostOps",
    "byte_bounds",
    "device_of",
    "empty",
    "flat_view",
    "is_host",
    "ops_for",
]


def device_of(a: Any) -> Optional[str]:
    """Where ``a`` lives: ``"cpu"`` for a numpy array, ``"cuda:N"`` for a cupy array.

    Returns:
        The device string, or None when ``a`` is not an array of either kind.
    """
    if isinstance(a, np.ndarray):
        return "cpu"
    if type(a).__module__.startswith("cupy") and hasattr(a, "device") and hasattr(a, "data"):
        return f"cuda:{a.device.id}"
    return None


def is_host(device: str) -> bool:
    """True for arrays in host memory."""
    return device == "cpu"


def _device_id(device: str) -> int:
    return int(device.split(":")[1])


def byte_bounds(a: Any) -> tuple[int, int]:
    """First and one-past-last byte address that ``a`` may touch."""
    ptr = a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
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

    with cupy.cuda.Device(_device_id(device)):
        return cupy.empty(count, dtype=dtype)


def ops_for(device: str) -> "HostOps | DeviceOps":
    """The copy/stream operations for buffers on ``device``."""
    return HostOps() if is_host(device) else DeviceOps(_device_id(device))


class HostOps:
    """Staging operations where the "device" is host memory: plain synchronous copies.

    Lets the staging pipeline run, and be tested, without a GPU.
    """

    def pinned(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A host buffer (pinned, where that means something)."""
        return np.empty(count, dtype=dtype)

    def to_host(self, src: Any, dst: np.ndarray) -> None:
        """Start copying device ``src`` into host ``dst``; returns a token for :meth:`wait`."""
        np.copyto(dst, src)

    def to_device(self, src: np.ndarray, dst: Any) -> None:
        """Start copying host ``src`` into device ``dst``; returns a token for :meth:`wait`."""
        np.copyto(dst, src)

    def wait(self, token: Any) -> None:
        """Block the host until the copy behind ``token`` is done."""

    def ready_for_mpi(self) -> None:
        """Make the work queued on device buffers visible to MPI (no-op on host)."""


class DeviceOps:
    """Staging operations for one CUDA device, with a stream of their own.

    Copies run on a dedicated non-blocking stream, ordered after the work
    already queued on the caller's current stream (an event, not a device-wide
    synchronisation), so that copies of one bucket overlap the Allreduce of
    another. Data copied back to the device is ordered before the caller's
    next kernels.

    Args:
        device_id: the CUDA device.
    """

    def __init__(self, device_id: int) -> None:
        import cupy
        import cupyx

        self._cupy = cupy
        self._cupyx = cupyx
        self._device = cupy.cuda.Device(device_id)
        with self._device:
            self._stream = cupy.cuda.Stream(non_blocking=True)

    def pinned(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A page-locked host buffer (fast, asynchronous DMA)."""
        return self._cupyx.empty_pinned((count,), dtype=dtype)

    def to_host(self, src: Any, dst: np.ndarray) -> Any:
        """Queue a device-to-host copy after the caller's queued work; returns its event."""
        with self._device:
            self._stream.wait_event(self._cupy.cuda.get_current_stream().record())
            src.data.copy_to_host_async(ctypes.c_void_p(dst.ctypes.data), src.nbytes, self._stream)
            return self._stream.record()

    def to_device(self, src: np.ndarray, dst: Any) -> Any:
        """Queue a host-to-device copy; the caller's stream waits for it."""
        with self._device:
            dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data), dst.nbytes, self._stream)
            done = self._stream.record()
            self._cupy.cuda.get_current_stream().wait_event(done)
            return done

    def wait(self, token: Any) -> None:
        """Block the host until the event ``token`` has happened."""
        token.synchronize()

    def ready_for_mpi(self) -> None:
        """Synchronise the caller's stream, so MPI reads finished data."""
        with self._device:
            self._cupy.cuda.get_current_stream().synchronize()


_BATCHED_COPY = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void batched_copy(const unsigned long long* ptrs, const long long* offsets,
                                        const int n, const long long total, WIRE* buf,
                                        const double scale, const int unpack) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        int lo = 0, hi = n - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (offsets[mid] <= e) lo = mid; else hi = mid - 1;
        }
        ITEM* p = (ITEM*)ptrs[lo];
        const long long j = e - offsets[lo];
        if (unpack) p[j] = (ITEM)((COMPUTE)buf[e] * (COMPUTE)scale);
        else buf[e] = (WIRE)((COMPUTE)p[j] * (COMPUTE)scale);
    }
}
"""

_CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}


def batched_copy(members: Sequence[Any], buffer: Any, offsets: Sequence[int], scale: float, unpack: bool) -> int:
    """Pack (or unpack) C-contiguous device arrays into (out of) a fusion buffer.

    One kernel launch for all members, from a table of their addresses and
    offsets (ChainerMN's ``batched_copy`` idea), scaling on the way. Complex
    arrays are handled as pairs of their real components.

    Args:
        members: C-contiguous cupy arrays of one dtype.
        buffer: the 1-D cupy fusion buffer.
        offsets: element offset of each member in ``buffer``.
        scale: factor applied to every element copied.
        unpack: copy from the buffer into the members instead.

    Returns:
        The number of kernel launches (1).
    """
    import cupy

    item, wire = np.dtype(members[0].dtype), np.dtype(buffer.dtype)
    factor = 2 if item.kind == "c" else 1
    if factor == 2:
        item = np.dtype(f"f{item.itemsize // 2}")
        wire = np.dtype(f"f{wire.itemsize // 2}")
    compute = "double" if "float64" in (item.name, wire.name) else "float"
    code = _BATCHED_COPY.replace("WIRE", _CUDA_TYPES[wire.name]).replace("ITEM", _CUDA_TYPES[item.name])
    kernel = cupy.RawKernel(code.replace("COMPUTE", compute), "batched_copy")  # cupy caches compilations
    sizes = [m.size * factor for m in members]
    table = np.array([m.data.ptr for m in members], dtype=np.uint64)
    starts = np.array([o * factor for o in offsets] + [offsets[-1] * factor + sizes[-1]], dtype=np.int64)
    total = int(starts[-1])
    threads = 256
    blocks = max(1, min((total + threads - 1) // threads, 65535))
    kernel(
        (blocks,), (threads,),
        (cupy.asarray(table), cupy.asarray(starts), np.int32(len(members)), np.int64(total),
         buffer, np.float64(scale), np.int32(int(unpack))),
    )
    return 1
