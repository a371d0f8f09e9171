"""Where the time of one call goes, when the same arrays come again: each step timed alone, and in turns.

    python scripts/profile_call.py                          # the digits MLP's 4 float32 gradients (38 KB)
    python scripts/profile_call.py --count 1000 --size 1024  # many-small: 1000 x 4 KiB
    mpiexec -n 4 python scripts/profile_call.py              # the same on 4 ranks (rank 0 prints)

Prints, in µs per call:

- each step alone (the best of ``--repeat`` runs of ``--number`` calls, so
  that another job's burst does not count): the whole call of the reducer,
  with the same arrays as the call before (a replay); the least a packing
  reducer must do (the benchmark's ``packed-floor``, written by hand: one MPI
  copy in, one ``Allreduce``, the scaling, one MPI copy out); then each step
  of the call on the reducer's own objects: the proof that the arrays are the
  last call's, unchanged; opening the call; writing the call header and
  reading its sums; the copies in; the collectives; the scaling; the copies
  out; the watchdog's arming. What the steps leave of the whole call is the
  rest: the calls between them;
- in turns (medians of ``--reps`` turns, a barrier before each case): the
  floor, the steps back to back with nothing between them (bare, then with
  the proof, then with the header too), and the call: the least this design
  can cost, next to what it costs;
- how many Python functions one call runs (``cProfile``'s count).

This reads the reducer's internals (it is a developer's tool): a step that is
renamed must be renamed here too (``tests/test_profile_call.py`` runs it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import timeit
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core import header
from mpi_gradreducer._core.call import open_call

#: The digits MLP 64-128-10: two weight matrices and two biases.
MLP: list[tuple[int, ...]] = [(64, 128), (128,), (128, 10), (10,)]


def _best(fn: Callable[[], object], number: int, repeat: int) -> float:
    """The best time per call of ``fn``, in µs."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _floor(grads: list[np.ndarray]) -> tuple[Callable[[], None], Callable[[], None]]:
    """The benchmark's ``packed-floor``: one MPI copy in (an ``hindexed`` datatype), one Allreduce, the scaling,
    one MPI copy out; nothing else. Returns it, and what frees its MPI handles."""
    buf = np.empty(sum(g.size for g in grads), grads[0].dtype)
    local, comm, scale = MPI.COMM_SELF.Dup(), MPI.COMM_WORLD, 1.0 / MPI.COMM_WORLD.Get_size()
    members = MPI.BYTE.Create_hindexed([g.nbytes for g in grads], [MPI.Get_address(g) for g in grads]).Commit()

    def floor() -> None:
        local.Sendrecv([MPI.BOTTOM, 1, members], 0, 0, [buf, MPI.BYTE], 0, 0)
        comm.Allreduce(MPI.IN_PLACE, buf)
        np.multiply(buf, scale, out=buf)
        local.Sendrecv([buf, MPI.BYTE], 0, 0, [MPI.BOTTOM, 1, members], 0, 0)

    def free() -> None:
        members.Free()
        local.Free()
    return floor, free


class _Steps:
    """A reducer whose gradients are armed for replay, and each step of its call as a function of its own."""

    def __init__(self, r: DistributedGradReducer, grads: list[np.ndarray]) -> None:
        for _ in range(3):  # checked, remembered, armed: from here on, each call is a replay
            r(grads)
        self.r, self.grads = r, grads
        replay, plan, ctx = r._replay, r._plan, r._ctx
        self.checked = replay.recall(grads)
        assert self.checked is not None, "the arrays were not armed for replay"
        self.call = open_call(1, grads, plan, self.checked, check_finite=False)
        first_message = ctx.first
        if first_message._message is None:
            first_message._allocate()
        self.slots, message = first_message._slots, first_message._message
        self.members = [(f, f.members_of(grads)) for f in plan.buffers]
        first = plan.buffers[0]
        # what each collective sums: the first message, the rest of the first bucket, the other buckets
        self.parts = [message] + ([first.buffer[first_message.head_count:]] if not first_message.whole else []) \
            + [f.buffer for f in plan.buffers[1:]]
        self.scale = 1.0 / r._comm.Get_size()

    def proof(self) -> None:
        self.r._replay.recall(self.grads)

    def open(self) -> None:
        open_call(1, self.grads, self.r._plan, self.checked, check_finite=False)

    def write_header(self) -> None:
        self.call.local.write(self.slots)

    def read_header(self) -> None:
        header.Summary.of(self.slots)

    def copies_in(self) -> None:
        for f, m in self.members:
            f.pack(m, 1.0, (), self.r._replay.epoch)

    def collectives(self) -> None:
        for part in self.parts:
            self.r._comm.Allreduce(MPI.IN_PLACE, part)

    def scaling(self) -> None:
        if self.scale != 1.0:  # as the reducer: a sum over one rank is not scaled
            for f, _ in self.members:
                np.multiply(f.buffer, self.scale, out=f.buffer)

    def copies_out(self) -> None:
        for f, m in self.members:
            f.unpack(m, 1.0, (), packed=True)

    def arming(self) -> None:
        watchdog = self.r._instrument.watchdog
        if watchdog is not None:
            for _ in self.parts:
                watchdog.arm(lambda: "bucket", 1)
                watchdog.disarm()

    def back_to_back(self, proof: bool, header: bool) -> Callable[[], None]:
        """The least of the call's steps, one after the other, with or without the proof and the header."""
        def run() -> None:
            if proof:
                self.proof()
            if header:
                self.write_header()
            self.copies_in()
            self.collectives()
            if header:
                self.read_header()
            self.scaling()
            self.copies_out()
        return run


