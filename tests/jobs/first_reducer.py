"""How long the first ``DistributedGradReducer`` of a fresh process takes to build, and what it imported.

Used by ``tests/test_longrun.py``; runs as a whole MPI job::

    mpiexec -n 4 python -m mpi4py tests/jobs/first_reducer.py

Every rank builds a reducer over a small float32 model, then a second one, and
rank 0 prints one line per rank::

    rank R | first 0.0123 s | second 0.0041 s | imported ml_dtypes=False cupy=False
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer

SHAPES = [(300, 300), (300,), (300, 10), (10,), (7, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    comm = MPI.COMM_WORLD
    params = [np.zeros(s, np.float32) for s in SHAPES]
    comm.Barrier()
    t0 = time.perf_counter()
    first = DistributedGradReducer(params)
    t1 = time.perf_counter()
    second = DistributedGradReducer(params)
    t2 = time.perf_counter()
    row = (comm.Get_rank(), t1 - t0, t2 - t1, "ml_dtypes" in sys.modules, "cupy" in sys.modules)
    rows = comm.gather(row)
    first.free()
    second.free()
    if rows is not None:
        for rank, a, b, ml, cp in rows:
            print(f"rank {rank} | first {a:.4f} s | second {b:.4f} s | imported ml_dtypes={ml} cupy={cp}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
