"""scripts/bench_compare.py, the A/B regression guard: two commits, alternated, one table of ratios."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import WORLD
from mpi_gradreducer import jobs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_trees_alternate_and_each_method_gets_a_ratio():
    if WORLD.Get_size() > 1:
        pytest.skip("starts its own MPI jobs: run from a single process")
    done = jobs.run([sys.executable, str(ROOT / "scripts" / "bench_compare.py"), "HEAD", "--head-tree", "--rounds",
                     "2", "--ranks", "1", "--", "--workload", "small", "--methods", "limit", "reducer",
                     "--reps", "2"], timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr.count(": A done") == 2 and done.stderr.count(": B done") == 2, done.stderr
    rows = re.findall(r"^small\s+reducer\s+([\d.]+) \[.*\]\s+([\d.]+) \[.*\]\s+([\d.]+)$", done.stdout, re.M)
    assert len(rows) == 1, done.stdout
    a, b, ratio = (float(v) for v in rows[0])
    assert a > 0 and b > 0 and ratio == pytest.approx(b / a, rel=0.01), done.stdout
    listed = jobs.run(["git", "-C", str(ROOT), "worktree", "list"], timeout=30).stdout
    assert "bench_compare." not in listed, f"a worktree was left behind:\n{listed}"


@pytest.mark.slow
def test_the_horovod_bench_compares_each_method_to_its_run_s_reducer():
    pytest.importorskip("torch")
    if WORLD.Get_size() > 1:
        pytest.skip("starts its own MPI jobs: run from a single process")
    done = jobs.run([sys.executable, str(ROOT / "scripts" / "bench_compare.py"), "HEAD", "--head-tree", "--rounds",
                     "1", "--ranks", "2", "--", "horovod", "--count", "20", "--methods", "reducer", "grouped",
                     "async", "--reps", "2", "--warmup", "1"], timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "x the same run's reducer" in done.stdout, done.stdout
    for method in ("grouped", "async"):
        rows = re.findall(rf"^horovod\s+{method}\s+([\d.]+) \[.*\]\s+([\d.]+) \[.*\]\s+([\d.]+)$", done.stdout, re.M)
        assert len(rows) == 1, done.stdout
        a, b, ratio = (float(v) for v in rows[0])
        assert a > 0 and b > 0 and ratio == pytest.approx(b / a, rel=0.01), done.stdout
