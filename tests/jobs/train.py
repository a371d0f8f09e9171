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
  runner calls ``MPI_Abort`` and the whole job ends at once; under plain
  ``python`` the reducer's exception hook does the same. With that hook
  turned off (``MPI_GRADREDUCER_ABORT_ON_EXCEPTION=0``) the failing rank
  waits in ``MPI_Finalize`` and the others in the reducer's collective: only
  the watchdog (``--timeout``) ends that job, and with ``--timeout none`` it
  hangs.
- ``kill``: the rank sends itself SIGKILL; the launcher ends the job.
- ``stall``: the rank sleeps ``--sleep`` seconds. The others wait in the
  reducer's collective until the watchdog names it and aborts the job.
- ``busy``: the rank computes in Python for ``--sleep`` seconds (holding and
  releasing the GIL as pure Python does), like ``stall`` otherwise.
- ``skip``: the rank skips that one reduction, and after its last step
  sleeps ``--sleep`` seconds (as if evaluating) before freeing the reducer:
  the others wait for it in their last call while it is one call behind.
- ``exit``: the rank calls ``sys.exit(3)``; it waits in ``MPI_Finalize``.

``--stall-warning`` sets the reducer's ``stall_warning``; ``--torch`` imports
torch and keeps its thread pool busy on a background thread, as a training
job would.

With ``--validate first`` the calls after the first skip the cross-rank
validation, so the others wait in the Allreduce of the first bucket.

Rank 0 first prints ``plan: N buckets, bucket 0 = B bytes``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer, broadcast_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["none", "raise", "kill", "stall", "busy", "skip", "exit"],
                        default="none")
    parser.add_argument("--rank", type=int, default=2, help="the rank that misbehaves")
    parser.add_argument("--step", type=int, default=4, help="the step at which it does (from 1)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", default="none", help="the reducer's timeout in seconds, or none")
    parser.add_argument("--stall-warning", default="none", help="the reducer's stall_warning in seconds, or none")
    parser.add_argument("--validate", default="always")
    parser.add_argument("--torch", action="store_true", help="import torch and keep its threads busy")
    parser.add_argument("--sleep", type=float, default=300.0, help="how long a stalled rank sleeps")
    parser.add_argument("--inputs", type=int, default=16, help="the model's inputs (its weights: inputs x 8)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds each rank sleeps before each step")
    parser.add_argument("--progress", action="store_true", help="each rank prints a line after each step")
    args = parser.parse_args()

    if args.torch:
        busy_torch()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((32, args.inputs)).astype(np.float32)
    y = x @ np.linspace(-1, 1, args.inputs * 8, dtype=np.float32).reshape(args.inputs, 8) + 0.5

    w = np.zeros((args.inputs, 8), np.float32)
    b = np.zeros(8, np.float32)
    broadcast_parameters([w, b])
    timeout = None if args.timeout == "none" else float(args.timeout)
    warning = None if args.stall_warning == "none" else float(args.stall_warning)
    reducer = DistributedGradReducer([w, b], timeout=timeout, stall_warning=warning, validate=args.validate)
    if rank == 0:
        say(f"plan: {len(reducer.buckets)} buckets, bucket 0 = {reducer.buckets[0].nbytes} bytes")

    for step in range(1, args.steps + 1):
        time.sleep(args.pause)
        err = x @ w + b - y
        grads = [2 / len(x) * x.T @ err, 2 / len(x) * err.sum(axis=0)]
        if step == args.step and rank == args.rank:
            if args.fault == "skip":
                say(f"rank {rank}: skipping the reduction of step {step}")
                continue
            inject(args.fault, args.sleep, rank, step)
        reducer(grads)
        w -= 0.05 * grads[0]
        b -= 0.05 * grads[1]
        if args.progress:
            say(f"rank {rank}: step {step} done")

    if args.fault == "skip" and rank == args.rank:
        say(f"rank {rank}: evaluating for {args.sleep:g} s")
        time.sleep(args.sleep)
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
    if fault == "busy":
        say(f"rank {rank}: computing for {sleep:g} s at step {step}")
        end = time.monotonic() + sleep
        while time.monotonic() < end:
            sum(i * i for i in range(1000))
    if fault == "exit":
        say(f"rank {rank}: exiting at step {step}")
        sys.exit(3)


def busy_torch() -> None:
    """Import torch and run small matrix products on a daemon thread, for good."""
    import torch

    def spin() -> None:
        a = torch.randn(64, 64)
        while True:
            a = torch.tanh(a @ a)

    threading.Thread(target=spin, name="torch-work", daemon=True).start()


def say(line: str) -> None:
    """Print one line with a single write, so that ranks' lines never interleave."""
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    main()
