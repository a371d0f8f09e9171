"""The local checks of one call's ``grads``: count, shape, dtype, device, writeable, aliasing, RowSparse.

Local only: :mod:`agreement` makes every rank reach the same verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import backend
from .fusion import FusionPlan, owner
from .planning import ParamSpec
from .sparse import RowSparse

__all__ = ["Checked", "check_grads"]


@dataclass(frozen=True)
class Checked:
    """What the local checks found.

    Attributes:
        error: why the gradients cannot be reduced, or None.
        sparse: positions of RowSparse gradients.
        absent: positions of None gradients (this rank has none for that parameter).
        views: every gradient that can be is the reducer's own bucket view.
    """

    error: Exception | None
    sparse: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()
    views: bool = False


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


def _check(grads: Any, plan: FusionPlan, aliasing: bool) -> Checked:
    n = len(plan.specs)
    if not isinstance(grads, Sequence):
        return Checked(TypeError(
            f"grads: expected a list of {n} arrays (one per parameter), got {type(grads).__name__}"
            + ("; pass list(...) of it" if isinstance(grads, Iterable) and not isinstance(grads, (str, bytes)) else "")))
    if len(grads) != n:
        return Checked(ValueError(f"grads: expected {n} arrays (one per parameter, as at construction), got {len(grads)}"))
    own, specs = plan.own_views, plan.specs
    sparse: list[int] = []
    absent: list[int] = []
    views = 0
    for i in plan.checked:
        g = grads[i]
        if g is own[i]:
            views += 1
            continue  # the reducer's own view: right shape, dtype and place by construction
        if g is None:
            if not isinstance(grads, list):
                return Checked(TypeError(
                    f"grads: a None gradient (grads[{i}]) is replaced by the other ranks' average, "
                    f"so grads must be a list, got {type(grads).__name__}"))
            absent.append(i)
            continue
        spec = specs[i]
        if (type(g) is not np.ndarray or g.shape != spec.shape or g.dtype != spec.dtype
                or not g.flags.writeable or spec.device != "cpu"):
            if isinstance(g, RowSparse):
                sparse.append(i)
                error = _sparse_mismatch(i, g, spec, grads)
            else:
                error = _mismatch(i, g, spec)
            if error is not None:
                return Checked(error)
    error = None
    if aliasing:
        skip = set(sparse) | set(absent)
        dense = [i for i in plan.bucketed if i not in skip] if skip else plan.bucketed
        error = _aliasing_error(grads, dense, own, plan.buffer_owners())
    return Checked(error, tuple(sparse), tuple(absent), views > 0 and views == plan.own_count)


def _mismatch(i: int, g: Any, spec: ParamSpec) -> Exception | None:
    """Why ``grads[i]`` does not fit parameter ``i``, or None if it does."""
    device = backend.device_of(g)
    if device is None:
        return TypeError(f"grads[{i}]: expected a numpy or cupy array, got {type(g).__name__}")
    if g.shape != spec.shape:
        return ValueError(f"grads[{i}]: expected shape {spec.shape} (as parameter {i}), got {g.shape}")
    if g.dtype != spec.dtype:
        return TypeError(f"grads[{i}]: expected dtype {spec.dtype} (as parameter {i}), got {g.dtype}")
    if device != spec.device:
        return ValueError(f"grads[{i}]: expected an array on {spec.device} (as parameter {i}), got {device}")
    if not getattr(g.flags, "writeable", True):  # cupy arrays have no such flag, and are always writeable
        return ValueError(f"grads[{i}] is read-only, but results are written in place; pass a writeable array")
    return None


def _sparse_mismatch(i: int, g: RowSparse, spec: ParamSpec, grads: Sequence[Any]) -> Exception | None:
    """Why RowSparse ``grads[i]`` cannot stand for parameter ``i``, or None."""
    if not isinstance(grads, list):
        return TypeError(
            f"grads: a RowSparse gradient (grads[{i}]) is replaced by its reduced RowSparse, "
            f"so grads must be a list, got {type(grads).__name__}"
        )
    if spec.device != "cpu":
        return TypeError(f"grads[{i}]: a RowSparse gradient needs a host parameter, but parameter {i} is on {spec.device}")
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
    grads: Sequence[Any], indices: Sequence[int], own: Sequence[Any], buffers: set[int]
) -> Exception | None:
    """ValueError naming two gradients that share memory, or None.

    Arrays can only overlap when they are views of the same owner, so byte
    bounds (slow to read) are compared only within such groups. The
    reducer's own views (``own``, into the fusion ``buffers``) are disjoint
    by construction and are looked at only when another gradient is a view
    of the same buffer.
    """
    seen: set[int] = set()
    shared = False
    for i in indices:
        g = grads[i]
        if g is own[i]:
            continue
        base = getattr(g, "base", None)
        key = id(g) if base is None else id(owner(base))  # most gradients own their memory
        if key in seen or key in buffers:
            shared = True
            break
        seen.add(key)
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
    bounds = np.array([backend.byte_bounds(grads[i]) for i in indices], dtype=np.int64)
    order = np.argsort(bounds[:, 0], kind="stable")
    lo, hi = bounds[order, 0], bounds[order, 1]
    reach = np.maximum.accumulate(hi)
    for k in np.nonzero(lo[1:] < reach[:-1])[0] + 1:
        for j in range(k):
            if hi[j] > lo[k]:
                a, b = sorted((indices[order[j]], indices[order[k]]))
                if np.shares_memory(grads[a], grads[b]):
                    return ValueError(
                        f"grads[{a}] and grads[{b}] share memory, but results are written in place; "
                        "pass distinct arrays"
                    )
    return None
