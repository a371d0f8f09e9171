"""Ranks that build their reducers from different models: every rank must raise.

Used by ``tests/test_faults.py``; runs as a whole MPI job::

    mpiexec -n 4 python -m mpi4py tests/jobs/mismatch.py

For each kind of mismatch, one rank builds a model that differs from the
others' and every rank tries to construct a ``DistributedGradReducer``. Each
rank prints one line per kind::

    rank R | KIND | ValueError: the ranks disagree: ...

(or ``rank R | KIND | constructed`` if construction did not raise). Then
every rank builds a matching reducer, reduces rank values once and prints
``rank R | after | mean M``: the failed constructions left the ranks in step.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer

SHAPES = [(3, 2), (4,), (2, 2, 2)]


def model(kind: str, differs: bool) -> list[np.ndarray]:
    """The parameters; when ``differs``, changed in the way ``kind`` names."""
    params = [np.zeros(s, np.float32) for s in SHAPES]
    if differs and kind == "shape":
        params[1] = np.zeros((2, 2), np.float32)
    elif differs and kind == "dtype":
        params[0] = np.zeros((3, 2), np.float64)
    elif differs and kind == "count":
        params.append(np.zeros(1, np.float32))
    elif differs and kind == "order":
        params.reverse()
    return params


#: Each kind of mismatch and the rank whose model differs (modulo the size).
KINDS = {"shape": 3, "dtype": 1, "count": 3, "order": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    for kind, odd in KINDS.items():
        try:
            reducer = DistributedGradReducer(model(kind, rank == odd % size), timeout=20)
        except (ValueError, TypeError) as exc:
            say(f"rank {rank} | {kind} | {type(exc).__name__}: {exc}")
        else:
            say(f"rank {rank} | {kind} | constructed")
            reducer.free()
    params = model("", False)
    with DistributedGradReducer(params, timeout=20) as reducer:
        grads = [np.full(p.shape, float(rank), p.dtype) for p in params]
        reducer(grads)
    say(f"rank {rank} | after | mean {float(grads[0].flat[0]):g}")


def say(line: str) -> None:
    """Print one line with a single write, so that ranks' lines never interleave."""
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
