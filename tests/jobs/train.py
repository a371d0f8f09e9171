"""A small data-parallel training job, with one fault injected on one rank.

Used by ``tests/test_faults.py``; runs as a whole MPI job, the documented way::

    mpiexec -n 4 python -m mpi4py tests/jobs/train.py --fault raise

Every rank fits the same linear model to its own shard of data by gradient
descent, averaging the gradients with ``DistributedGradReducer``. With
``--fault``, rank ``--rank`` misbehaves just before its reduction of step
``--step`` (steps count from 1, like the reducer's calls):

- ``none``: no fault. Every rank ends with ``rank R: finished, weights D``,
  where D is a digest of the trained weights (the same on every rank).
- ``raise``: an uncaught ``RuntimeError``. Under ``python -m mpi4py`` the
  runner calls ``MPI_Abort`` and the whole job ends at once. Under plain
  ``python`` the failing rank waits in ``MPI_Finalize`` and the others in the
  reducer's collective: only the watchdog (``--timeout``) ends that job, and
  with ``--timeout none`` it hangs.
- ``kill``: the rank sends itself SIGKILL; the launcher ends the job.
- ``stall``: the rank sleeps ``--sleep`` seconds. The others wait in the
  reducer's collective until the watchdog names it and aborts the job.

With ``--validate first`` the calls after the first skip the cross-rank
validation, so the others wait in the Allreduce of the first bucket.

Rank 0 first prints ``plan: N buckets, bucket 0 = B bytes``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer, broadcast_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["none", "raise", "kill", "stall"], default="none")
    parser.add_argument("--rank", type=int, default=2, help="the rank that misbehaves")
    parser.add_argument("--step", type=int, default=4, help="the step at which it does (from 1)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", default="none", help="the reducer's timeout in seconds, or none")
    parser.add_argument("--validate", default="always")
    parser.add_argument("--sleep", type=float, default=300.0, help="how long a stalled rank sleeps")
    parser.add_argument("--tag", default="", help="ignored: marks this job's processes for the test")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = x @ np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8) + 0.5

    w = np.zeros((16, 8), np.float32)
    b = np.zeros(8, np.float32)
    broadcast_parameters([w, b])
    timeout = None if args.timeout == "none" else float(args.timeout)
    reducer = DistributedGradReducer([w, b], timeout=timeout, validate=args.validate)
    if rank == 0:
        say(f"plan: {len(reducer.buckets)} buckets, bucket 0 = {reducer.buckets[0].nbytes} bytes")

    for step in range(1, args.steps + 1):
        err = x @ w + b - y
        grads = [2 / len(x) * x.T @ err, 2 / len(x) * err.sum(axis=0)]
        if step == args.step and rank == args.rank:
            inject(args.fault, args.sleep, rank, step)
        reducer(grads)
        w -= 0.05 * grads[0]
        b -= 0.05 * grads[1]

    reducer.free()
    digest = hashlib.sha256(w.tobytes() + b.tobytes()).hexdigest()[:16]
    say(f"rank {rank}: finished, weights {digest}")


def inject(fault: str, sleep: float, rank: int, step: int) -> None:
    """Misbehave in the way ``fault`` names."""
    if fault == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "stall":
        say(f"rank {rank}: stalling for {sleep:g} s at step {step}")
        time.sleep(sleep)


def say(line: str) -> None:
    """Print one line with a single write, so that ranks' lines never interleave."""
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
