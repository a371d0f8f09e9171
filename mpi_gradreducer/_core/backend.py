"""The one place that knows numpy from cupy: devices, buffers, copies, streams, kernels.

Host arrays are numpy arrays. Device arrays are cupy arrays; cupy is imported
only when one is met, so the package works without it. The source of the
batched-copy kernel is built without cupy (:func:`kernel_source`), so that what
is compiled can be checked on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "KERNEL_DTYPES",
    "KERNEL_OPTIONS",
    "DeviceOps",
    "HUGE_FROM",
    "HUGE_PAGE",
    "HostOps",
    "batched_copy",
    "byte_bounds",
    "copy_from_host",
    "device_of",
    "empty",
    "flat_view",
    "is_host",
    "kernel_source",
    "ops_for",
    "to_numpy",
]


def device_of(a: Any) -> str | None:
    """Where ``a`` lives: ``"cpu"`` for a numpy array, ``"cuda:N"`` for a cupy array.

    Returns:
        The device string, or None when ``a`` is not an array of either kind.
    """
    if isinstance(a, np.ndarray):
        return "cpu"
    if type(a).__module__.startswith("cupy") and hasattr(a, "device") and hasattr(a, "data"):
        return f"cuda:{a.device.id}"
    return None


def is_host(device: str | None) -> bool:
    """True for arrays in host memory (``device`` as :func:`device_of` gives it)."""
    return device == "cpu"


def _device_id(device: str) -> int:
    return int(device.split(":")[1])


def byte_bounds(a: Any) -> tuple[int, int]:
    """First and one-past-last byte address that ``a`` may touch."""
    ptr = a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
    lo = hi = ptr
    for n, s in zip(a.shape, a.strides, strict=True):
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


#: The size of a huge page (x86-64, arm64 with 4 KiB base pages).
HUGE_PAGE = 2 << 20
#: Host buffers of at least this many bytes are mapped on huge-page boundaries with
#: ``madvise(MADV_HUGEPAGE)``: MPICH moves such buffers faster over huge pages
#: (docs/performance.rst, "The constants"), and numpy asks for them only from 4 MiB.
#: (A buffer of 1 MiB then takes a whole huge page: at most twice its size.)
HUGE_FROM = 1 << 20


def empty(count: int, dtype: np.dtype, device: str) -> Any:
    """A new 1-D buffer of ``count`` elements on ``device`` (host buffers from 1 MiB on huge pages)."""
    if is_host(device):
        nbytes = count * np.dtype(dtype).itemsize
        return _huge_empty(count, dtype, nbytes) if nbytes >= HUGE_FROM else np.empty(count, dtype=dtype)
    import cupy

    with cupy.cuda.Device(_device_id(device)):
        return cupy.empty(count, dtype=dtype)


def _huge_empty(count: int, dtype: np.dtype, nbytes: int) -> np.ndarray:
    """``np.empty(count, dtype)`` in an anonymous mapping that starts on a huge page and asks for huge pages.

    Where the system has no transparent huge pages (or refuses), the
    mapping is used as it is; where it has no ``madvise``, numpy allocates.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return np.empty(count, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # private (shared anonymous memory is shmem, which has its own huge-page setting); room to start on a
    # huge page, untouched pages cost nothing
    memory = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(memory, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    with contextlib.suppress(OSError):  # no transparent huge pages: ordinary pages
        memory.madvise(advice, start, span)
    return whole[start : start + nbytes].view(dtype)


def ops_for(device: str) -> HostOps | DeviceOps:
    """The copy/stream operations for buffers on ``device``."""
    return HostOps() if is_host(device) else DeviceOps(_device_id(device))


def to_numpy(a: Any) -> np.ndarray:
    """A C-contiguous host copy of a device array (after the work queued on the current stream)."""
    with a.device:
        return np.ascontiguousarray(a.get())  # blocking: after the work queued on the current stream


def copy_from_host(a: Any, host: np.ndarray) -> None:
    """Write host ``host`` into device array ``a`` (any strides); done when this returns."""
    import cupy

    with a.device:
        a[...] = cupy.asarray(host)
        cupy.cuda.get_current_stream().synchronize()


class HostOps:
    """Staging and stream operations where the "device" is host memory: plain synchronous copies.

    Lets the staging pipeline run, and be tested, without a GPU. Every method
    of :class:`DeviceOps` exists here; those about streams do nothing.
    """

    def pinned(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A host buffer (pinned, where that means something)."""
        return np.empty(count, dtype=dtype)

    def to_host(self, src: Any, dst: np.ndarray) -> Any:
        """Start copying device ``src`` into host ``dst``; returns a token for :meth:`wait`."""
        np.copyto(dst, src)

    def to_device(self, src: np.ndarray, dst: Any) -> Any:
        """Start copying host ``src`` into device ``dst``; returns a token for :meth:`wait`."""
        np.copyto(dst, src)

    def wait(self, token: Any) -> None:
        """Block the host until the copy behind ``token`` is done."""

    def ready_for_mpi(self) -> None:
        """Make the work queued on device buffers visible to MPI (no-op on host)."""

    def record(self) -> Any:
        """An event marking the work queued so far on the calling thread's current stream."""
        return None

    def wait_event(self, event: Any) -> None:
        """Order the calling thread's current stream after ``event`` (None: nothing to wait for)."""

    @contextlib.contextmanager
    def own_stream(self) -> Iterator[None]:
        """Make these operations' own work stream current on the calling thread."""
        yield

    def begin_call(self) -> None:
        """Order the current stream after the previous call's last device work."""

    def end_call(self) -> Any:
        """Mark the end of this call's device work on the current stream; returns its event."""
        return None


class DeviceOps:
    """Copy and stream operations for one CUDA device, with streams of their own.

    Three non-blocking streams: one for device-to-host copies, one for
    host-to-device copies (so that the download of one bucket and the upload
    of another overlap each other, as well as the Allreduce), and a work
    stream on which a communication thread runs its packs and unpacks. A copy
    is ordered after the work already queued on the calling thread's current
    stream by an event, not by a device-wide synchronisation; data copied
    back to the device is ordered before the current stream's next kernels.

    The end of each call's device work is remembered as an event
    (:meth:`end_call`), and the next call's first device work waits for it
    (:meth:`begin_call`), so that a caller who changes streams between calls
    cannot race the previous call's unpack.

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
            self._d2h = cupy.cuda.Stream(non_blocking=True)
            self._h2d = cupy.cuda.Stream(non_blocking=True)
            self._work = cupy.cuda.Stream(non_blocking=True)
        self._done: Any = None  # the previous call's end-of-work event

    @property
    def device(self) -> Any:
        """The cupy ``Device``; ``with ops.device:`` makes it current on the calling thread."""
        return self._device

    def _event(self, stream: Any) -> Any:
        return stream.record(self._cupy.cuda.Event(disable_timing=True))

    def pinned(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A page-locked host buffer (fast, asynchronous DMA)."""
        return self._cupyx.empty_pinned((count,), dtype=dtype)

    def to_host(self, src: Any, dst: np.ndarray) -> Any:
        """Queue a device-to-host copy after the current stream's queued work; returns its event."""
        with self._device:
            self._d2h.wait_event(self._event(self._cupy.cuda.get_current_stream()))
            src.data.copy_to_host_async(ctypes.c_void_p(dst.ctypes.data), src.nbytes, self._d2h)
            return self._event(self._d2h)

    def to_device(self, src: np.ndarray, dst: Any) -> Any:
        """Queue a host-to-device copy; the current stream waits for it. Returns its event."""
        with self._device:
            dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data), dst.nbytes, self._h2d)
            done = self._event(self._h2d)
            self._cupy.cuda.get_current_stream().wait_event(done)
            return done

    def wait(self, token: Any) -> None:
        """Block the host until the event ``token`` has happened."""
        token.synchronize()

    def ready_for_mpi(self) -> None:
        """Synchronise the current stream, so that MPI reads finished data."""
        with self._device:
            self._cupy.cuda.get_current_stream().synchronize()

    def record(self) -> Any:
        """An event after the work queued so far on the calling thread's current stream.

        Recorded by the training thread when it hands buckets to a
        communication thread, instead of synchronising its stream.
        """
        with self._device:
            return self._event(self._cupy.cuda.get_current_stream())

    def wait_event(self, event: Any) -> None:
        """Order the calling thread's current stream after ``event`` (None: nothing to wait for).

        The host does not wait.
        """
        if event is not None:
            with self._device:
                self._cupy.cuda.get_current_stream().wait_event(event)

    @contextlib.contextmanager
    def own_stream(self) -> Iterator[None]:
        """Make this device and its work stream current on the calling thread (a communication thread)."""
        with self._device, self._work:
            yield

    def begin_call(self) -> None:
        """Order the current stream after the previous call's last device work (see :meth:`end_call`)."""
        self.wait_event(self._done)

    def end_call(self) -> Any:
        """Record, on the current stream, the end of this call's device work; returns the event.

        The next :meth:`begin_call` waits for it, whichever stream is then current.
        """
        self._done = self.record()
        return self._done


# -- the batched-copy kernel -----------------------------------------------------------

#: Device helpers of the kernel. Every float32 operation is inline PTX without
#: ``.ftz``: cupy compiles with ``-ftz=true`` and appends that option after the
#: caller's own, so that ``-ftz=false`` cannot be passed; inline PTX is not
#: affected by it, so denormals are kept, as on the host. float16 is converted
#: with ``cvt`` (from float64 in one rounding); bfloat16 is stored as its bits: to float32 a 16-bit shift, from
#: float32 round-to-nearest-even by integer arithmetic, NaN kept (made quiet).
_HELPERS = r"""
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned short f64_to_f16(double d) {
    unsigned short h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(d));
    return h;
}
__device__ __forceinline__ float bits_to_f32(unsigned int u) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u));
    return f;
}
__device__ __forceinline__ unsigned int f32_to_bits(float f) {
    unsigned int u;
    asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f));
    return u;
}
__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return bits_to_f32(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ double f32_to_f64(float f) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));
    return d;
}
__device__ __forceinline__ float f64_to_f32(double d) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
    return f;
}
__device__ __forceinline__ float mul_f32(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ double mul_f64(double a, double b) {
    double r;
    asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
    return r;
}
"""

_BATCHED_COPY = r"""
extern "C" __global__ void batched_copy(const unsigned long long* ptrs, const long long* offsets,
                                        const int n, const long long total, WIRE* buf,
                                        const double scale, const int scaled, const int unpack) {
    const COMPUTE s = SCALE(scale);
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        int lo = 0, hi = n - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (offsets[mid] <= e) lo = mid; else hi = mid - 1;
        }
        ITEM* p = (ITEM*)ptrs[lo];
        const long long j = e - offsets[lo];
        if (unpack) {
            COMPUTE v = FROM_WIRE(buf[e]);
            p[j] = TO_ITEM(scaled ? MUL(v, s) : v);
        } else {
            COMPUTE v = FROM_ITEM(p[j]);
            buf[e] = TO_WIRE(scaled ? MUL(v, s) : v);
        }
    }
}
"""

#: For each real dtype the kernel handles: its CUDA storage type, the type it
#: is read as, and how a value is read from and written to its storage.
#: Complex arrays are handled as pairs of their real components.
_STORAGE = {
    "float16": ("unsigned short", "float", "f16_to_f32({})", "f32_to_f16({})"),
    "bfloat16": ("unsigned short", "float", "bf16_to_f32({})", "f32_to_bf16({})"),
    "float32": ("float", "float", "{}", "{}"),
    "float64": ("double", "double", "{}", "{}"),
}

#: The real dtypes the kernel reads and writes, as members or as the buffer.
KERNEL_DTYPES = tuple(_STORAGE)

#: Options passed to cupy's ``RawKernel``. None about ``-ftz``: cupy appends
#: ``-ftz=true`` after these, and NVRTC keeps the last (see :data:`_HELPERS`).
KERNEL_OPTIONS: tuple[str, ...] = ()


def _accessors(dtype: str, compute: str) -> tuple[str, str, str]:
    """(storage type, read-as-``compute`` expression, write-from-``compute`` expression) of ``dtype``."""
    storage, natural, get, put = _STORAGE[dtype]
    if natural == compute:
        return storage, get.format("(x)"), put.format("(x)")
    # float32-sized values in a double computation (the other way round never happens);
    # float16 is rounded from double once, as numpy does, bfloat16 through float32, as ml_dtypes does
    put = "f64_to_f16((x))" if dtype == "float16" else put.format("f64_to_f32(x)")
    return storage, f"f32_to_f64({get.format('(x)')})", put


def kernel_source(item: str, wire: str) -> str:
    """The CUDA source of the batched-copy kernel between ``item`` members and a ``wire`` buffer.

    Needs no CUDA header and no cupy: it is plain text, checked on machines
    without a GPU.

    Args:
        item: the members' real dtype name (one of :data:`KERNEL_DTYPES`).
        wire: the buffer's real dtype name (one of :data:`KERNEL_DTYPES`).

    Returns:
        The source, defines first.

    Raises:
        KeyError: for a dtype the kernel does not handle.
    """
    for name in (item, wire):
        if name not in _STORAGE:
            raise KeyError(f"the batched-copy kernel does not handle {name}; it handles {', '.join(KERNEL_DTYPES)}")
    compute = "double" if "float64" in (item, wire) else "float"
    item_t, item_get, item_put = _accessors(item, compute)
    wire_t, wire_get, wire_put = _accessors(wire, compute)
    mul, scale = ("mul_f64", "(x)") if compute == "double" else ("mul_f32", "f64_to_f32(x)")
    defines = (
        f"#define ITEM {item_t}\n#define WIRE {wire_t}\n#define COMPUTE {compute}\n"
        f"#define FROM_ITEM(x) {item_get}\n#define TO_ITEM(x) {item_put}\n"
        f"#define FROM_WIRE(x) {wire_get}\n#define TO_WIRE(x) {wire_put}\n"
        f"#define MUL(a, b) {mul}((a), (b))\n#define SCALE(x) {scale}\n"
    )
    return defines + _HELPERS + _BATCHED_COPY


@functools.cache  # a memo of compiled code, like cupy's own
def _kernel(item: str, wire: str) -> Any:
    """The batched-copy kernel for ``item`` members and a ``wire`` buffer (compiled once)."""
    import cupy

    return cupy.RawKernel(kernel_source(item, wire), "batched_copy", options=KERNEL_OPTIONS)


def _real(dtype: np.dtype) -> np.dtype:
    """The real dtype of a complex dtype's components (the dtype itself otherwise)."""
    return np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype


def batched_copy(members: Sequence[Any], buffer: Any, offsets: Sequence[int], scale: float, unpack: bool) -> int:
    """Pack (or unpack) C-contiguous device arrays into (out of) a fusion buffer.

    One kernel launch for all members, from a table of their addresses and
    offsets (ChainerMN's ``batched_copy`` idea), scaling on the way; at scale
    1.0 values are only converted, never multiplied. Complex arrays are
    handled as pairs of their real components. The members must lie back to
    back in the buffer (``offsets`` ascending, no gaps). The kernel runs on the
    buffer's device, whichever device is current, on the current stream.

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
    item, wire = _real(item), _real(wire)
    sizes = [m.size * factor for m in members]
    table = np.array([m.data.ptr for m in members], dtype=np.uint64)
    starts = np.array([o * factor for o in offsets] + [offsets[-1] * factor + sizes[-1]], dtype=np.int64)
    total = int(starts[-1])
    threads = 256
    blocks = max(1, min((total + threads - 1) // threads, 65535))
    with buffer.device:
        _kernel(item.name, wire.name)(
            (blocks,), (threads,),
            (cupy.asarray(table), cupy.asarray(starts), np.int32(len(members)), np.int64(total),
             buffer, np.float64(scale), np.int32(scale != 1.0), np.int32(int(unpack))),
        )
    return 1
