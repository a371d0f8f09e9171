"""The one place that hands gradient data to MPI."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

__all__ = ["CHUNK_BYTES", "allreduce"]

#: Largest single Allreduce. MPICH's shared-memory Allreduce is markedly slower
#: per byte on messages above a few MiB, and a chunk that was just reduced is
#: still in cache when it is scaled or unpacked.
CHUNK_BYTES = 1 << 20


def allreduce(
    comm: MPI.Comm,
    buf: Any,
    scale: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    op: MPI.Op = MPI.SUM,
    after: Optional[Callable[[Any], None]] = None,
) -> None:
    """Sum a 1-D contiguous buffer over ``comm`` in place, chunk by chunk.

    Each chunk is multiplied by ``scale`` right after its Allreduce, while it
    is still in cache, so that a mean costs no extra pass over memory.

    Args:
        comm: the communicator.
        buf: 1-D C-contiguous host array.
        scale: factor applied to the result (1.0: none).
        chunk_bytes: bytes per Allreduce.
        op: the MPI reduction.
        after: called with each reduced (and scaled) chunk.
    """
    n = buf.shape[0]
    step = max(1, chunk_bytes // max(1, buf.itemsize))
    for start in range(0, n, step):
        chunk = buf[start : start + step]
        comm.Allreduce(MPI.IN_PLACE, chunk, op=op)
        if scale != 1.0:
            np.multiply(chunk, scale, out=chunk)
        if after is not None:
            after(chunk)
