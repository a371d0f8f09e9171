"""The raw-MPI limit: in-place Allreduces over one preallocated buffer of a workload's bytes.

What no reducer can beat on the same bytes: no packing, no validation, no
Python per tensor; only ``MPI_Allreduce(MPI_IN_PLACE, ...)`` over one
contiguous float32 buffer, whole or in chunks. The buffer is allocated as the
reducer allocates its own (on huge pages from 1 MiB), so that the limit
has whatever the memory system gives the fastest buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core.backend import empty
from .output import size_label
from .timing import Case, all_close, expected_sum, fill_value, filler

__all__ = ["best_limit", "chunked_allreduce", "limit_cases"]


def chunked_allreduce(comm: MPI.Comm, buf: np.ndarray, chunk_elems: int) -> None:
    """Sum ``buf`` across ``comm`` in place, ``chunk_elems`` elements per Allreduce."""
    for start in range(0, buf.shape[0], chunk_elems):
        comm.Allreduce(MPI.IN_PLACE, buf[start : start + chunk_elems])


def limit_cases(comm: MPI.Comm, nbytes: int, chunks: Sequence[int], prefix: str = "limit"
                ) -> tuple[list[Case], dict[str, int]]:
    """One ``PREFIX@CHUNK`` case per chunk size, over one shared float32 buffer of ``nbytes``.

    Chunk sizes not below ``nbytes`` are dropped; the whole buffer at once
    (``PREFIX@whole``, chunk 0) is always there.

    Args:
        comm: the communicator.
        nbytes: the bytes to reduce.
        chunks: chunk sizes in bytes.
        prefix: the cases' name before ``@``.

    Returns:
        The cases, and each case's chunk size by name (0 for the whole).
    """
    buf = empty(max(1, -(-nbytes // 4)), np.dtype(np.float32), "cpu")
    buf[...] = 0
    value, total = fill_value(comm), expected_sum(comm)
    cases, sizes = [], {}
    for chunk in [c for c in chunks if 0 < c < nbytes] + [0]:
        elems = buf.shape[0] if chunk == 0 else max(1, chunk // 4)
        name = f"{prefix}@{size_label(chunk)}"
        sizes[name] = chunk
        cases.append(Case(name, filler([buf], value),
                          partial(chunked_allreduce, comm, buf, elems),
                          lambda: all_close([buf], total)))
    return cases, sizes


def best_limit(results: dict[str, dict[str, Any]], names: Iterable[str]) -> str:
    """The fastest (by median in ``results``) of the limit cases ``names``."""
    return min(names, key=lambda name: results[name]["median_ms"])
