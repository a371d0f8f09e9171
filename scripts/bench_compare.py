"""Interleaved runs of the host benchmark, side by side: two commits (the regression guard), or several MPIs.

::

    python scripts/bench_compare.py BASE [HEAD] [--rounds 4] [--ranks 4] [-- BENCH ARGS...]
    python scripts/bench_compare.py v0.7.0 HEAD -- --workload resnet50 many-small --methods limit reducer reducer-views
    python scripts/bench_compare.py --mpis .venv .venv-ompi .venv-impi -- --workload resnet50 many-small
    python scripts/bench_compare.py v0.7.0 HEAD --ranks 2 -- horovod --reps 30

Two commits: each is checked out once into a temporary worktree (``git
worktree add --detach``; HEAD may also be the working tree as it is:
``--head-tree``), then ``python -m mpi_gradreducer.bench`` (under this
venv's ``mpiexec``, through ``scripts/mpirun.py``, with ``PYTHONPATH`` at that tree) runs for A, B, A, B,
... so that the machine's load falls on both alike. ``--mpis``: the working
tree under each venv's ``python`` and ``mpiexec`` in turn (one venv per MPI,
as ``scripts/test.sh`` makes them), which gives the per-MPI table.

For every workload and method, each run's median time over the same run's
raw-MPI limit is kept (the limit of that run's MPI); the table gives, for
each side, the median of those ratios over the rounds and their range, and
for two commits B / A (above 1: B is slower). A ratio is compared, not a
time: the limit moves with the load, and the ratio less so. Nothing is
asserted: read the columns against the rounds' spread.

The bench's own arguments follow ``--`` (default: ResNet-50 and many small
tensors, the limit, the reducer on ordinary arrays and on its views, 5
repetitions). ``-- horovod ...`` compares the Horovod bench instead
(``python -m mpi_gradreducer.bench horovod``): each method over the same
run's reducer on the same tensors, not over a limit.
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
from dataclasses import dataclass
from pathlib import Path

from mpi_gradreducer import jobs

ROOT = Path(__file__).resolve().parents[1]
#: Per run: the ratio to the limit of each method, by workload.
Ratios = dict[str, dict[str, float]]
DEFAULT_BENCH = ["--workload", "resnet50", "many-small", "--methods", "limit", "reducer", "reducer-views",
                 "--reps", "5"]


def _tree(rev: str, where: Path) -> Path:
    """A detached worktree of ``rev`` at ``where``."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(where), rev], check=True,
                   timeout=120)
    return where


@dataclass(frozen=True)
class Side:
    """What one column runs: the package of ``tree`` under ``python`` (and the ``mpiexec`` beside it)."""

    label: str
    tree: Path
    python: str


