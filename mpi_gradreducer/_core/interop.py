"""Zero-copy numpy/cupy views of other libraries' arrays, found by protocol.

The reducer computes on numpy and cupy arrays. Anything that one of them can
view without a copy is accepted as well: objects with ``__array_interface__``,
``__array__`` returning a view of the object's own memory, ``__dlpack__``
(torch tensors on CPU and CUDA, JAX arrays, ...) and
``__cuda_array_interface__``. Detection is by protocol, never by type: no
framework is imported here (cupy only when a device array is met).

numpy cannot import bfloat16 through DLPack; such exports are read here from
the DLPack capsule itself (its ``DLManagedTensor``), and viewed as
``ml_dtypes.bfloat16`` over the producer's memory, which stays alive (and is
released through the producer's deleter) as long as the view.

Routes, fastest first (measured per object in ``docs/interop.rst``):

1. a numpy or cupy array: itself;
2. ``__array_interface__``: ``np.asarray`` (numpy honours it without a copy);
3. ``__array__``, accepted only when the array it returns lies in memory
   owned by the object or by another object of its type (torch's CPU
   tensors), not in a copy of numpy's own;
4. ``__dlpack__`` with ``copy=False`` (``np.from_dlpack``, ``cupy.from_dlpack``),
   or the capsule read directly for dtypes numpy cannot import;
5. ``__cuda_array_interface__``: ``cupy.asarray``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

__all__ = ["describe", "explain", "view"]

#: DLPack device types (``DLDeviceType``) that numpy can address, and those cupy can.
_DL_HOST = (1, 3)  # kDLCPU, kDLCUDAHost (pinned)
_DL_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged
#: DLPack dtype code of bfloat16 (``kDLBfloat``).
_DL_BFLOAT = 4
#: ``DLManagedTensorVersioned.flags`` bit for read-only memory.
_DL_READ_ONLY = 1
_CAPSULE_V1, _USED_V1 = b"dltensor_versioned", b"used_dltensor_versioned"
_CAPSULE_V0, _USED_V0 = b"dltensor", b"used_dltensor"


def view(obj: Any, device: str | None = None) -> Any:
    """A numpy or cupy array over ``obj``'s own memory, without a copy.

    Args:
        obj: an array of any library that exposes one of the protocols in the
            module docstring.
        device: where the caller expects the array (``"cpu"``, ``"cuda:N"``):
            a hint that only decides which protocols are tried first.

    Returns:
        The view (read-only when the producer exports read-only memory), or
        None when ``obj`` is not an array or cannot be viewed without a copy;
        :func:`explain` then says why.
    """
    if isinstance(obj, np.ndarray) or _is_cupy(obj):
        return obj
    if device is not None and device != "cpu":
        a = _device_view(obj)
        return a if a is not None else _host_view(obj)
    # The hot path (torch CPU tensors): a view by __array__.
    method = None if hasattr(obj, "__array_interface__") else getattr(obj, "__array__", None)
    a = _own_array(obj, method)
    if a is not None:
        return a
    a = _host_view(obj, method is None)
    return a if a is not None else _device_view(obj)


def describe(obj: Any) -> tuple[tuple[int, ...], np.dtype, str] | None:
    """Shape, dtype and device of ``obj``, for building a plan (memory untouched).

    Uses a view when there is one; otherwise the array API's ``shape`` and
    ``dtype`` with ``__dlpack_device__``, so that objects that refuse to be
    exported, such as torch parameters that require grad, still describe
    themselves.

    Returns:
        ``(shape, dtype, device)`` with ``device`` ``"cpu"`` or ``"cuda:N"``,
        or None when ``obj`` is not recognisably an array.
    """
    a = view(obj)
    if a is not None:
        return tuple(a.shape), np.dtype(a.dtype), _device_name(a)
    try:
        shape = tuple(int(n) for n in obj.shape)
        dtype = _numpy_dtype(obj.dtype)
        kind, index = obj.__dlpack_device__()
    except Exception:  # not an array, or not one we understand
        return None
    if dtype is None:
        return None
    if int(kind) in _DL_HOST:
        return shape, dtype, "cpu"
    if int(kind) in _DL_CUDA:
        return shape, dtype, f"cuda:{int(index)}"
    return None


def explain(obj: Any) -> str:
    """What ``obj`` is and why :func:`view` cannot use it, for error messages.

    Slow (it retries every protocol to collect the producer's own reasons);
    call it only to build an error.

    Returns:
        A phrase such as ``"torch.Tensor of shape (3, 2), dtype torch.float32,
        that requires grad (...); pass the tensor's .grad, or .detach() it"``.
    """
    what = _what(obj)
    if getattr(obj, "requires_grad", False) is True:
        return f"{what}, that requires grad, which its library refuses to export; pass its .grad, or .detach() it"
    reasons: list[str] = []
    protocols = [name for name in ("__array_interface__", "__array__", "__dlpack__", "__cuda_array_interface__")
                 if _has(obj, name)]
    if not protocols:
        return f"{what}, which exposes none of __array_interface__, __array__, __dlpack__, __cuda_array_interface__"
    if _has(obj, "__array__"):
        try:
            a = obj.__array__()
        except Exception as exc:
            reasons.append(f"__array__ raised {type(exc).__name__}: {exc}")
        else:
            if not (isinstance(a, np.ndarray) and _owned_by(a, obj)):
                reasons.append("__array__ returns a copy, into which results could not be written back")
    if _has(obj, "__dlpack__"):
        try:
            kind = int(obj.__dlpack_device__()[0]) if _has(obj, "__dlpack_device__") else 1
            if kind in _DL_HOST:
                np.from_dlpack(obj, copy=False)
            elif kind in _DL_CUDA:
                reasons.append(_cuda_reason(obj))
            else:
                reasons.append(f"its DLPack device type {kind} is neither host nor CUDA memory")
        except Exception as exc:
            reasons.append(f"__dlpack__ export failed ({type(exc).__name__}: {exc})")
    if _has(obj, "__cuda_array_interface__"):
        try:
            if obj.__cuda_array_interface__["data"][1]:
                reasons.append("its __cuda_array_interface__ is read-only, but results are written in place")
            else:
                reasons.append(_cuda_reason(obj))
        except Exception as exc:
            reasons.append(f"__cuda_array_interface__ failed ({type(exc).__name__}: {exc})")
    reasons = [r for r in dict.fromkeys(reasons) if r]
    if not reasons:
        reasons.append("it could not be viewed without a copy")
    return f"{what}, " + "; ".join(reasons)


# -- routes ------------------------------------------------------------------------------


def _own_array(obj: Any, method: Any) -> np.ndarray | None:
    """``method()`` (``obj.__array__``) when it returns a view of ``obj``'s own memory, else None."""
    if method is None:
        return None
    try:
        a = method()
    except Exception:
        return None
    return a if type(a) is np.ndarray and _owned_by(a, obj) else None


def _host_view(obj: Any, try_array: bool = True) -> np.ndarray | None:
    """A numpy view by ``__array_interface__``, ``__array__`` (unless already tried) or ``__dlpack__``."""
    if _has(obj, "__array_interface__"):
        try:
            return np.asarray(obj)
        except Exception:
            return None
    a = _own_array(obj, getattr(obj, "__array__", None) if try_array else None)
    if a is not None:
        return a
    if not _has(obj, "__dlpack__"):
        return None
    try:
        kind = int(obj.__dlpack_device__()[0]) if _has(obj, "__dlpack_device__") else 1
    except Exception:
        return None
    if kind not in _DL_HOST:
        return None
    try:
        return np.from_dlpack(obj, copy=False)
    except Exception:  # e.g. a dtype numpy cannot import (bfloat16): read the capsule
        try:
            return _capsule_view(obj)
        except Exception:
            return None


def _device_view(obj: Any) -> Any:
    """A cupy view of ``obj``'s CUDA memory; cupy is imported only for an object in CUDA memory."""
    cai, kind = _has(obj, "__cuda_array_interface__"), 0
    if _has(obj, "__dlpack__"):
        try:
            kind = int(obj.__dlpack_device__()[0]) if _has(obj, "__dlpack_device__") else 0
        except Exception:
            kind = 0
    if not (cai or kind in _DL_CUDA):
        return None
    try:
        import cupy
    except ImportError:
        return None
    if kind in _DL_CUDA:
        try:
            # Zero-copy on the producer's device; cupy passes its current
            # stream, so the producer orders its pending work before it.
            return cupy.from_dlpack(obj)
        except Exception:
            pass
    if cai:
        try:
            if obj.__cuda_array_interface__["data"][1]:
                return None  # read-only: results could not be written back
            return cupy.asarray(obj)  # wraps the memory, no copy
        except Exception:
            return None
    return None


def _capsule_view(obj: Any) -> np.ndarray | None:
    """A numpy view of a host DLPack export, read from the capsule (for bfloat16)."""
    api = _capsule_api()
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:  # a producer from before DLPack 1.0
        capsule = obj.__dlpack__()
    managed: _DLManagedTensorVersioned | _DLManagedTensor
    if api.is_valid(capsule, _CAPSULE_V1):
        address = api.get_pointer(capsule, _CAPSULE_V1)
        managed = _DLManagedTensorVersioned.from_address(address)
        flags, used = int(managed.flags), _USED_V1
    elif api.is_valid(capsule, _CAPSULE_V0):
        address = api.get_pointer(capsule, _CAPSULE_V0)
        managed = _DLManagedTensor.from_address(address)
        flags, used = 0, _USED_V0
    else:
        return None
    api.set_name(capsule, used)  # consumed: from now on, its deleter is ours to call
    owner = _Exported(address, managed.deleter)
    t = managed.dl_tensor
    if int(t.device.device_type) not in _DL_HOST or t.dtype.lanes != 1:
        return None  # ``owner`` releases the export
    dtype = _dl_dtype(t.dtype.code, t.dtype.bits)
    if dtype is None:
        return None
    ndim = int(t.ndim)
    shape = tuple(t.shape[k] for k in range(ndim))
    if t.strides:
        strides = tuple(t.strides[k] * dtype.itemsize for k in range(ndim))
    else:  # compact, row-major
        strides = tuple(int(np.prod(shape[k + 1:], dtype=np.int64)) * dtype.itemsize for k in range(ndim))
    owner.__array_interface__ = {
        "version": 3,
        "shape": shape,
        "strides": strides,
        "typestr": f"|V{dtype.itemsize}",
        "data": ((t.data or 0) + int(t.byte_offset), bool(flags & _DL_READ_ONLY)),
    }
    return np.asarray(owner).view(dtype)


class _Exported:
    """Holds one consumed DLPack export; calls the producer's deleter when it dies.

    A numpy array built from its ``__array_interface__`` keeps it (and so the
    producer's memory) alive as its ``base``.
    """

    __slots__ = ("__array_interface__", "_address", "_deleter")
    __array_interface__: dict[str, Any]

    def __init__(self, address: int, deleter: int | None) -> None:
        self._address = address
        self._deleter = deleter

    def __del__(self) -> None:
        if self._deleter:
            ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(self._deleter)(self._address)
            self._deleter = None


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


class _CapsuleAPI:
    """Private prototypes of the PyCapsule C API (``ctypes.pythonapi``'s own are left alone)."""

    def __init__(self) -> None:
        api = ctypes.pythonapi
        self.is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_IsValid", api))
        self.get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_GetPointer", api))
        self.set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_SetName", api))


@functools.lru_cache(maxsize=1)  # a memo of immutable function prototypes
def _capsule_api() -> _CapsuleAPI:
    return _CapsuleAPI()


# -- small helpers ------------------------------------------------------------------------


def _dl_dtype(code: int, bits: int) -> np.dtype | None:
    """The numpy dtype for a DLPack (code, bits) this module reads itself."""
    if code == _DL_BFLOAT and bits == 16:
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    return None


def _numpy_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as numpy's, also for libraries whose dtypes are named ``lib.float32``."""
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    name = str(dtype).rsplit(".", 1)[-1]
    if name == "bfloat16":
        return _dl_dtype(_DL_BFLOAT, 16)
    try:
        return np.dtype(name)
    except TypeError:
        return None


def _owned_by(a: np.ndarray, obj: Any) -> bool:
    """True when ``a`` (from ``obj.__array__()``) lies in memory that ``obj``'s library owns.

    That is, ``a`` is not numpy's own memory, and the end of its chain of
    bases is ``obj`` or an object of ``obj``'s type (torch hands out a view
    whose base is an alias of the tensor). A copy made by ``__array__`` owns
    its memory, or is owned by another numpy array, and is refused.
    """
    base = a.base
    if base is None:
        return False
    while isinstance(base, np.ndarray):
        if base.base is None:
            return False
        base = base.base
    return base is obj or type(base) is type(obj)


def _is_cupy(obj: Any) -> bool:
    return type(obj).__module__.startswith("cupy") and hasattr(obj, "device") and hasattr(obj, "data")


def _device_name(a: Any) -> str:
    return "cpu" if isinstance(a, np.ndarray) else f"cuda:{a.device.id}"


def _has(obj: Any, name: str) -> bool:
    try:
        return hasattr(obj, name)
    except Exception:  # a property that raises something other than AttributeError
        return False


def _cuda_reason(obj: Any) -> str:
    try:
        import cupy  # noqa: F401  (only whether it imports)
    except ImportError:
        return "it is in CUDA memory, which needs cupy, and cupy is not installed"
    dtype = _numpy_dtype(getattr(obj, "dtype", None))
    if dtype is not None and dtype.name == "bfloat16":
        return "it is a CUDA bfloat16 array, which cupy cannot hold"
    return "cupy could not view it without a copy"


def _what(obj: Any) -> str:
    """``module.Type`` of ``obj``, with its shape and dtype where it has them."""
    cls = type(obj)
    module = cls.__module__.split(".")[0]
    name = cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
    details = []
    for attr in ("shape", "dtype", "device"):
        try:
            value = getattr(obj, attr)
        except Exception:
            continue
        if attr == "shape":
            try:
                value = tuple(int(n) for n in value)
            except Exception:
                continue
        if not callable(value):
            details.append(f"{attr} {value}")
    return name + (f" of {', '.join(details)}" if details else "")
