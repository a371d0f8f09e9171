"""The one place that knows numpy from cupy: devices, buffers, copies, streams.

Host arrays are numpy arrays. Device arrays are cupy arrays; cupy is imported
only when one is met, so the package works without it.
"""

from __future__ import annotations

import ctypes
import functools
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

    @property
    def device(self) -> Any:
        """The cupy ``Device``; ``with ops.device:`` makes it current on the calling thread."""
        return self._device

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
__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
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
        if (unpack) p[j] = TO_ITEM((COMPUTE)FROM_WIRE(buf[e]) * (COMPUTE)scale);
        else buf[e] = TO_WIRE((COMPUTE)FROM_ITEM(p[j]) * (COMPUTE)scale);
    }
}
"""

#: For each dtype: its CUDA storage type, and how a value is read from and
#: written to it. float16 is stored as its bits and converted with PTX ``cvt``
#: instructions, so that the kernel needs no CUDA header: NVRTC then compiles
#: it whether or not the CUDA toolkit's headers (cuda_fp16.h, cuda_bf16.h) can
#: be found, and whatever their version. cupy has no bfloat16 arrays.
_CUDA_TYPES = {
    "float16": ("unsigned short", "half_to_float(x)", "float_to_half((float)(x))"),
    "float32": ("float", "(x)", "(float)(x)"),
    "float64": ("double", "(x)", "(double)(x)"),
}

@functools.lru_cache(maxsize=None)  # a memo of compiled code, like cupy's own
def _kernel(item: str, wire: str, compute: str) -> Any:
    """The batched-copy kernel for ``item`` members and a ``wire`` buffer (compiled once)."""
    import cupy

    (item_t, item_get, item_put), (wire_t, wire_get, wire_put) = _CUDA_TYPES[item], _CUDA_TYPES[wire]
    defines = (
        f"#define ITEM {item_t}\n#define WIRE {wire_t}\n#define COMPUTE {compute}\n"
        f"#define FROM_ITEM(x) {item_get}\n#define TO_ITEM(x) {item_put}\n"
        f"#define FROM_WIRE(x) {wire_get}\n#define TO_WIRE(x) {wire_put}\n"
    )
    return cupy.RawKernel(defines + _BATCHED_COPY, "batched_copy")


def batched_copy(members: Sequence[Any], buffer: Any, offsets: Sequence[int], scale: float, unpack: bool) -> int:
    """Pack (or unpack) C-contiguous device arrays into (out of) a fusion buffer.

    One kernel launch for all members, from a table of their addresses and
    offsets (ChainerMN's ``batched_copy`` idea), scaling on the way. Complex
    arrays are handled as pairs of their real components. The members must
    lie back to back in the buffer (``offsets`` ascending, no gaps). The
    kernel runs on the buffer's device, whichever device is current.

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
    sizes = [m.size * factor for m in members]
    table = np.array([m.data.ptr for m in members], dtype=np.uint64)
    starts = np.array([o * factor for o in offsets] + [offsets[-1] * factor + sizes[-1]], dtype=np.int64)
    total = int(starts[-1])
    threads = 256
    blocks = max(1, min((total + threads - 1) // threads, 65535))
    with buffer.device:
        _kernel(item.name, wire.name, compute)(
            (blocks,), (threads,),
            (cupy.asarray(table), cupy.asarray(starts), np.int32(len(members)), np.int64(total),
             buffer, np.float64(scale), np.int32(int(unpack))),
        )
    return 1
