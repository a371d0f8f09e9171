"""An elastic numpy training loop for the failure tests: a linear model on random float data.

Used by ``tests/test_elastic.py``, under Open MPI with fault tolerance::

    mpiexec --with-ft ulfm -n 4 python tests/jobs/elastic_train.py --out DIR --steps 40

Each step, the global batch of step ``s`` (random floats seeded by ``s``)
is shared among the ranks training now, by rank; the gradient is averaged
in rank order (``deterministic=True``), so that a run at a given size gives
the same bits whatever happened before. The state (parameters, optional
ballast, the step) is committed every step.

What the test reads, all under ``--out``:

- ``pid.R``: the process id of the process that started as rank R (a
  replacement writes ``pid.new.PID``);
- ``at.PID``: the phase this process is in now, ``PHASE STEP`` (``reduce``
  just before the reducer call, ``commit`` just before the commit, ``sync``
  at the start of a sync after a failure), rewritten at each phase;
- ``log.PID``: one line per event: ``start SIZE RANK``, ``host NAME``, ``commit S TIME``, ``resume S SIZE TIME``
  (after a change of ranks, with the step it goes on from), ``failure TEXT``
  (``TIME``: ``time.time()``);
- ``final.PID.npy``: the parameters at the end, with ``final.PID.txt``
  holding ``STEP SIZE``;
- ``resume.npz`` (with ``--save-resume``): the state rank 0 went on from
  after the first failure, for a fresh run to start from (``--load``).

``--step-seconds S``: the compute of a step (a sleep; default 0.02).
``--share-compute N``: S is the compute of the global batch over N ranks,
shared by the ranks training now: each sleeps S * N / size (a step at 3
ranks takes 4/3 as long as at 4, as with a constant global batch).
``--straggle PID_FILE_RANK:STEP``: that original rank sleeps before its
reducer call at that step (the others wait for it in the collective).
``--slow-sync RANK``: after a failure, that original rank sleeps at the
start of the sync (the others wait for it, inside the recovery).
``--slow-bcast RANK``: after the first failure, that original rank sleeps
just before the state's broadcast (phase ``bcast``; the others wait for it
inside the broadcast).
``--slow-rebuild RANK``: after the first failure, that original rank sleeps
in the rebuild of the first object the world rebuilds (phase ``rebuild``; the
others wait for it in the reducer's rebuild, inside the recovery).
``--slow-start SECONDS``: the first replacement sleeps that long before it
enters the run loop (phase ``starting``; the running ranks wait for it in the
spawn, which is done only when every new process has arrived).
``--slow-grow RANK``: when a commit of that original rank raises the interrupt
that takes new ranks in, it sleeps before the run loop handles it (phase
``grow``; the others, running and new, wait for it in the merge).
``--slow-agree RANK``: that original rank sleeps at the start of the growth's
agreement, once every rank's spawn has returned (phase ``agree``; the others
wait for it in that agreement's reduction). This one wraps a private step of
:class:`mpi_gradreducer.elastic.World` (``_finish_spawn``): the window is a
single reduction between two commits, reached from nowhere else.
``kill -USR1`` on a rank prints its threads' stacks (to look at a hang).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path

import numpy as np

# isort: off
from mpi_gradreducer import DistributedGradReducer, elastic  # before mpi4py.MPI: it sets Open MPI's ULFM defaults
from mpi4py import MPI
# isort: on

FEATURES, OUTPUTS, BATCH = 48, 8, 24


def batch(step: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's rows of step ``step``'s global batch (the same data whatever the size)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = rng.standard_normal((BATCH, OUTPUTS)).astype(np.float32)
    return x[rank::size], y[rank::size]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ballast-mb", type=float, default=0.0, help="one more parameter of this many MB")
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--share-compute", type=int, default=0, choices=range(0, 65), metavar="N",
                        help="--step-seconds is the compute of N ranks' share; 0: a fixed sleep")
    parser.add_argument("--straggle", default="")
    parser.add_argument("--slow-sync", type=int, default=-1)
    parser.add_argument("--slow-bcast", type=int, default=-1)
    parser.add_argument("--slow-rebuild", type=int, default=-1)
    parser.add_argument("--slow-start", type=float, default=0.0)
    parser.add_argument("--slow-grow", type=int, default=-1)
    parser.add_argument("--slow-agree", type=int, default=-1)
    parser.add_argument("--progress", default="deferred")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--min-size", type=int, default=None)
    parser.add_argument("--max-size", type=int, default=None)
    parser.add_argument("--hostfile", default="", help="the host file of the job's room (default: the environment)")
    parser.add_argument("--save-resume", action="store_true")
    parser.add_argument("--load", default="")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)
    out = Path(args.out)
    world = MPI.COMM_WORLD
    new = MPI.Comm.Get_parent() != MPI.COMM_NULL
    pid = os.getpid()
    first_rank = -1 if new else world.Get_rank()
    (out / (f"pid.new.{pid}" if new else f"pid.{first_rank}")).write_text(str(pid))
    log = open(out / f"log.{pid}", "a", buffering=1)

    def at(phase: str, step: int) -> None:
        (out / f"at.{pid}").write_text(f"{phase} {step}")

    rng = np.random.default_rng(7)
    params = [(rng.standard_normal((FEATURES, OUTPUTS)) * 0.1).astype(np.float32), np.zeros(OUTPUTS, np.float32)]
    if args.ballast_mb:
        params.append(np.zeros(int(args.ballast_mb * 2**20) // 4, np.float32))
    step0 = 0
    if args.load:
        saved = np.load(args.load)
        for i, p in enumerate(params):
            p[...] = saved[f"p{i}"]
        step0 = int(saved["step"])
    straggler, straggle_step = (int(v) for v in args.straggle.split(":")) if args.straggle else (-2, -1)

    paused: list[str] = []  # the pauses made (each at most once)

    def pause(name: str, rank: int, step: int) -> None:
        if rank >= 0 and first_rank == rank and name not in paused:  # -1: no rank (a replacement's first_rank)
            paused.append(name)
            at(name, step)
            time.sleep(3.0)

    class Tracked(elastic.ArrayState):
        def sync(self) -> None:
            if self.failure is not None:
                at("sync", self.step)
                if args.slow_sync >= 0 and first_rank == args.slow_sync:
                    time.sleep(3.0)
            super().sync()

        def sync_from(self, root: int) -> None:
            if self.failure is not None:
                pause("bcast", args.slow_bcast, self.step)
            super().sync_from(root)

    class Pause:
        """Rebuilt first: a slow rebuild on one rank, the others then waiting in the reducer's (elastic.Rebuildable)."""

        def communicators(self) -> list[MPI.Comm]:
            return []

        def abandon(self) -> None:
            pass

        def rebuild(self, comm: MPI.Intracomm) -> None:
            pause("rebuild", args.slow_rebuild, state.step)

    if args.slow_agree >= 0:
        finish_spawn = elastic.World._finish_spawn

        def agree_slowly(world: elastic.World) -> None:
            pause("agree", args.slow_agree, state.step)
            finish_spawn(world)

        elastic.World._finish_spawn = agree_slowly  # type: ignore[method-assign]

    state = Tracked(params, step=step0)
    reducer = DistributedGradReducer(params, group=state.comm, deterministic=True, progress=args.progress,
                                     timeout=args.timeout if args.timeout else "env")
    state.world.track(Pause())
    state.world.track(reducer)
    log.write(f"start {state.size} {state.rank}\n")  # a replacement: the world it joins, before it has joined
    log.write(f"host {MPI.Get_processor_name()}\n")
    resumed: list[int] = []

    def on_reset() -> None:
        log.write(f"resume {state.step} {state.size} {time.time():.6f}\n")
        if state.failure is not None:
            log.write(f"failure {state.failure}\n")
        if args.save_resume and not resumed and state.rank == 0 and state.failure is not None:
            np.savez(out / "resume.npz", step=state.step, **{f"p{i}": p for i, p in enumerate(params)})
        resumed.append(state.step)

    state.register_reset_callbacks([on_reset])
    if new and args.slow_start > 0:
        try:  # the first replacement only: the file is made once
            (out / "slow-start").open("x").close()
        except FileExistsError:
            pass
        else:
            at("starting", state.step)
            time.sleep(args.slow_start)

    discovery = elastic.Discovery(hostfile=args.hostfile) if args.hostfile else None

    @elastic.run(min_size=args.min_size, max_size=args.max_size, discovery=discovery)
    def train(state: Tracked) -> None:
        grads = [np.empty_like(p) for p in params]
        while state.step < args.steps:
            w, b = params[0], params[1]
            x, y = batch(state.step, state.rank, state.size)
            err = x @ w + b - y
            grads[0][...] = x.T @ err
            grads[1][...] = err.sum(axis=0)
            if len(params) > 2:
                grads[2].fill(float(state.step))
            if first_rank == straggler and state.step == straggle_step:
                time.sleep(3.0)
            at("reduce", state.step)
            reducer(grads)
            for p, g in zip(params, grads, strict=True):
                p -= np.float32(0.05) * g
            time.sleep(args.step_seconds * (args.share_compute / state.size if args.share_compute else 1))
            state.step += 1
            at("commit", state.step)
            try:
                state.commit()
            except elastic.HostsUpdated:
                pause("grow", args.slow_grow, state.step)
                raise
            log.write(f"commit {state.step} {time.time():.6f}\n")

    train(state)
    at("done", state.step)
    np.save(out / f"final.{pid}.npy", np.concatenate([p.ravel() for p in params[:2]]))
    (out / f"final.{pid}.txt").write_text(f"{state.step} {state.size}")
    reducer.free()


if __name__ == "__main__":
    main()
