"""An interleaved A/B of two commits on the host benchmark: the regression guard.

::

    python scripts/bench_compare.py BASE [HEAD] [--rounds 4] [--ranks 4] [-- BENCH ARGS...]
    python scripts/bench_compare.py v0.7.0 HEAD -- --workload resnet50 many-small --methods limit reducer reducer-views

Each commit is checked out once into a temporary worktree (``git worktree
add --detach``; HEAD may also be the working tree as it is: ``--head-tree``),
then ``python -m mpi_gradreducer.bench`` (under this venv's ``mpiexec``, with
``PYTHONPATH`` at that tree) runs for A, B, A, B, ... so that the machine's
load falls on both alike. For every workload and method, each run's median
time over the same run's raw-MPI limit is kept; the table gives, for A and
for B, the median of those ratios over the rounds and their range, and B / A
(above 1: B is slower). A ratio is compared, not a time: the limit moves
with the load, and the ratio less so. Nothing is asserted: read the column
B / A against the rounds' spread.

The bench's own arguments follow ``--`` (default: ResNet-50 and many small
tensors, the limit, the reducer on ordinary arrays and on its views, 5
repetitions).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mpi_gradreducer import jobs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCH = ["--workload", "resnet50", "many-small", "--methods", "limit", "reducer", "reducer-views",
                 "--reps", "5"]


def _tree(rev: str, where: Path) -> Path:
    """A detached worktree of ``rev`` at ``where``."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(where), rev], check=True,
                   timeout=120)
    return where


def _run(tree: Path, ranks: int, bench: list[str], out: Path, limit: float) -> dict[str, dict[str, float]]:
    """One run of the bench with ``tree``'s package; returns ratios to the limit by workload and method."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = jobs.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi_gradreducer.bench", *bench,
                     "--json", str(out)], timeout=limit, env=env, cwd=tree)
    if done.returncode != 0 or done.timed_out:
        raise SystemExit(f"bench_compare: the bench failed in {tree} (status {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    data = json.loads(out.read_text())
    return {w: {m: r["ratio_to_limit"] for m, r in info["methods"].items() if m != "limit"}
            for w, info in data["workloads"].items()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = DEFAULT_BENCH
    if "--" in argv:
        at = argv.index("--")
        argv, bench = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="bench_compare.py", description=__doc__.split("\n")[0])
    parser.add_argument("base", help="commit A (e.g. a tag, main, a hash)")
    parser.add_argument("head", nargs="?", default="HEAD", help="commit B (default HEAD)")
    parser.add_argument("--head-tree", action="store_true", help="B is this working tree as it is (uncommitted too)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each, alternated (default 4)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--limit", type=float, default=1200.0, help="seconds one bench run may take")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.ranks < 1:
        parser.error("--rounds and --ranks: expected at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="bench_compare."))
    trees: list[Path] = []
    try:
        a = _tree(args.base, scratch / "a")
        trees.append(a)
        if args.head_tree:
            b = ROOT
        else:
            b = _tree(args.head, scratch / "b")
            trees.append(b)
        runs: dict[str, list[dict[str, dict[str, float]]]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for name, tree in (("A", a), ("B", b)):
                runs[name].append(_run(tree, args.ranks, bench, scratch / f"{name}{r}.json", args.limit))
                print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
        print(f"A = {args.base}, B = {'the working tree' if args.head_tree else args.head}; {args.ranks} ranks, "
              f"{args.rounds} rounds alternated; x the same run's limit, median [range]; bench: {' '.join(bench)}")
        print(f"{'workload':12} {'method':22} {'A':>20} {'B':>20} {'B / A':>7}")
        for workload, methods in runs["A"][0].items():
            for method in methods:
                cols = []
                for name in ("A", "B"):
                    values = [run[workload][method] for run in runs[name] if method in run.get(workload, {})]
                    cols.append((statistics.median(values), min(values), max(values)))
                (ma, la, ha), (mb, lb, hb) = cols
                print(f"{workload:12} {method:22} {ma:6.2f} [{la:5.2f}-{ha:5.2f}] {mb:6.2f} [{lb:5.2f}-{hb:5.2f}] "
                      f"{mb / ma:7.3f}")
        return 0
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], timeout=120,
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
