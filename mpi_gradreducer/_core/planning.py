"""The reduction plan: which parameters travel together in which buffer.

Pure functions of shapes, dtypes, devices and fusion ids; nothing here talks to
MPI, so the plan can be built and tested in a single process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import reduction_dtype

__all__ = [
    "Bucket",
    "DEFAULT_BUCKET_BYTES",
    "DIRECT_BYTES",
    "FIRST_BUCKET_BYTES",
    "ParamSpec",
    "fusion_ids",
    "make_plan",
]

#: Cap on a fused bucket (the ``bucket_bytes`` option's default). See docs/performance.rst for the measurement.
DEFAULT_BUCKET_BYTES = 4 << 20
#: Parameters from this size up travel alone and, when contiguous, are reduced
#: in place without a copy: packing them costs more than a separate message.
DIRECT_BYTES = 1 << 20
#: Cap on the first bucket (in backward order), so that overlapped
#: communication starts early, as PyTorch DDP does.
FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know of one parameter.

    Attributes:
        shape: the array's shape.
        dtype: the array's dtype.
        device: ``"cpu"`` for host arrays, ``"cuda:N"`` for arrays on GPU N.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    device: str = "cpu"

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Bucket:
    """One fused message: a buffer of ``wire_dtype`` reduced together.

    Attributes:
        indices: parameter indices, in buffer order.
        offsets: element offset of each member in the buffer.
        sizes: element count of each member.
        dtype: dtype of the members' arrays.
        wire_dtype: dtype of the buffer that MPI sums.
        device: where the members live (``"cpu"`` or ``"cuda:N"``).
        fusion_id: the members' fusion id (0: never fused).
    """

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: np.dtype
    wire_dtype: np.dtype
    device: str
    fusion_id: int

    @property
    def count(self) -> int:
        """Number of elements in the buffer."""
        return self.offsets[-1] + self.sizes[-1]

    @property
    def nbytes(self) -> int:
        """Bytes MPI reduces for this bucket."""
        return self.count * self.wire_dtype.itemsize

    def __repr__(self) -> str:
        return (
            f"Bucket(indices={list(self.indices)}, dtype={self.dtype.name}, "
            f"wire_dtype={self.wire_dtype.name}, device={self.device!r}, "
            f"fusion_id={self.fusion_id}, nbytes={self.nbytes})"
        )


def fusion_ids(
    count: int,
    fusion_type: int = 1,
    fusion: Sequence[int] | None = None,
    split_indices: Sequence[int] | None = None,
) -> list[int]:
    """Resolve MindSpore-style fusion settings to one fusion id per parameter.

    Args:
        count: number of parameters.
        fusion_type: the id given to every parameter when neither ``fusion``
            nor ``split_indices`` is given.
        fusion: one id per parameter.
        split_indices: inclusive end indices of consecutive groups, as
            MindSpore's ``all_reduce_fusion_config``: ``[20, 35]`` over 50
            parameters gives ids 1 for 0-20, 2 for 21-35 and 3 for 36-49.

    Returns:
        A list of ``count`` non-negative ints; 0 means "never fused".

    Raises:
        ValueError: when more than one way is given, or a value is out of range.
        TypeError: when an id or index is not an int.
    """
    if fusion is not None and split_indices is not None:
        raise ValueError("give either fusion or split_indices, not both")
    if fusion is not None:
        ids = list(fusion)
        if len(ids) != count:
            raise ValueError(f"fusion: expected {count} ids (one per parameter), got {len(ids)}")
        for i, f in enumerate(ids):
            _check_int(f"fusion[{i}]", f, minimum=0)
        return [int(f) for f in ids]
    if split_indices is not None:
        ends = list(split_indices)
        previous = -1
        for j, end in enumerate(ends):
            _check_int(f"split_indices[{j}]", end, minimum=0)
            if end <= previous or end >= count:
                raise ValueError(
                    f"split_indices[{j}]: expected an increasing index in [0, {count - 1}], got {end}"
                )
            previous = end
        ids, group = [], 1
        for i in range(count):
            ids.append(group)
            if group <= len(ends) and i == ends[group - 1]:
                group += 1
        return ids
    _check_int("fusion_type", fusion_type, minimum=0)
    return [int(fusion_type)] * count


def make_plan(
    params: Sequence[ParamSpec],
    ids: Sequence[int],
    bucket_bytes: int,
    direct_bytes: int,
    *,
    reverse: bool = False,
    first_bucket_bytes: int | None = None,
    exclude: Sequence[bool] = (),
    wire_dtype: Callable[[np.dtype, str], np.dtype] = lambda dtype, device: reduction_dtype(dtype),
) -> tuple[Bucket, ...]:
    """Group parameters into buckets, deterministically.

    Parameters are visited in index order (or reversed). A parameter with id 0,
    or of at least ``direct_bytes`` on the wire, gets a bucket of its own (so it
    can be reduced in place without a copy). The others join the open bucket of
    their (fusion id, device, dtype), which is closed when the next member would
    take it past ``bucket_bytes``. Buckets are ordered by their first member;
    visiting in reverse, by their last (the member backward finishes last), so
    that a fused bucket of small tensors from all over the model (biases,
    norms) does not hold back every bucket after it until backward ends.
    Zero-size and excluded parameters are in no bucket.

    Args:
        params: shape, dtype and device of each parameter.
        ids: fusion id of each parameter.
        bucket_bytes: cap on a fused bucket's wire bytes.
        direct_bytes: wire size from which a parameter always travels alone.
        reverse: visit parameters from last to first (backward order).
        first_bucket_bytes: a smaller cap for the first bucket, so that
            communication can start early.
        exclude: per parameter, True to leave it out of every bucket.
        wire_dtype: maps a parameter's dtype and device to the dtype its bucket
            travels in.

    Returns:
        The buckets.
    """
    order = range(len(params) - 1, -1, -1) if reverse else range(len(params))
    opened: list[list[int]] = []  # members of each bucket, in creation order
    filled: list[int] = []  # wire bytes of each bucket
    open_for: dict[tuple, int] = {}  # (id, device, dtype) -> bucket still taking members
    for i in order:
        spec = params[i]
        if spec.size == 0 or (exclude and exclude[i]):
            continue
        dtype = np.dtype(spec.dtype)
        nbytes = spec.size * np.dtype(wire_dtype(dtype, spec.device)).itemsize
        key = (ids[i], spec.device, dtype.str, dtype.name)
        alone = ids[i] == 0 or nbytes >= direct_bytes
        b = None if alone else open_for.get(key)
        if b is not None:
            cap = min(first_bucket_bytes, bucket_bytes) if b == 0 and first_bucket_bytes else bucket_bytes
            if filled[b] + nbytes > cap:
                b = None
        if b is None:
            opened.append([])
            filled.append(0)
            b = len(opened) - 1
            if not alone:
                open_for[key] = b
        opened[b].append(i)
        filled[b] += nbytes
    if reverse:  # stable: buckets whose last members are the same keep their order
        opened.sort(key=lambda members: -members[-1])
    buckets = []
    for members in opened:
        dtype = np.dtype(params[members[0]].dtype)
        sizes = tuple(params[i].size for i in members)
        offsets = tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))
        buckets.append(
            Bucket(
                indices=tuple(members),
                offsets=offsets,
                sizes=sizes,
                dtype=dtype,
                wire_dtype=np.dtype(wire_dtype(dtype, params[members[0]].device)),
                device=params[members[0]].device,
                fusion_id=ids[members[0]],
            )
        )
    return tuple(buckets)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
