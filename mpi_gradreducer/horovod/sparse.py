"""Sparse tensors (``torch.sparse_coo``, as ``nn.Embedding(sparse=True)`` makes) on the package's row-sparse path.

A COO tensor with ``k`` sparse dimensions is a
:class:`~mpi_gradreducer._core.sparse.RowSparse` over the product of those
dimensions: row ``i`` is the entry at the flat index ``i`` of the sparse
dimensions, its value the entry's dense part. Reducing it across ranks is a
gather (every rank's rows, in rank order), whose dense form is the sum of
the ranks' dense forms: nothing dense travels. ``sparse_allreduce_async``
gathers on the engine (two ``Allgatherv``: the indices, the values);
``DistributedOptimizer`` gathers its sparse gradients with the core's
``allgather_rowsparse``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._core.sparse import RowSparse
from .execute import Local
from .ops import Average, ReduceOp, Sum, resolve_op
from .process_sets import global_process_set
from .session import SetInfo
from .submit import Prepared, dtype_name, raw_bytes, set_of, submit, wait

__all__ = ["to_rowsparse", "from_rowsparse", "sparse_allreduce_async", "SparseHandle"]


def to_rowsparse(t: torch.Tensor) -> RowSparse:
    """``t`` (a COO tensor on any device) as a :class:`RowSparse` of host arrays (no dense copy)."""
    sparse_shape = tuple(t.shape[: t.sparse_dim()])
    indices = t._indices().detach().cpu().numpy()
    flat = np.ravel_multi_index(tuple(indices), sparse_shape) if indices.shape[1] else np.zeros(0, np.int64)
    values = t._values().detach().cpu().numpy()
    dense_shape = (int(np.prod(sparse_shape, dtype=np.int64)), *t.shape[t.sparse_dim():])
    return RowSparse(np.asarray(flat, dtype=np.int64), values, dense_shape)


def from_rowsparse(rs: RowSparse, like: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """The COO tensor of ``like``'s shape, dtype and device holding ``rs``'s rows (divided by ``divisor``)."""
    sparse_shape = tuple(like.shape[: like.sparse_dim()])
    indices = np.stack(np.unravel_index(np.asarray(rs.indices, dtype=np.int64), sparse_shape)) \
        if len(sparse_shape) else np.zeros((0, rs.nnz), np.int64)
    values = torch.from_numpy(np.ascontiguousarray(rs.values))
    if divisor != 1.0:
        values = values / divisor
    out = torch.sparse_coo_tensor(torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)),
                                  values.to(like.dtype), like.shape, check_invariants=False)  # in range: checked
    return out.to(like.device)


class SparseHandle:
    """Horovod's handle of ``sparse_allreduce_async``: call it for the result (or pass it to ``synchronize``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __call__(self) -> torch.Tensor:
        return wait(self.handle)

    def poll(self) -> bool:
        """True once the gather has completed."""
        return bool(self.handle.poll())


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: Any = global_process_set) -> SparseHandle:
    """Start summing (or averaging) a sparse COO tensor over the process set by gathering its entries.

    Args:
        tensor: a ``torch.sparse_coo`` tensor; the same dtype and shape on every rank.
        name: the name the ranks' calls match by.
        op: Average (the values divided by the set's size) or Sum.
        process_set: the ranks.

    Returns:
        A handle: call it (or ``hvd.synchronize`` it) for the result, a COO
        tensor holding every rank's entries, in rank order (not coalesced,
        as in Horovod).
    """
    what = "hvd.sparse_allreduce_async"

    def prepare(info: SetInfo) -> Prepared:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            raise TypeError(f"{what}: tensor: expected a torch.sparse_coo tensor, got "
                            f"{getattr(tensor, 'layout', type(tensor).__name__)}")
        reduce_op = resolve_op(op, None, what)
        if reduce_op not in (Average, Sum):
            raise ValueError(f"{what}: op: expected Average or Sum, got {ReduceOp(reduce_op).name}")
        rs = to_rowsparse(tensor)
        values = torch.from_numpy(np.ascontiguousarray(rs.values))
        row = int(np.prod(rs.dense_shape[1:], dtype=np.int64)) * values.element_size()
        size = len(info.ranks)

        def finish(response: Any, outputs: list[Any]) -> torch.Tensor:
            indices, raw = outputs
            got = torch.from_numpy(raw).view(values.dtype).reshape((indices.size, *rs.dense_shape[1:])) \
                if raw.size else torch.empty((0, *rs.dense_shape[1:]), dtype=values.dtype)
            gathered = RowSparse(indices, got.numpy(), rs.dense_shape, validate=False)
            return from_rowsparse(gathered, tensor, float(size) if reduce_op == Average else 1.0)

        fields = {"entries": ((dtype_name(tensor), (rs.nnz, *tensor.shape)),), "op": int(reduce_op),
                  "splits": (rs.nnz,)}
        return fields, Local([np.ascontiguousarray(rs.indices, dtype=np.int64), raw_bytes(values)], [row]), finish

    set_of(what, process_set)
    return SparseHandle(submit(what, "sparse", process_set, name, prepare, False))
