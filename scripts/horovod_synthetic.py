"""Horovod's synthetic benchmark on ``mpi_gradreducer.horovod`` against the package's own ``DistributedOptimizer``.

Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py`` is taken from
a Horovod source tree given on the command line (it is never part of this
repository) and run in two copies, each change applied mechanically and
checked to apply exactly once (the run stops when the file does not match):

``horovod``
    ``import horovod.torch as hvd`` becomes ``import mpi_gradreducer.horovod as hvd``;
    nothing else changes: ``hvd.DistributedOptimizer`` reduces each gradient
    with ``allreduce_async_`` from its hook, through the engine.
``package``
    the same, and ``hvd.DistributedOptimizer(optimizer, ...)`` becomes the
    package's :class:`mpi_gradreducer.torch.DistributedOptimizer` over the
    same optimizer (the package's reducer, buckets reduced during backward).

The two run alternately, ``--rounds`` times each, under this venv's
``mpiexec`` (``scripts/mpirun.py``), each under a hard time limit, so that
the machine's load falls on both alike. Each run's ``Img/sec per CPU`` is
read from rank 0's output; the table gives each copy's median and range
over the rounds and ``horovod / package`` (the issue's goal: at least 0.95).
Nothing is asserted. The example needs ``torchvision``::

    python scripts/horovod_synthetic.py --source horovod --ranks 2 --rounds 3 -- \\
        --no-cuda --batch-size 8 --num-warmup-batches 2 --num-batches-per-iter 3 --num-iters 3

The example's own arguments follow ``--``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from mpi_gradreducer import jobs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = Path("examples/pytorch/pytorch_synthetic_benchmark.py")
IMPORT = ("import horovod.torch as hvd", "import mpi_gradreducer.horovod as hvd")
OPTIMIZER = (re.compile(r"optimizer = hvd\.DistributedOptimizer\(optimizer,.*?\)\n", re.S),
             "import mpi_gradreducer.torch\noptimizer = mpi_gradreducer.torch.DistributedOptimizer(optimizer)\n")
RATE = re.compile(r"Img/sec per CPU: ([0-9.]+) \+-([0-9.]+)")


def copies(source: Path, where: Path) -> dict[str, Path]:
    """The two copies of the example in ``where``, by name.

    Raises:
        SystemExit: the example is missing, or a change does not apply exactly once.
    """
    path = source / EXAMPLE
    if not path.is_file():
        raise SystemExit(f"horovod_synthetic: {path} not found (--source: a Horovod source tree)")
    text = path.read_text()
    if text.count(IMPORT[0]) != 1:
        raise SystemExit(f"horovod_synthetic: {path}: expected {IMPORT[0]!r} once")
    horovod = text.replace(*IMPORT)
    package, changed = OPTIMIZER[0].subn(OPTIMIZER[1], horovod)
    if changed != 1:
        raise SystemExit(f"horovod_synthetic: {path}: expected one 'optimizer = hvd.DistributedOptimizer(...)'")
    out = {}
    for name, body in (("horovod", horovod), ("package", package)):
        out[name] = where / f"synthetic_{name}.py"
        out[name].write_text(body)
    return out


def run(script: Path, ranks: int, example: list[str], limit: float) -> float:
    """One run; rank 0's images per second per CPU.

    Raises:
        SystemExit: the run failed, timed out, or printed no rate.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    done = jobs.run([sys.executable, str(ROOT / "scripts" / "mpirun.py"), "--oversubscribe", "-n", str(ranks), "--",
                     sys.executable, str(script), *example], timeout=limit, env=env, cwd=script.parent)
    found = RATE.search(done.stdout)
    if done.returncode != 0 or done.timed_out or found is None:
        raise SystemExit(f"horovod_synthetic: {script.name} failed (status {done.returncode}, timed out: "
                         f"{done.timed_out}):\n{(done.stdout + done.stderr)[-3000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    example = ["--no-cuda"]
    if "--" in argv:
        at = argv.index("--")
        argv, example = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="horovod_synthetic.py", description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=os.environ.get("HOROVOD_SOURCE"),
                        help="a Horovod source tree (default: $HOROVOD_SOURCE)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each copy, alternated (default 3)")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    if args.source is None:
        parser.error("--source (or HOROVOD_SOURCE) is required")
    if args.rounds < 1 or args.ranks < 1:
        parser.error("--rounds and --ranks: expected at least 1")
    rates: dict[str, list[float]] = {"horovod": [], "package": []}
    with tempfile.TemporaryDirectory(prefix="horovod_synthetic.") as scratch:
        scripts = copies(Path(args.source), Path(scratch))
        for r in range(args.rounds):
            for name, script in scripts.items():
                rates[name].append(run(script, args.ranks, example, args.limit))
                print(f"round {r + 1}/{args.rounds}: {name} {rates[name][-1]:.2f} img/sec per CPU", file=sys.stderr,
                      flush=True)
    print(f"{args.ranks} ranks, {args.rounds} rounds alternated; example args: {' '.join(example)}")
    print(f"{'copy':10} {'img/sec per CPU, median [range]':>34}")
    for name, values in rates.items():
        print(f"{name:10} {statistics.median(values):16.2f} [{min(values):.2f}-{max(values):.2f}]")
    ratio = statistics.median(rates["horovod"]) / statistics.median(rates["package"])
    print(f"horovod / package = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
