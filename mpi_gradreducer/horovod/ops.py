"""Horovod's reduction operations and its compression strategies.

The operations keep Horovod's integer values (``Average`` is 0, ``Sum`` 1,
``Adasum`` 2, ``Min`` 3, ``Max`` 4, ``Product`` 5), so that code comparing
them to ints keeps working. A compression is Horovod's tiny stateless
strategy: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import torch

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "Compressor",
           "NoneCompressor", "FP16Compressor", "resolve_op"]


class ReduceOp(enum.IntEnum):
    """How a reduction combines the ranks' tensors (Horovod's values)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

ADASUM_MESSAGE = ("op=Adasum is not implemented by mpi_gradreducer.horovod (it would not be an average: Adasum "
                  "combines gradients by their projections); use op=Average (the default) or op=Sum")


def resolve_op(op: Any, average: bool | None, what: str) -> ReduceOp:
    """Horovod's reading of ``op`` and the deprecated ``average`` (local; raises before anything is sent).

    Args:
        op: a :class:`ReduceOp`, its int value, or None (Average).
        average: deprecated: True for Average, False for Sum; None: not given.
        what: the call, for messages.

    Raises:
        ValueError: both given, or an unknown ``op``.
        NotImplementedError: ``op`` is Adasum.
    """
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; give only one of them, got op={op!r} and "
                         f"average={average!r}")
    if average is not None:
        warnings.warn("average is deprecated (as in Horovod 0.19): use op=Average or op=Sum", DeprecationWarning,
                      stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or not isinstance(op, int) or op not in set(ReduceOp):
        raise ValueError(f"{what}: op: expected one of Average, Sum, Min, Max, Product, got {op!r}")
    if op == Adasum:
        raise NotImplementedError(f"{what}: {ADASUM_MESSAGE}")
    return ReduceOp(op)


class Compressor:
    """A compression strategy: what goes on the wire, and back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send, and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor in the caller's dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16; others as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """Horovod's choices: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
