"""Ranks that join early while the others compute slowly, or while one of them stalls.

Used by ``tests/test_join.py``; runs as a whole MPI job::

    mpiexec -n 3 python -m mpi4py tests/jobs/join_stall.py --pace 2

The last rank joins at once; the others make ``--steps`` calls, each after
``--pace`` seconds of "computing". With ``--stall-rank R`` rank R sleeps
``--sleep`` seconds before call ``--stall-at`` instead. Every rank ends with
``rank R: finished, contributors C``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=1.5)
    parser.add_argument("--stall-warning", type=float, default=0.5)
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-at", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=60.0)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    params = [np.zeros((16, 8), np.float32), np.zeros(8, np.float32)]
    reducer = DistributedGradReducer(params, timeout=args.timeout, stall_warning=args.stall_warning)
    if rank < size - 1:
        for step in range(1, args.steps + 1):
            time.sleep(args.sleep if (rank, step) == (args.stall_rank, args.stall_at) else args.pace)
            reducer([np.full(p.shape, rank + step, p.dtype) for p in params])
            say(f"rank {rank}: call {step}, contributors {reducer.contributors}")
    reducer.join()
    reducer.free()
    say(f"rank {rank}: finished, contributors {reducer.contributors}")


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
