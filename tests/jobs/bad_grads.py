"""Bad gradients on one rank only: every rank must raise, and no array may change.

Used by ``tests/test_faults.py``; runs as a whole MPI job::

    mpiexec -n 4 python -m mpi4py tests/jobs/bad_grads.py

After one good call (so that the reducer's buffers exist), each kind of bad
input is passed by one rank while the others pass good gradients. Each rank
prints one line per kind::

    rank R | KIND | unchanged=True | ValueError: rank B: grads[...]: ...

where ``unchanged`` says whether every array this rank passed still holds
what it held before the call (``| no error`` replaces the error when the call
did not raise). A final good call prints ``rank R | after | mean M``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer

SHAPES = [(3, 2), (4,), (2, 2, 2)]

#: Each kind of bad input and the rank that passes it (modulo the size).
KINDS = {"shape": 1, "readonly": 2, "aliased": 3, "count": 0}


def good_grads(rank: int) -> list[np.ndarray]:
    """Rank ``rank`` contributes ``rank + 1`` everywhere."""
    return [np.full(s, rank + 1.0, np.float32) for s in SHAPES]


def spoil(kind: str, grads: list[np.ndarray]) -> list[np.ndarray]:
    """Make ``grads`` wrong in the way ``kind`` names."""
    if kind == "shape":
        grads[1] = np.full(5, 7.0, np.float32)
    elif kind == "readonly":
        grads[2].setflags(write=False)
    elif kind == "aliased":
        grads[1] = grads[0].reshape(-1)[2:6]  # shares memory with grads[0]
    elif kind == "count":
        grads.pop()
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    params = [np.zeros(s, np.float32) for s in SHAPES]
    with DistributedGradReducer(params, timeout=20) as reducer:
        reducer(good_grads(rank))
        for kind, bad in KINDS.items():
            grads = good_grads(rank)
            if rank == bad % size:
                grads = spoil(kind, grads)
            before = [g.copy() for g in grads]
            try:
                reducer(grads)
            except (ValueError, TypeError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            else:
                outcome = "no error"
            unchanged = all(np.array_equal(g, c) for g, c in zip(grads, before, strict=True))
            say(f"rank {rank} | {kind} | unchanged={unchanged} | {outcome}")
        grads = good_grads(rank)
        reducer(grads)
    say(f"rank {rank} | after | mean {float(grads[0].flat[0]):g}")


def say(line: str) -> None:
    """Print one line with a single write, so that ranks' lines never interleave."""
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
