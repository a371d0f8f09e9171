"""The local checks of one call's ``grads``: count, shape, dtype, device, writeable, aliasing, RowSparse.

Local only: :mod:`agreement` makes every rank reach the same verdict.
"""

from __future__ import annotations

import ctypes
import operator
import sys
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from . import backend, interop
from .fusion import FusionPlan, owner
from .planning import ParamSpec
from .sparse import RowSparse

__all__ = ["Checked", "check_grads"]


class Checked(NamedTuple):
    """What the local checks found.

    Attributes:
        error: why the gradients cannot be reduced, or None.
        sparse: positions of RowSparse gradients.
        absent: positions of None gradients (this rank has none for that parameter).
        views: every gradient that can be is the reducer's own bucket view.
        arrays: the gradients as numpy/cupy arrays: ``grads`` itself, or a
            new list with zero-copy views where other libraries' arrays came.
    """

    error: Exception | None
    sparse: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()
    views: bool = False
    arrays: Any = None


def check_grads(grads: Any, plan: FusionPlan, aliasing: bool) -> Checked:
    """Why ``grads`` cannot be reduced with ``plan``, and where its RowSparse and None entries are.

    Never raises: an object that cannot even be looked at is reported as a
    ``TypeError``, so that a rank with odd input still reaches the agreement.

    Args:
        grads: what the caller passed.
        plan: the reducer's plan.
        aliasing: also check that no two gradients share memory.
    """
    try:
        return _check(grads, plan, aliasing)
    except Exception as exc:  # an unexpected object must not strand the others
        return Checked(TypeError(f"grads: could not be checked ({exc!r})"))


_shape_dtype = operator.attrgetter("shape", "dtype")
_writeable = operator.attrgetter("flags.writeable")
_base = operator.attrgetter("base")


def _check(grads: Any, plan: FusionPlan, aliasing: bool) -> Checked:
    plain = _plain(grads, plan)
    if plain is not None:
        return plain if not aliasing or plain.views else Checked(_plain_aliasing_error(grads, plan), arrays=grads)
    n = len(plan.specs)
    if not isinstance(grads, Sequence):
        return Checked(TypeError(
            f"grads: expected a list of {n} arrays (one per parameter), got {type(grads).__name__}"
            + ("; pass list(...) of it" if isinstance(grads, Iterable) and not isinstance(grads, (str, bytes))
               else "")))
    if len(grads) != n:
        return Checked(ValueError(
            f"grads: expected {n} arrays (one per parameter, as at construction), got {len(grads)}"))
    own, specs = plan.own_views, plan.specs
    sparse: list[int] = []
    absent: list[int] = []
    views = 0
    arrays = grads  # becomes a list of views when some entry is another library's array
    for i in plan.checked:
        try:
            g = grads[i]
        except Exception as exc:  # a sequence whose items cannot be read
            return Checked(TypeError(f"grads[{i}]: could not be read ({exc!r})"))
        if g is None:  # before the own views, which are None where none was handed out
            if not isinstance(grads, list):
                return Checked(TypeError(
                    f"grads: a None gradient (grads[{i}]) is replaced by the other ranks' average, "
                    f"so grads must be a list, got {type(grads).__name__}"))
            absent.append(i)
            continue
        if g is own[i]:
            views += 1
            continue  # the reducer's own view: right shape, dtype and place by construction
        spec = specs[i]
        if (type(g) is not np.ndarray or g.shape != spec.shape or g.dtype != spec.dtype
                or not g.flags.writeable or spec.device != "cpu"):
            try:
                if isinstance(g, RowSparse):
                    sparse.append(i)
                    error = _sparse_mismatch(i, g, spec, grads)
                else:
                    v = g if type(g) is np.ndarray else _host_array(interop.view(g, spec.device))
                    if v is not g and v is not None:
                        if arrays is grads or not isinstance(arrays, list):
                            arrays = list(grads)
                        arrays[i] = v
                        if _fits(v, spec) and not _copied(v):
                            continue
                    error = _mismatch(i, g, spec, v)
            except Exception as exc:  # an object whose attributes or protocols raise
                error = TypeError(f"grads[{i}]: could not be checked ({type(g).__name__}: {exc!r})")
            if error is not None:
                return Checked(error)
    error = None
    if aliasing:
        skip = set(sparse) | set(absent)
        dense = [i for i in plan.bucketed if i not in skip] if skip else plan.bucketed
        error = _aliasing_error(arrays, dense, own, plan.buffer_owners(), foreign=arrays is not grads)
    return Checked(error, tuple(sparse), tuple(absent), views > 0 and views == plan.own_count, arrays)


