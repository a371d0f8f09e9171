"""Command lines of the benchmarks under MPI: one rank speaks, every rank exits alike.

Under ``mpiexec`` every rank parses the same command line. :class:`RankParser`
prints help, usage and errors on rank 0 only; :func:`parse` makes every rank
leave with the same exit status (or none leave) even if their parsing
differed; :func:`start` adds the options the host and GPU benchmarks share.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from mpi4py import MPI

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

from .network import parse_link_rate
from .output import one_line, rank0_printer

__all__ = ["RankParser", "add_network_options", "add_shared_options", "check_shared", "parse", "run_as_script",
           "start"]

#: The exit status of a rank whose parsing went through (no exit).
_GO_ON = -1


class RankParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` that prints on one rank only.

    Args:
        *args: as for :class:`argparse.ArgumentParser`.
        rank: this process's rank; only rank 0 prints help, usage and errors.
        **kwargs: as for :class:`argparse.ArgumentParser`.
    """

    def __init__(self, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """Print the help (rank 0 only)."""
        if self.rank == 0:
            super().print_help(file)

    def print_usage(self, file: SupportsWrite[str] | None = None) -> None:
        """Print the usage line (rank 0 only)."""
        if self.rank == 0:
            super().print_usage(file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        """Exit with ``status``; rank 0 writes ``message`` to stderr first."""
        if message and self.rank == 0:
            sys.stderr.write(message)
            sys.stderr.flush()
        raise SystemExit(status)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str], comm: MPI.Comm,
          check: Callable[[argparse.Namespace], str | None] | None = None) -> argparse.Namespace:
    """Parse ``argv`` on every rank of ``comm``; all go on, or all exit with the same status (collective).

    Args:
        parser: the parser (a :class:`RankParser`, so that one rank prints).
        argv: the arguments.
        comm: the ranks that must agree.
        check: returns a message for options that parse but are not acceptable;
            the message becomes a usage error (status 2).

    Returns:
        The options, when every rank parsed them.

    Raises:
        SystemExit: on every rank, with the largest status of any rank, when
            some rank's parsing ended (``--help`` gives 0, an error 2).
    """
    status = _GO_ON
    args = None
    try:
        args = parser.parse_args(list(argv))
        problem = check(args) if check is not None else None
        if problem:
            parser.error(problem)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    status = comm.allreduce(status, op=MPI.MAX)
    if status != _GO_ON:
        raise SystemExit(status)
    assert args is not None  # parsed: no rank ended
    return args


def add_shared_options(parser: argparse.ArgumentParser, reps: int) -> None:
    """Add the options of the host and GPU benchmarks: workload sizes, repetitions, results file.

    Args:
        parser: the parser to extend.
        reps: the default of ``--reps``.
    """
    parser.add_argument("--scale", type=float, default=1.0,
                        help="bert-base size in (0, 1]: fraction of its 12 layers and of its vocabulary (default 1)")
    parser.add_argument("--small-count", type=int, default=1000,
                        help="many-small: number of tensors (default 1000)")
    parser.add_argument("--small-size", type=int, default=1024,
                        help="many-small: elements per tensor (default 1024)")
    parser.add_argument("--reps", type=int, default=reps, help=f"timed repetitions per method (default {reps})")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")


def _link_rate(text: str) -> float:
    try:
        return parse_link_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--link-rate: ")) from None


def _nics(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    if not names:
        raise argparse.ArgumentTypeError(f"expected interface names separated by commas, got {text!r}")
    return names


def add_network_options(parser: argparse.ArgumentParser) -> None:
    """Add the options of a run across hosts: ``--link-rate`` and ``--nics`` (see :mod:`.network`).

    ``args.link_rate`` is the rate in bits per second (None without the
    option); ``args.nics`` the interface names to count (None: all but the loopback).

    Args:
        parser: the parser to extend.
    """
    parser.add_argument("--link-rate", type=_link_rate, default=None, metavar="RATE",
                        help="each host's link rate, e.g. 1gbit, 500mbit, 2.5gbit: print the wire bound "
                             "2(H-1)/H x gradient bytes / RATE (H hosts) and each method's time as a multiple of it")
    parser.add_argument("--nics", type=_nics, default=None, metavar="NAMES",
                        help="across hosts, the interfaces whose sent bytes are counted, e.g. eth0 or eth0,eth1 "
                             "(default: all but the loopback)")


def check_shared(args: argparse.Namespace) -> str | None:
    """What is wrong with the options of :func:`add_shared_options`, or None."""
    if not 0.0 < args.scale <= 1.0:
        return f"--scale: expected a number in (0, 1], got {args.scale}"
    if args.reps < 1 or args.warmup < 0:
        return f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}"
    if args.small_count < 1 or args.small_size < 1:
        return f"--small-count and --small-size must be >= 1, got {args.small_count} and {args.small_size}"
    return None


def start(make_parser: Callable[[int], argparse.ArgumentParser], argv: Sequence[str], comm: MPI.Intracomm | None,
          check: Callable[[argparse.Namespace], str | None] | None = None, shared: bool = True
          ) -> tuple[argparse.Namespace, MPI.Intracomm, Callable[[str], None]]:
    """Parse and check a benchmark's options (collective), and set up its run.

    Args:
        make_parser: builds the benchmark's parser for a given rank.
        argv: the arguments.
        comm: the communicator to run over (default ``MPI.COMM_WORLD``).
        check: the benchmark's own check of its options, after :func:`check_shared`.
        shared: the parser has :func:`add_shared_options`' options, to be checked (False: it has not).

    Returns:
        The options, the run's own duplicate of ``comm`` (free it when done)
        and a ``say`` that prints on rank 0 only.

    Raises:
        SystemExit: on every rank, as :func:`parse`.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    def checks(args: argparse.Namespace) -> str | None:
        return (check_shared(args) if shared else None) or (check(args) if check is not None else None)

    args = parse(make_parser(comm.Get_rank()), argv, comm, checks)
    own = comm.Dup()
    return args, own, rank0_printer(own.Get_rank())


def run_as_script(main: Callable[[], Any], name: str) -> None:
    """Run ``main()``; an unexpected error ends the whole job, since other ranks may wait in a collective.

    Rank 0 prints the full traceback, every other rank one line (where and
    what), then the job is aborted with status 1. ``SystemExit`` passes
    through, with the same status on every rank.

    Args:
        main: the benchmark's entry point.
        name: the benchmark's name, for the one-line reports.
    """
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:
        world = MPI.COMM_WORLD
        if world.Get_rank() == 0:
            traceback.print_exc()
        else:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            what = one_line("".join(traceback.format_exception_only(type(exc), exc)))
            sys.stderr.write(f"{name}: rank {world.Get_rank()}: {what} "
                             f"({os.path.basename(frame.filename)}:{frame.lineno})\n")
            time.sleep(1.0)  # let rank 0's full report out first
        sys.stderr.flush()
        world.Abort(1)
