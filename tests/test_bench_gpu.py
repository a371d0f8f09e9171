"""The GPU benchmark's entry point: one line and a clean return without a GPU, a tiny run with one."""

from __future__ import annotations

import math

import pytest

from conftest import WORLD
from mpi_gradreducer.bench import gpu as bench_gpu

pytestmark = pytest.mark.mpi

TINY = ["--workload", "many-small", "--small-count", "12", "--small-size", "300", "--reps", "1", "--warmup", "0"]


def test_without_a_gpu_rank_0_prints_one_line_and_every_rank_returns(capsys):
    ok, why = bench_gpu.gpu_available(WORLD)  # collective: the same answer everywhere
    if ok:
        pytest.skip("a GPU is usable on every rank")
    assert why.startswith("rank ")
    result = bench_gpu.main(TINY, comm=WORLD)
    lines = capsys.readouterr().out.splitlines()
    assert result["skipped"] == why
    if WORLD.Get_rank() == 0:
        assert len(lines) == 1 and "needs cupy and a CUDA device on every rank" in lines[0], lines
    else:
        assert lines == []


def test_bad_arguments_exit_on_every_rank():
    with pytest.raises(SystemExit):
        bench_gpu.main(["--scale", "0"], comm=WORLD)
    with pytest.raises(SystemExit):
        bench_gpu.main(["--reps", "0"], comm=WORLD)


@pytest.mark.gpu
def test_tiny_run_reports_every_method_or_why_not(cupy):
    result = bench_gpu.main(TINY, comm=WORLD)
    res = result["workloads"]["many-small"]
    assert set(res["methods"]) | set(res["skipped"]) == set(bench_gpu.METHODS)
    for name in ("copy-bound", "host-limit", "naive"):
        assert name in res["methods"], res["skipped"]
    for name, m in res["methods"].items():
        assert math.isfinite(m["median_ms"]) and m["median_ms"] > 0, name
    assert res["methods"]["copy-bound"]["x_copy_bound"] == 1.0
    for name, k in res["kernel_launches"].items():  # from the public counters only
        assert k["calls"] >= 2 and k["buckets"] == res["messages"][name], name
        assert k["launches_per_bucket_per_call"] == pytest.approx(k["launches"] / k["calls"] / k["buckets"])
    staged = res["kernel_launches"].get("reducer-staged")
    if staged is not None:  # 12 small tensors: packed, so one pack and one unpack launch per bucket
        assert staged["launches_per_bucket_per_call"] == pytest.approx(2.0)