def _plain(grads: Any, plan: FusionPlan) -> Checked | None:
    """The verdict for the common case, in C-level loops: a list of host numpy arrays that fit the plan.

    Either every checked gradient is the reducer's own view, or none is and
    each is a writeable ``np.ndarray`` of its parameter's shape and dtype, with
    no parameter skipped; otherwise None (the item by item checks decide).
    """
    if type(grads) is not list or len(grads) != len(plan.specs) or not plan.host:
        return None
    if plan.own_count:
        if plan.own_count == len(grads) and all(map(operator.is_, grads, plan.own_views)):
            return Checked(None, views=True, arrays=grads)
        return None
    if (len(plan.checked) == len(grads) and set(map(type, grads)) == {np.ndarray}
            and list(map(_shape_dtype, grads)) == plan.shapes_dtypes and all(map(_writeable, grads))):
        return Checked(None, arrays=grads)
    return None


def _plain_aliasing_error(grads: list[np.ndarray], plan: FusionPlan) -> Exception | None:
    """:func:`_aliasing_error` for :func:`_plain` arrays, with its common case in C-level loops."""
    if all(map(operator.is_, map(_base, grads), repeat(None))) and len(set(map(id, grads))) == len(grads):
        return None  # distinct arrays that own their memory (no fusion buffer among them: none was handed out)
    return _aliasing_error(grads, plan.bucketed, plan.own_views, plan.buffer_owners())


def _host_array(v: Any) -> Any:
    """``v``, or a plain ``np.ndarray`` view of it when it is of a numpy subclass (``np.matrix``, masked).

    Subclasses change what indexing and reshaping return (a matrix stays 2-D),
    which the execution paths do not expect; the plain view shares the memory,
    so that results still land in the caller's array.
    """
    if isinstance(v, np.ndarray) and type(v) is not np.ndarray:
        return v.view(np.ndarray)
    return v


def _copied(v: Any) -> bool:
    """Whether the host view ``v`` of another object owns its memory: a copy, so results would be lost.

    That is what numpy makes of objects whose ``__array_interface__`` does not
    point into memory of their own, such as numpy scalars.
    """
    return isinstance(v, np.ndarray) and v.base is None


def _fits(v: Any, spec: ParamSpec) -> bool:
    """Whether the array ``v`` can stand for parameter ``spec`` as it is."""
    if v.shape != spec.shape or v.dtype != spec.dtype or backend.device_of(v) != spec.device:
        return False
    return getattr(v.flags, "writeable", True)


def _mismatch(i: int, g: Any, spec: ParamSpec, v: Any) -> Exception | None:
    """Why ``grads[i]`` (``g``, viewed as the array ``v``, None without a view) does not fit parameter ``i``."""
    device = None if v is None else backend.device_of(v)
    if device is not None and v is not g and _copied(v):
        return TypeError(
            f"grads[{i}]: expected an array whose memory results can be written to, got {interop.explain(g)}"
            f"{' (numpy scalars are immutable: pass a 0-d array)' if isinstance(g, np.generic) else ''}; "
            f"pass a writeable array of shape {spec.shape} and dtype {spec.dtype} (as parameter {i})"
        )
    if device is None:
        return TypeError(
            f"grads[{i}]: expected a numpy or cupy array, got {interop.explain(g)}; any array that numpy or "
            f"cupy can view without a copy will do (shape {spec.shape}, dtype {spec.dtype}, on {spec.device}, "
            f"as parameter {i})"
        )
    what = "" if v is g else f" ({type(g).__module__.split('.')[0]}.{type(g).__qualname__})"
    if v.shape != spec.shape:
        return ValueError(f"grads[{i}]: expected shape {spec.shape} (as parameter {i}), got {tuple(v.shape)}{what}")
    if v.dtype != spec.dtype:
        return TypeError(f"grads[{i}]: expected dtype {spec.dtype} (as parameter {i}), got {v.dtype}{what}")
    if device != spec.device:
        return ValueError(f"grads[{i}]: expected an array on {spec.device} (as parameter {i}), got {device}{what}")
    if not getattr(v.flags, "writeable", True):  # cupy arrays have no such flag, and are always writeable
        return ValueError(f"grads[{i}]{what} is read-only, but results are written in place; pass a writeable array")
    return None


