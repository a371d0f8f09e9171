"""What a launch gave the ranks, one check per ``--mode``; for ``tests/test_launch.py``.

Run under ``conftest.run_job`` (any MPI's ``mpiexec``):

- ``env``: every rank writes ``rank R of N | VALUE`` (VALUE: ``$LAUNCH_PROBE``)
  in one write, after which rank 0 writes the MPI library's vendor as
  ``vendor NAME``.
- ``sleep``: every rank sleeps ``--seconds`` (a job that runs past its limit).
- ``escape``: rank 0 starts a ``sleep`` in a session of its own that outlives
  the job (a process the launcher does not know of), then all ranks exit.
- ``ulfm``: on a duplicate of ``MPI.COMM_WORLD`` with ``MPI.ERRORS_RETURN``,
  rank 0 SIGKILLs rank ``--victim`` while that rank waits in a barrier that
  the others have not entered. The survivors' next Allreduce must fail with
  ``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED``); they revoke, shrink and
  sum their ranks on the shrunk communicator, and each prints
  ``rank R | error CLASS | shrunk to S | sum T``. They exit without
  ``MPI_Finalize``: under Open MPI 5.0.11 it hangs in about 1 run of 4 once a
  rank has failed (its fence waits for the lost rank); without it, ``mpiexec``
  exits 0 every time.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

import mpi4py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["env", "sleep", "escape", "ulfm"], required=True)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--victim", type=int, default=2)
    args = parser.parse_args()
    mpi4py.rc.finalize = args.mode != "ulfm"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if args.mode == "env":
        sys.stdout.write(f"rank {rank} of {size} | {os.environ.get('LAUNCH_PROBE')}\n")
        sys.stdout.flush()
        world.Barrier()
        if rank == 0:
            vendor = MPI.get_vendor()[0]
            sys.stdout.write(f"vendor {vendor}\n")
            sys.stdout.flush()
    elif args.mode == "sleep":
        time.sleep(args.seconds)
    elif args.mode == "escape":
        if rank == 0:
            subprocess.Popen(["sleep", str(args.seconds)], start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        world.Barrier()
    else:
        ulfm(world, args.victim)


def ulfm(world: Any, victim: int) -> None:
    from mpi4py import MPI

    comm = world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    pids = comm.allgather(os.getpid())
    comm.Barrier()
    if rank == victim:
        comm.Barrier()  # the others never enter it: killed while waiting here
        raise SystemExit(f"rank {rank}: still alive")
    if rank == 0:
        os.kill(pids[victim], signal.SIGKILL)
    error = "none"
    try:
        for _ in range(100):
            comm.allreduce(1)
            time.sleep(0.05)
    except MPI.Exception as exc:
        error = {MPI.ERR_PROC_FAILED: "PROC_FAILED", MPI.ERR_REVOKED: "REVOKED"}.get(exc.Get_error_class(),
                                                                                  str(exc.Get_error_class()))
    comm.Revoke()
    shrunk = comm.Shrink()
    total = shrunk.allreduce(rank)
    sys.stdout.write(f"rank {rank} | error {error} | shrunk to {shrunk.Get_size()} | sum {total}\n")
    sys.stdout.flush()
    shrunk.Free()
    comm.Free()


if __name__ == "__main__":
    main()
