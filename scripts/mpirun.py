#!/usr/bin/env python3
"""``mpiexec`` for whichever MPI this Python has: the same line under MPICH, Open MPI and Intel MPI.

::

    python scripts/mpirun.py -n 4 -- python -m pytest tests --only-mpi
    python scripts/mpirun.py -n 8 --oversubscribe --env OMP_NUM_THREADS=1 -- python train.py
    python scripts/mpirun.py -n 4 --ft -- python elastic.py        # ULFM (Open MPI 5)
    python scripts/mpirun.py -n 2 --print -- python job.py         # print the command line only

It finds the ``mpiexec`` beside this Python (else the first on ``PATH``),
writes its command line with :class:`mpi_gradreducer.launch.Launcher` and
replaces itself with it (signals and the exit status are ``mpiexec``'s). As
root, Open MPI's consent to run as root is given.

Exit status: ``mpiexec``'s; 2 for bad arguments or no usable ``mpiexec``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import mpi4py

mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only launches: no MPI here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi_gradreducer.launch import Launcher  # noqa: E402


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpirun.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--ranks", type=int, required=True, help="how many ranks")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than cores (Open MPI refuses it otherwise); idle ranks yield")
    p.add_argument("--ft", action="store_true", help="ULFM fault tolerance (Open MPI 5's --with-ft ulfm)")
    p.add_argument("--tag-output", action="store_true", help="prefix each output line with its rank")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a variable for every rank")
    p.add_argument("--mpiexec", help="the mpiexec to use (default: beside this Python, else on PATH)")
    p.add_argument("--print", action="store_true", help="print the command line instead of running it")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    args = p.parse_args(argv)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        p.error("no program given (mpirun.py -n 4 -- python job.py)")
    bad = [e for e in args.env if "=" not in e]
    if bad:
        p.error(f"--env: expected NAME=VALUE, got {bad[0]!r}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    try:
        launcher = Launcher.detect(args.mpiexec) if args.mpiexec else Launcher.find()
        cmd = launcher.command(args.program, ranks=args.ranks, oversubscribe=args.oversubscribe,
                               fault_tolerance=args.ft, tag_output=args.tag_output,
                               env=dict(e.split("=", 1) for e in args.env))
    except (RuntimeError, ValueError) as exc:
        print(f"mpirun.py: {exc}", file=sys.stderr)
        return 2
    if args.print:
        print(shlex.join(cmd))
        return 0
    os.execve(cmd[0], cmd, launcher.environment())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