def _sparse_mismatch(i: int, g: RowSparse, spec: ParamSpec, grads: Sequence[Any]) -> Exception | None:
    """Why RowSparse ``grads[i]`` cannot stand for parameter ``i``, or None."""
    if not isinstance(grads, list):
        return TypeError(
            f"grads: a RowSparse gradient (grads[{i}]) is replaced by its reduced RowSparse, "
            f"so grads must be a list, got {type(grads).__name__}"
        )
    if spec.device != "cpu":
        return TypeError(
            f"grads[{i}]: a RowSparse gradient needs a host parameter, but parameter {i} is on {spec.device}")
    error = g.check()
    if error is not None:
        return type(error)(f"grads[{i}]: {error}")
    if g.dense_shape != spec.shape or g.dtype != spec.dtype:
        return ValueError(
            f"grads[{i}]: expected a RowSparse of dense_shape {spec.shape} and dtype {spec.dtype} "
            f"(as parameter {i}), got dense_shape {g.dense_shape} and dtype {g.dtype}"
        )
    return None


def _aliasing_error(
    grads: Sequence[Any], indices: Sequence[int], own: Sequence[Any], buffers: set[int], foreign: bool = False
) -> Exception | None:
    """ValueError naming two gradients that share memory, or None.

    Arrays can only overlap when they are views of the same owner, so byte
    bounds (slow to read) are compared only within such groups. The
    reducer's own views (``own``, into the fusion ``buffers``) are disjoint
    by construction and are looked at only when another gradient is a view
    of the same buffer. ``foreign``: some entries are views of other
    libraries' arrays, whose owners do not tell whether they share memory
    (two torch views of one storage have different owners), so the bounds of
    all of them are compared, device by device.
    """
    if foreign:
        by_device: dict[str | None, list[int]] = {}
        for i in indices:
            if grads[i] is not own[i]:
                by_device.setdefault(backend.device_of(grads[i]), []).append(i)
        for members in by_device.values():
            error = _overlap_error(grads, members)
            if error is not None:
                return error
        return None
    mine = [grads[i] for i in indices if grads[i] is not own[i]]
    if all(g.base is None for g in mine) and len(set(map(id, mine))) == len(mine) \
            and buffers.isdisjoint(map(id, mine)):
        return None  # distinct arrays that own their memory (the common case), checked in C-level loops
    seen: set[int] = set()
    shared = False
    borrowed: list[int] = []  # arrays over memory that no numpy array owns
    for i in indices:
        g = grads[i]
        if g is own[i]:
            continue
        base = getattr(g, "base", None)
        if base is None:
            key = id(g)  # most gradients own their memory
        else:
            root = owner(base)
            key = id(root)
            if not isinstance(root, np.ndarray):
                # A memoryview, mmap, torch tensor, ...: two distinct such owners may
                # still expose the same memory (two views of one torch storage).
                borrowed.append(i)
        if key in seen or key in buffers:
            shared = True
        seen.add(key)
    if len(borrowed) > 1:
        error = _overlap_error(grads, borrowed)
        if error is not None:
            return error
    if not shared:
        return None
    owners: dict[int, list[int]] = {}
    for i in indices:
        owners.setdefault(id(owner(grads[i])), []).append(i)
    for members in owners.values():
        if len(members) > 1:
            error = _overlap_error(grads, members)
            if error is not None:
                return error
    return None


def _overlap_error(grads: Sequence[Any], indices: Sequence[int]) -> Exception | None:
    bounds = np.array([_bounds(grads[i]) for i in indices], dtype=np.int64)
    order = np.argsort(bounds[:, 0], kind="stable")
    lo, hi = bounds[order, 0], bounds[order, 1]
    reach = np.maximum.accumulate(hi)
    for k in np.nonzero(lo[1:] < reach[:-1])[0] + 1:
        for j in range(k):
            if hi[j] > lo[k]:
                a, b = sorted((indices[order[j]], indices[order[k]]))
                xp = np if isinstance(grads[a], np.ndarray) else sys.modules["cupy"]  # device views: cupy's
                if xp.shares_memory(grads[a], grads[b]):
                    return ValueError(
                        f"grads[{a}] and grads[{b}] share memory, but results are written in place; "
                        "pass distinct arrays"
                    )
    return None


def _bounds(a: Any) -> tuple[int, int]:
    """``backend.byte_bounds``, three times faster for contiguous writeable host arrays of numpy's own dtypes."""
    if type(a) is np.ndarray and a.flags.c_contiguous and a.flags.writeable and a.size and a.dtype.isbuiltin == 1:
        # numpy's stubs declare ndarray's buffer protocol only for Python >= 3.12
        lo = ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
        return lo, lo + a.nbytes
    return backend.byte_bounds(a)
