"""Tensors held against every rank's, and tensors as bytes that MPI can move."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from mpi4py import MPI

from .._core import agreement, interop

__all__ = ["bytes_of", "check_same_tensors", "describe_row", "tensor_row"]

#: dtypes named in the cross-rank comparison of models, by code (anything else: "other").
_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "uint8", "int16",
           "int32", "int64", "bool")


def tensor_row(t: torch.Tensor) -> tuple[int, ...]:
    name = str(t.dtype).replace("torch.", "")
    code = _DTYPES.index(name) if name in _DTYPES else len(_DTYPES)
    return (code, int(t.device.type == "cuda"), t.dim(), *t.shape)


def describe_row(row: tuple[int, ...]) -> str:
    dtype = _DTYPES[row[0]] if row[0] < len(_DTYPES) else "other dtype"
    return f"shape {tuple(row[3:])} {dtype} on {'cuda' if row[1] else 'cpu'}"


def check_same_tensors(comm: MPI.Intracomm, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Raise ``ValueError`` on every rank unless every rank has tensors of the same shapes and dtypes (collective).

    Args:
        comm: the ranks that must agree.
        tensors: this rank's tensors, in order.
        names: what each tensor is, for the message (e.g. ``"parameter 'fc.weight'"``).

    Raises:
        ValueError: naming the first tensor that differs, the two ranks and what each has.
    """
    agreement.check_same(comm, [tensor_row(t) for t in tensors], lambda i, row: describe_row(row),
                         lambda i: names[i] if i < len(names) else f"tensor {i}")


def bytes_of(t: torch.Tensor) -> Any:
    """A numpy (or cupy) view of ``t``'s bytes; bfloat16 and bool as unsigned ints."""
    if t.dtype in (torch.bfloat16, torch.bool):
        t = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.uint8)
    return interop.view(t)