def _run(side: Side, ranks: int, bench: list[str], out: Path, limit: float) -> tuple[str, Ratios]:
    """One run of the bench; returns the MPI library it ran under and the ratios to the limit by workload
    and method."""
    env = {**os.environ, "PYTHONPATH": str(side.tree), "OMP_NUM_THREADS": "1"}
    # scripts/mpirun.py under the side's python: the mpiexec of its MPI, with that MPI's own line for
    # more ranks than cores (and, as root, Open MPI's consent)
    done = jobs.run([side.python, str(ROOT / "scripts" / "mpirun.py"), "--oversubscribe", "-n", str(ranks), "--",
                     side.python, "-m", "mpi_gradreducer.bench", *bench, "--json", str(out)],
                    timeout=limit, env=env, cwd=side.tree)
    if done.returncode != 0 or done.timed_out:
        raise SystemExit(f"bench_compare: the bench failed for {side.label} (status {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    data = json.loads(out.read_text())
    library = str(data.get("environment", {}).get("mpi_library_version", "?")).splitlines()[0][:60]
    if "small" in data:  # the horovod bench: each method over the same run's reducer, not a limit
        small = data["small"]
        return library, {"horovod": {m: small[f"{m}_over_reducer"] for m in small["methods"] if m != "reducer"}}
    return library, {w: {m: r["ratio_to_limit"] for m, r in info["methods"].items() if m != "limit"}
                     for w, info in data["workloads"].items()}


def _table(sides: list[Side], runs: dict[str, list[Ratios]], pair: bool) -> None:
    """For each workload and method, each side's median ratio [range] (and B / A for a pair of commits)."""
    print(f"{'workload':12} {'method':22} " + " ".join(f"{side.label[-20:]:>20}" for side in sides)
          + (f" {'B / A':>7}" if pair else ""))
    first = runs[sides[0].label][0]
    for workload, methods in first.items():
        for method in methods:
            cols = []
            for side in sides:
                values = [run[workload][method] for run in runs[side.label] if method in run.get(workload, {})]
                cols.append((statistics.median(values), min(values), max(values)) if values else None)
            text = " ".join(f"{c[0]:6.2f} [{c[1]:5.2f}-{c[2]:5.2f}]" if c else f"{'-':>20}" for c in cols)
            if pair and cols[0] and cols[1]:
                text += f" {cols[1][0] / cols[0][0]:7.3f}"
            print(f"{workload:12} {method:22} {text}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = DEFAULT_BENCH
    if "--" in argv:
        at = argv.index("--")
        argv, bench = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="bench_compare.py", description=__doc__.split("\n")[0])
    parser.add_argument("base", nargs="?", help="commit A (e.g. a tag, main, a hash)")
    parser.add_argument("head", nargs="?", default="HEAD", help="commit B (default HEAD)")
    parser.add_argument("--head-tree", action="store_true", help="B is this working tree as it is (uncommitted too)")
    parser.add_argument("--mpis", nargs="+", metavar="VENV",
                        help="instead of two commits: the working tree under each of these venvs (one per MPI)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each, alternated (default 4)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--limit", type=float, default=1200.0, help="seconds one bench run may take")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.ranks < 1:
        parser.error("--rounds and --ranks: expected at least 1")
    if (args.base is None) == (args.mpis is None):
        parser.error("expected either BASE [HEAD] or --mpis VENV...")
    for venv in args.mpis or ():
        if not (Path(venv) / "bin" / "python").exists():
            parser.error(f"--mpis: {venv} has no bin/python")
    scratch = Path(tempfile.mkdtemp(prefix="bench_compare."))
    trees: list[Path] = []
    try:
        if args.mpis:
            sides = [Side(venv, ROOT, str(Path(venv).absolute() / "bin" / "python")) for venv in args.mpis]
        else:
            trees.append(_tree(args.base, scratch / "a"))
            if not args.head_tree:
                trees.append(_tree(args.head, scratch / "b"))
            b = ROOT if args.head_tree else trees[1]
            sides = [Side("A", trees[0], sys.executable), Side("B", b, sys.executable)]
        runs: dict[str, list[Ratios]] = {side.label: [] for side in sides}
        libraries: dict[str, str] = {}
        for r in range(args.rounds):
            for k, side in enumerate(sides):
                libraries[side.label], ratios = _run(side, args.ranks, bench, scratch / f"{k}.{r}.json", args.limit)
                runs[side.label].append(ratios)
                print(f"round {r + 1}/{args.rounds}: {side.label} done", file=sys.stderr, flush=True)
        if args.mpis:
            print("; ".join(f"{side.label} = {libraries[side.label]}" for side in sides))
        else:
            print(f"A = {args.base}, B = {'the working tree' if args.head_tree else args.head}")
        base = "reducer" if bench[:1] == ["horovod"] else "limit"
        print(f"{args.ranks} ranks, {args.rounds} rounds alternated; x the same run's {base}, median [range]; "
              f"bench: {' '.join(bench)}")
        _table(sides, runs, pair=not args.mpis)
        return 0
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], timeout=120,
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
