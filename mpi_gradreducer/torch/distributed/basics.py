"""What every part of the backend shares: its name, the dtypes and reductions it carries, tensors as host bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..._core import interop
from ..._core.dtypes import digest
from ..._core.transport import CHUNK_BYTES

#: The backend's name, as ``init_process_group`` and ``new_group`` take it.
BACKEND = "mpi_gradreducer"
#: The rendezvous scheme whose store comes from MPI alone, as in ``init_method="mpi://"``.
RENDEZVOUS = "mpi"

_OPERATIONS = ("allreduce", "broadcast", "reduce", "allgather", "all_gather_into_tensor", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier")
_REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32,
           torch.uint64)
_HALVES = (torch.float16, torch.bfloat16)
#: The MPI datatype in which each dtype that MPI can reduce is reduced (besides the 16-bit floats).
_MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T, torch.uint64: MPI.UINT64_T, torch.bool: MPI.C_BOOL,
}
_MPI_OPS = {"SUM": MPI.SUM, "AVG": MPI.SUM, "PRODUCT": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX,
            "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
#: bool tensors: torch's sum and max are "or", product and min are "and".
_BOOL_OPS = {"SUM": MPI.LOR, "MAX": MPI.LOR, "BOR": MPI.LOR, "PRODUCT": MPI.LAND, "MIN": MPI.LAND,
             "BAND": MPI.LAND, "BXOR": MPI.LXOR}


class _Host:
    """A contiguous CPU tensor for ``tensor`` (itself when it is one); :meth:`back` writes it back.

    Args:
        tensor: the caller's tensor.
        read: its values are read (False: only written, so a copy need not be filled).
    """

    __slots__ = ("tensor", "host", "copied")

    def __init__(self, tensor: torch.Tensor, read: bool = True) -> None:
        self.tensor = tensor
        t = tensor.detach()
        self.copied = not (t.device.type == "cpu" and t.is_contiguous())
        if not self.copied:
            self.host = t
        elif read:
            self.host = t.to("cpu").contiguous()
        else:
            self.host = torch.empty(t.shape, dtype=t.dtype)

    def bytes(self) -> np.ndarray:
        """The host tensor's bytes, as a 1-D numpy view."""
        view = interop.view(self.host.reshape(-1).view(torch.uint8))
        assert isinstance(view, np.ndarray)
        return view

    def back(self) -> None:
        """Write the host tensor into the caller's (when they differ)."""
        if self.copied:
            with torch.no_grad():
                self.tensor.copy_(self.host)
            if self.tensor.device.type == "cuda":
                torch.cuda.current_stream(self.tensor.device).synchronize()


def _tensor(t: Any, what: str, operation: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{operation}: {what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{operation}: {what}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{operation}: {what}: expected a CPU or CUDA tensor, got one on {t.device}")
    return t


def _per_rank(lists: list[list[Any]], size: int, like: torch.Tensor, name: str, operation: str
              ) -> list[torch.Tensor]:
    """The root's one list of ``size`` tensors (``gather_list``, ``scatter_list``), each checked against ``like``."""
    if len(lists) != 1 or len(lists[0]) != size:
        raise ValueError(f"{operation}: {name}: expected {size} tensors (one per rank) at the root, got "
                         f"{sum(len(x) for x in lists)}")
    for j, t in enumerate(lists[0]):
        _tensor(t, f"{name}[{j}]", operation)
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"{operation}: {name}[{j}]: expected {like.numel()} elements of {like.dtype}, "
                             f"got {t.numel()} of {t.dtype}")
    return lists[0]


def _row(t: torch.Tensor, shape: bool = True) -> tuple[int, ...]:
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES) + digest([str(t.dtype)]) % 1000
    return (code, t.dim(), *(t.shape if shape else ()))


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "another dtype"


def _reduction(op: Any) -> str:
    """The name of a ``ReduceOp`` (or ``RedOpType``)."""
    for name in _REDUCTIONS:
        if op == getattr(dist.ReduceOp, name):
            return name
    return str(op)


def _check_reducible(operation: str, dtype: torch.dtype, op: str) -> None:
    """Raise unless MPI can reduce ``dtype`` with ``op`` (the message names the operation)."""
    if op == "PREMUL_SUM" or op not in _MPI_OPS:
        raise ValueError(f"{operation}: ReduceOp.{op} is not supported by the {BACKEND} backend; use SUM, AVG, "
                         "PRODUCT, MIN, MAX, BAND, BOR or BXOR")
    if dtype not in _MPI_TYPES and dtype not in _HALVES:
        raise TypeError(f"{operation}: tensors of dtype {dtype} cannot be reduced over MPI (ReduceOp.{op}); "
                        "they can be moved (broadcast, all_gather, scatter, all_to_all, send)")
    if op == "AVG" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{operation}: ReduceOp.AVG needs a floating-point or complex tensor, got {dtype}")
    if op in ("MIN", "MAX") and dtype.is_complex:
        raise TypeError(f"{operation}: ReduceOp.{op} of a complex tensor ({dtype}) is undefined")
    if op in ("BAND", "BOR", "BXOR") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{operation}: ReduceOp.{op} needs an integer or bool tensor, got {dtype}")


def _as_list(tensors: Any) -> list[Any]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _chunks(count: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[slice]:
    step = max(1, chunk_bytes // max(1, itemsize))
    for start in range(0, count, step):
        yield slice(start, min(count, start + step))


# -- the process group --------------------------------------------------------------------------------


def _displacements(counts: Sequence[int]) -> list[int]:
    places, at = [], 0
    for c in counts:
        places.append(at)
        at += c
    return places


def _apart(send: np.ndarray, recv: np.ndarray, rank: int) -> Any:
    """``send`` for a gather into ``recv``: ``MPI.IN_PLACE`` where it is this rank's block of ``recv``
    (FSDP2 gathers so), a copy where it overlaps ``recv`` otherwise (MPI forbids aliased buffers)."""
    if not np.may_share_memory(send, recv):
        return send
    start = send.__array_interface__["data"][0] - recv.__array_interface__["data"][0]
    if start == rank * send.nbytes:
        return MPI.IN_PLACE
    return send.copy()


def _env_has(name: str) -> bool:
    return name in os.environ
