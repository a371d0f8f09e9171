"""Long-run check: RSS growth per path after warm-up, each path in its own MPI job.

Run every path, each in its own job of ``--ranks`` processes (default 4;
under the ``mpiexec`` beside this Python, else on ``PATH``: MPICH's, Open
MPI's or Intel MPI's)::

    python scripts/soak.py --calls 100000

or one path inside a job you launch yourself::

    mpiexec -n 4 python scripts/soak.py --path begin --calls 6000

Each job makes ``--warmup`` calls, reads every rank's resident set size
(``/proc/self/statm``), makes ``--calls`` more (reading it halfway too),
reads it again and prints::

    path begin | calls 6000 | growth KiB by rank 0 4 0 0 | max 4 KiB | per 6000 calls 4 KiB |
    second half max 0 KiB | 950 us/call

(on one line). A leak grows both halves alike; what a warm-up leaves shows in the first half only.

The model is five float32 tensors, one of 300x300 (a mean of large chunks,
reduced in place), four small ones (packed); the paths vary how it is passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SHAPES = [(300, 300), (300,), (300, 10), (10,), (7, 3)]
PATHS = ("blocking", "in-place", "packed", "views", "begin", "async-thread", "async-deferred",
         "reduce-scatter", "join", "rowsparse", "fp16", "bf16", "check-finite", "deterministic")


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_step(path: str, comm: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """One call of ``path`` (a function), and the reducer's ``free``."""
    from mpi_gradreducer import DistributedGradReducer, RowSparse

    rank = comm.Get_rank()
    dtype: Any = np.float32
    shapes = SHAPES
    kwargs: dict[str, Any] = {}
    if path == "in-place":
        shapes = SHAPES[:1]
    elif path == "packed":
        shapes = [(30, 30)] * 20
    elif path == "fp16":
        dtype = np.float16
    elif path == "bf16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    elif path == "check-finite":
        kwargs["check_finite"] = True
    elif path == "deterministic":
        kwargs["deterministic"] = True
    elif path.startswith("async"):
        kwargs["progress"] = path.split("-")[1]
    elif path == "begin":
        kwargs["progress"] = "auto"
    params = [np.zeros(s, dtype) for s in shapes]
    reducer = DistributedGradReducer(params, group=comm, **kwargs)
    grads = reducer.allocate_grads() if path == "views" else [np.ones(s, dtype) for s in shapes]
    if path == "views":
        for g in grads:
            g[...] = 1
    order = np.random.default_rng(rank).permutation(len(shapes))

    if path == "begin":
        def step() -> None:
            s = reducer.begin(grads)
            for i in order:
                s.ready(int(i))
            s.wait()
    elif path.startswith("async"):
        def step() -> None:
            reducer.reduce_async(grads).wait()
    elif path == "reduce-scatter":
        def step() -> None:
            reducer.reduce_scatter(grads).allgather(params)
    elif path == "join":
        # One round: rank r makes r calls, then joins (rank 0 at once); each round ends when all have joined.
        def step() -> None:
            for _ in range(rank):
                reducer(grads)
            reducer.join()
    elif path == "rowsparse":
        reducer.free()
        params = params + [np.zeros((1000, 16), np.float32)]
        reducer = DistributedGradReducer(params, group=comm)
        rows = np.arange(rank, 1000, 97, dtype=np.int64)
        sparse = RowSparse(rows, np.ones((rows.shape[0], 16), np.float32), (1000, 16))

        def step() -> None:
            reducer(grads + [sparse])
    else:
        def step() -> None:
            reducer(grads)
    return step, reducer.free


def run_path(path: str, calls: int, warmup: int) -> None:
    """Soak one path in this job; rank 0 prints its line."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    step, free = make_step(path, comm)
    rounds = max(1, comm.Get_size() - 1) if path == "join" else 1  # calls per step on the busiest rank
    for _ in range(max(1, warmup // rounds)):
        step()
    comm.Barrier()
    before, t0 = rss_bytes(), time.perf_counter()
    n = max(2, calls // rounds)
    for _ in range(n // 2):
        step()
    middle = rss_bytes()
    for _ in range(n - n // 2):
        step()
    comm.Barrier()
    grown, late = (rss_bytes() - before) >> 10, (rss_bytes() - middle) >> 10
    seconds = time.perf_counter() - t0
    free()
    growth = comm.gather((grown, late))
    if comm.Get_rank() == 0:
        assert growth is not None
        made = n * rounds
        most = max(g for g, _ in growth)
        print(f"path {path} | calls {made} | growth KiB by rank {' '.join(str(g) for g, _ in growth)} | "
              f"max {most} KiB | per 6000 calls {most * 6000 / made:.0f} KiB | "
              f"second half max {max(lt for _, lt in growth)} KiB | {seconds / made * 1e6:.0f} us/call", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=PATHS, help="soak this path in the current job (under mpiexec)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated paths to launch, one job each")
    parser.add_argument("--calls", type=int, default=6000, help="calls measured after warm-up")
    parser.add_argument("--warmup", type=int, default=500, help="calls before the first reading")
    parser.add_argument("--ranks", type=int, default=4, help="processes per job")
    parser.add_argument("--limit", type=float, default=3600, help="hard time limit of each job, seconds")
    args = parser.parse_args()
    if args.path is not None:
        run_path(args.path, args.calls, args.warmup)
        return
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only launches the jobs
    from mpi_gradreducer import jobs
    from mpi_gradreducer.launch import Launcher

    launcher = Launcher.find()
    failed = 0
    for path in args.paths.split(","):
        cmd = launcher.command([sys.executable, "-m", "mpi4py", __file__, "--path", path, "--calls", str(args.calls),
                                "--warmup", str(args.warmup)], ranks=args.ranks, oversubscribe=True)
        done = jobs.run(cmd, env=launcher.environment(), timeout=args.limit)
        if done.timed_out:
            print(f"path {path} | did not finish within {args.limit:g} s", flush=True)
            failed += 1
            continue
        sys.stdout.write(done.stdout)
        if done.returncode != 0:
            print(f"path {path} | exit status {done.returncode}\n{done.stderr[-2000:]}", flush=True)
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