def alone(steps: _Steps, floor: Callable[[], None], number: int, repeat: int) -> list[tuple[str, float]]:
    """Each step timed alone (best of ``repeat`` runs of ``number`` calls), µs per call, then the rest."""
    whole = _best(lambda: steps.r(steps.grads), number, repeat)
    rows = [(what, _best(fn, number, repeat)) for what, fn in (
        ("the proof: the same arrays, unchanged", steps.proof), ("opening the call", steps.open),
        ("writing the header", steps.write_header), ("reading its sums", steps.read_header),
        ("the copies in", steps.copies_in), ("the collectives", steps.collectives),
        ("the scaling", steps.scaling), ("the copies out", steps.copies_out),
        ("the watchdog's arming", steps.arming))]
    return [("the call", whole), ("the floor", _best(floor, number, repeat)), *rows,
            ("the rest", whole - sum(t for _, t in rows))]


def interleaved(steps: _Steps, floor: Callable[[], None], reps: int) -> list[tuple[str, float]]:
    """Medians (µs) of the floor, the steps back to back (bare, + the proof, + the header) and the call.

    Taken in turns, each after a barrier, so that every case meets the same
    machine: on more ranks than cores, a µs of a rank's work before the
    collective costs the collective more than a µs.
    """
    comm = MPI.COMM_WORLD
    cases = {"the floor": floor, "the steps back to back": steps.back_to_back(False, False),
             "  + the proof": steps.back_to_back(True, False), "  + the header": steps.back_to_back(True, True),
             "the call": lambda: steps.r(steps.grads)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for what, fn in cases.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[what].append(time.perf_counter() - t0)
    return [(what, float(np.median(t[reps // 10:])) * 1e6) for what, t in times.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=0, help="this many gradients of --size float32 "
                        "(default: the digits MLP)")
    parser.add_argument("--size", type=int, default=1024, help="elements per gradient with --count")
    parser.add_argument("--number", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings per step; the best is printed")
    parser.add_argument("--reps", type=int, default=400, help="turns of the interleaved timing")
    args = parser.parse_args(argv)
    shapes: list[tuple[int, ...]] = [(args.size,)] * args.count if args.count else MLP
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    floor, free = _floor(grads)
    try:
        with DistributedGradReducer([np.zeros(s, np.float32) for s in shapes]) as r:
            steps = _Steps(r, grads)
            rows = alone(steps, floor, args.number, args.repeat)
            turns = interleaved(steps, floor, args.reps)
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [r(grads) for _ in range(args.number)])
            functions = pstats.Stats(profiler).total_calls / args.number  # type: ignore[attr-defined]
    finally:
        free()
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
    print(f"{len(shapes)} float32 gradients, {nbytes} bytes, {MPI.COMM_WORLD.Get_size()} rank(s)")
    print(f"each step alone, us per call, best of {args.repeat} x {args.number}:")
    for what, value in rows:
        print(f"  {what:40s} {value:9.2f}")
    print(f"in turns, median us of {args.reps}:")
    for what, value in turns:
        print(f"  {what:40s} {value:9.2f}")
    print(f"  {'Python function calls per call':40s} {functions:9.0f}")


if __name__ == "__main__":
    main()
