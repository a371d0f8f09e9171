"""scripts/device_check.py's verdicts, from junit files and benchmark results as pytest and the benchmark write them.

The whole check needs a GPU machine; what it concludes from the files is tested here, in one process.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
dc = importlib.import_module("device_check")

SMOKE = "test_cuda_aware_branches_smoke"


def _junit(path: Path, cases: dict[tuple[str, str], tuple[str, str]]) -> None:
    """A junit file as pytest writes it: (module, test) -> (outcome, message)."""
    rows = []
    for (module, test), (outcome, message) in cases.items():
        inner = "" if outcome == "passed" else f'<{outcome} message="{message}" type="x">details</{outcome}>'
        rows.append(f'<testcase classname="tests.{module}" name="{test}" time="0.1">{inner}</testcase>')
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                    + "".join(rows) + "</testsuite></testsuites>")


def _verdicts(tmp_path: Path, ranks: int, cases: dict[tuple[str, str], tuple[str, str]], written: int | None = None):
    for r in range(ranks if written is None else written):
        _junit(tmp_path / f"junit.{r}.xml", cases)
    verdicts, skips = dc.junit_verdicts(str(tmp_path), ranks, 0)
    return {name: (status, note) for name, status, note in verdicts}, skips


def test_without_a_gpu_the_gpu_step_fails_and_says_why(tmp_path: Path):
    no_gpu = ("skipped", dc.NO_GPU)
    got, skips = _verdicts(tmp_path, 2, {
        ("test_gpu", "test_a"): no_gpu, ("test_gpu", "test_b"): no_gpu,
        ("test_gpu", SMOKE): ("skipped", "the MPI library does not read device memory"),
        ("test_staging", "test_c"): ("passed", ""), ("test_staging", "test_d"): ("skipped", "needs 3 ranks"),
    })
    assert got["GPU tests (test_gpu.py)"] == (1, f"2 of 3 skipped: {dc.NO_GPU} (nothing of the GPU path ran)")
    assert got["staging tests (CPU schedule)"] == (0, "1 passed, 1 skipped")
    assert got["CUDA-aware branches"] == ("notrun", "not run: the MPI library does not read device memory")
    assert skips == ["  not run: test_staging::test_d: needs 3 ranks"]


def test_passed_failed_and_missing_ranks(tmp_path: Path):
    cases = {("test_gpu", "test_a"): ("passed", ""), ("test_gpu", SMOKE): ("passed", ""),
             ("test_staging", "test_c"): ("failure", "assert 1 == 2")}
    got, _ = _verdicts(tmp_path, 2, cases)
    assert got["GPU tests (test_gpu.py)"] == (0, "2 passed, 0 skipped")
    assert got["staging tests (CPU schedule)"] == (1, "1 failed: test_c")
    assert got["CUDA-aware branches"][0] == 0
    for f in tmp_path.glob("junit.*.xml"):
        f.unlink()
    got, _ = _verdicts(tmp_path, 4, cases, written=3)
    assert got["GPU tests (test_gpu.py)"] == (1, "3 of 4 ranks wrote results (pytest status 0)")


def test_benchmark_result(tmp_path: Path):
    path = tmp_path / "bench.json"
    assert dc.bench_result(str(path), "resnet50")[0] is False
    path.write_text(json.dumps({"skipped": "no GPU"}))
    assert dc.bench_result(str(path), "resnet50") == (False, "skipped: no GPU")
    assert dc.bench_summary([str(path)]) == ["bench.json: skipped (no GPU)"]
    path.write_text(json.dumps({"workloads": {"resnet50": {"methods": {"reducer-staged": {"median_ms": 12.345}}}}}))
    assert dc.bench_result(str(path), "resnet50") == (True, "resnet50: reducer-staged 12.35 ms")
    assert dc.bench_result(str(path), "many-small")[0] is False


@pytest.mark.parametrize(("rc", "word"), [(0, "ok"), (124, "TIMEOUT (rc 124)"), (137, "TIMEOUT (rc 137)"),
                                         ("skip", "skipped"), ("notrun", "NOT RUN"), (2, "FAILED (rc 2)")])
def test_summary_line(rc, word):
    assert dc.summary_line("step", rc, "why") == f"{'step':<36} {word} - why"
    assert dc.summary_line("step", rc) == f"{'step':<36} {word}"


def test_limited_passes_the_status_through_and_ends_a_command_at_its_limit():
    assert dc.limited(["sh", "-c", "echo a; echo b >&2; exit 3"], 20, capture=True) == (3, "a\nb\n")
    start = time.monotonic()
    assert dc.limited(["sh", "-c", "sleep 30"], 1, capture=True) == (124, "")
    assert time.monotonic() - start < 6


def test_the_mpiexec_of_this_python_is_a_candidate(tmp_path: Path):
    from mpi_gradreducer.launch import find_mpiexec

    check = dc.Check()
    check.py, check.site = sys.executable, str(tmp_path)  # nothing installed from wheels there
    expected = find_mpiexec(sys.executable)
    assert dc.mpiexec_candidates(check)[:1] == ([expected] if expected else [])
