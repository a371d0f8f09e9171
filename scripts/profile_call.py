"""Where the time of one call goes, when the same arrays come again: each step timed alone, in one process.

    python scripts/profile_call.py                          # the digits MLP's 4 float32 gradients (38 KB)
    python scripts/profile_call.py --count 1000 --size 1024  # many-small: 1000 x 4 KiB

Prints, in µs per call (the best of ``--repeat`` runs of ``--number`` calls
each, so that another job's burst does not count):

- the whole call of the reducer, with the same arrays as the call before (a
  replay), and the least a packing reducer must do (the benchmark's
  ``packed-floor``, written by hand: one MPI copy in, one ``Allreduce``, the
  scaling, one MPI copy out);
- each step of the call, timed alone on the reducer's own objects: the proof
  that the arrays are the last call's, unchanged; opening the call; writing
  the call header and reading its sums; the copies in and out; the
  collective; the watchdog's arming around it. What the steps leave of the
  whole call is the rest: the calls between them;
- how many Python functions one call runs (``cProfile``'s count).

This reads the reducer's internals (it is a developer's tool): a step that is
renamed must be renamed here too (``tests/test_profile_call.py`` runs it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import timeit
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer, control
from mpi_gradreducer.call import open_call

#: The digits MLP 64-128-10: two weight matrices and two biases.
MLP: list[tuple[int, ...]] = [(64, 128), (128,), (128, 10), (10,)]


def _best(fn: Callable[[], object], number: int, repeat: int) -> float:
    """The best time per call of ``fn``, in µs."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _floor(grads: list[np.ndarray]) -> Callable[[], None]:
    """The benchmark's ``packed-floor``: one MPI copy in (an ``hindexed`` datatype), one Allreduce, the scaling,
    one MPI copy out; nothing else."""
    buf = np.empty(sum(g.size for g in grads), grads[0].dtype)
    local, comm, scale = MPI.COMM_SELF.Dup(), MPI.COMM_WORLD, 1.0 / MPI.COMM_WORLD.Get_size()
    members = MPI.BYTE.Create_hindexed([g.nbytes for g in grads], [MPI.Get_address(g) for g in grads]).Commit()

    def floor() -> None:
        local.Sendrecv([MPI.BOTTOM, 1, members], 0, 0, [buf, MPI.BYTE], 0, 0)
        comm.Allreduce(MPI.IN_PLACE, buf)
        np.multiply(buf, scale, out=buf)
        local.Sendrecv([buf, MPI.BYTE], 0, 0, [MPI.BOTTOM, 1, members], 0, 0)
    return floor


def profile(shapes: list[tuple[int, ...]], number: int, repeat: int) -> list[tuple[str, float]]:
    """The rows printed: (what, µs per call), then the function count as the last row."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    with DistributedGradReducer([np.zeros(s, np.float32) for s in shapes]) as r:
        for _ in range(3):  # checked, remembered, armed: from here on, each call is a replay
            r(grads)
        replay, plan, ctx = r._replay, r._plan, r._ctx
        checked = replay.recall(grads)
        assert checked is not None, "the arrays were not armed for replay"
        call = open_call(1, grads, plan, checked, check_finite=False)
        message, slots = ctx._first_message(), ctx._slots
        members = [(f, f.members_of(grads)) for f in plan.buffers]
        watchdog = r._instrument._watchdog
        comm = r._comm

        def pack() -> None:
            for f, m in members:
                f.pack(m, 1.0, (), replay.epoch)

        def unpack() -> None:
            for f, m in members:
                f.unpack(m, 1.0, (), packed=True)

        def collective() -> None:
            comm.Allreduce(MPI.IN_PLACE, message)
            for f, _ in members[1:]:
                comm.Allreduce(MPI.IN_PLACE, f.buffer)

        def arming() -> None:
            if watchdog is not None:
                for _ in members:
                    watchdog.arm(lambda: "bucket", 1)
                    watchdog.disarm()

        whole = _best(lambda: r(grads), number, repeat)
        steps = [
            ("the proof: the same arrays, unchanged", _best(lambda: replay.recall(grads), number, repeat)),
            ("opening the call", _best(lambda: open_call(1, grads, plan, checked, check_finite=False), number,
                                       repeat)),
            ("writing the header", _best(lambda: call.local.write(slots), number, repeat)),
            ("reading its sums", _best(lambda: control.Summary.of(slots), number, repeat)),
            ("the copies in", _best(pack, number, repeat)),
            ("the collectives", _best(collective, number, repeat)),
            ("the copies out", _best(unpack, number, repeat)),
            ("the watchdog's arming", _best(arming, number, repeat)),
        ]
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [r(grads) for _ in range(number)])
        functions = pstats.Stats(profiler).total_calls / number  # type: ignore[attr-defined]
    floor = _best(_floor(grads), number, repeat)
    return [("the call", whole), ("the floor", floor), *steps,
            ("the rest", whole - sum(t for _, t in steps)), ("Python function calls per call", functions)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=0, help="this many gradients of --size float32 "
                        "(default: the digits MLP)")
    parser.add_argument("--size", type=int, default=1024, help="elements per gradient with --count")
    parser.add_argument("--number", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings per step; the best is printed")
    args = parser.parse_args(argv)
    shapes: list[tuple[int, ...]] = [(args.size,)] * args.count if args.count else MLP
    rows = profile(shapes, args.number, args.repeat)
    nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
    print(f"{len(shapes)} float32 gradients, {nbytes} bytes, {MPI.COMM_WORLD.Get_size()} rank(s); "
          f"us per call, best of {args.repeat} x {args.number}")
    for what, value in rows[:-1]:
        print(f"  {what:40s} {value:9.2f}")
    print(f"  {rows[-1][0]:40s} {rows[-1][1]:9.0f}")


if __name__ == "__main__":
    main()
