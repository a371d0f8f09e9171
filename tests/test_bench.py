"""The host benchmark's entry point, in process, on tiny workloads, over real MPI."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import numpy as np
import pytest

from conftest import WORLD
from mpi_gradreducer import bench
from mpi_gradreducer.bench import host
from mpi_gradreducer.bench.torch_methods import torch_ingestion

pytestmark = pytest.mark.mpi

ALWAYS = ("limit", "per-tensor", "packed-floor", "reducer", "reducer-novalidate", "reducer-views", "reducer-fresh",
          "reducer-shard")


def _shared_tempdir() -> str:
    """A directory made by rank 0, its name known to every rank."""
    path = tempfile.mkdtemp(prefix="bench-") if WORLD.Get_rank() == 0 else None
    return WORLD.bcast(path, root=0)


@pytest.fixture(scope="module")
def run() -> tuple[dict, dict]:
    """One tiny run of every method on many-small and small: (what main returned, what it wrote)."""
    directory = _shared_tempdir()
    path = os.path.join(directory, "bench.json")
    try:
        returned = bench.main(
            ["--workload", "many-small", "small", "--small-count", "12", "--small-size", "300",
             "--reps", "1", "--warmup", "0", "--json", path],
            comm=WORLD,
        )
        WORLD.Barrier()  # rank 0 has written the file
        with open(path) as f:
            written = json.load(f)
    finally:
        WORLD.Barrier()
        if WORLD.Get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return returned, written


def test_main_writes_every_method_with_positive_times(run):
    returned, written = run
    env = written["environment"]
    assert env["ranks"] == WORLD.Get_size()
    assert env["mpi_library_version"] and env["numpy"] == np.__version__
    for key in ("hostname", "date", "command_line", "constants", "hosts", "thread_level"):
        assert env[key]
    res = written["workloads"]["many-small"]
    assert (res["tensors"], res["bytes"], res["ranks"]) == (12, 12 * 300 * 4, WORLD.Get_size())
    expected = set(ALWAYS) | ({"torch-gloo"} if written["torch_gloo"] else set())
    assert set(res["methods"]) - {"reducer-torch"} == expected
    for name, m in res["methods"].items():
        assert len(m["times_ms"]) == 1, name
        for key in ("median_ms", "min_ms", "algbw_GBps", "ratio_to_limit"):
            assert math.isfinite(m[key]) and m[key] > 0, (name, key, m[key])
        assert math.isfinite(m["busbw_GBps"]) and m["busbw_GBps"] >= 0
    assert res["methods"]["limit"]["ratio_to_limit"] == 1.0
    assert math.isfinite(res["validation_cost_percent"])
    assert res["reducer_over_floor"] > 0 and res["messages"]["packed-floor"] == 1
    assert res["fresh_over_reducer"] == pytest.approx(
        res["methods"]["reducer-fresh"]["median_ms"] / res["methods"]["reducer"]["median_ms"])
    assert returned["workloads"]["many-small"]["methods"].keys() == res["methods"].keys()


def test_reducer_torch_runs_or_says_why_not_on_every_rank(run):
    returned, _ = run
    why = torch_ingestion(WORLD)  # collective: the same verdict as the run's
    for res in returned["workloads"].values():
        if why is None:
            assert "reducer-torch" in res["methods"] and "reducer-torch" not in res["skipped"]
            assert math.isfinite(res["torch_over_reducer"]) and res["torch_over_reducer"] > 0
        else:
            assert "reducer-torch" not in res["methods"] and "torch_over_reducer" not in res
            assert res["skipped"]["reducer-torch"] == why
            assert why.startswith("rank ") and ("not supported by this reducer" in why or "torch" in why)
    reasons = WORLD.allgather(why)
    assert reasons == [reasons[0]] * len(reasons)


def test_small_workload_reports_ratio_to_one_allreduce_and_validation(run):
    returned, _ = run
    res = returned["workloads"]["small"]
    assert (res["tensors"], res["bytes"]) == (4, 38_440)
    assert list(res["limit_by_chunk"]) == ["limit@whole"]  # 38 KB: one Allreduce, never chunked
    assert res["messages"]["limit"] == 1
    methods = res["methods"]
    assert res["reducer_over_one_allreduce"] == pytest.approx(
        methods["reducer"]["median_ms"] / res["limit_by_chunk"]["limit@whole"]["median_ms"])
    assert res["always_over_never"] == pytest.approx(
        methods["reducer"]["median_ms"] / methods["reducer-novalidate"]["median_ms"])
    text = host.format_workload("small", res)
    assert "reducer / one Allreduce of all 38440 bytes = " in text
    assert 'validate="always" / validate="never" = ' in text
    assert "38.4 KB" in text.splitlines()[0]


def test_negative_validation_cost_prints_as_noise(run):
    returned, _ = run
    res = dict(returned["workloads"]["many-small"])
    res["validation_cost_percent"] = -4.2
    text = host.format_workload("many-small", res)
    assert "validation cost: < noise of reducer" in text and "-4.2" not in text
    res["validation_cost_percent"] = 4.2
    assert "validation cost: 4.2% of reducer" in host.format_workload("many-small", res)


def test_methods_can_be_chosen():
    returned = bench.main(["--workload", "small", "--methods", "limit", "reducer", "--reps", "1", "--warmup", "0"],
                          comm=WORLD)
    res = returned["workloads"]["small"]
    assert set(res["methods"]) == {"limit", "reducer"}
    assert "validation_cost_percent" not in res and "always_over_never" not in res
    assert res["reducer_over_one_allreduce"] > 0


def test_packed_floor_is_skipped_alike_for_several_dtypes():
    from mpi_gradreducer.bench.workloads import Workload

    wl = Workload("two", ((5,), (7,)), (np.dtype(np.float32), np.dtype(np.float64)), "two dtypes")
    res = host.bench_workload(WORLD, wl, ("limit", "packed-floor", "reducer"), None, "no torch", 1, 0)
    assert res["skipped"] == {"packed-floor": "gradients of several dtypes"}
    assert "packed-floor" not in res["methods"] and "reducer" in res["methods"]


def test_pages_sweep_times_the_same_allreduces_over_three_memories():
    from mpi_gradreducer.bench import sweeps
    from mpi_gradreducer.bench.workloads import Workload

    f32 = np.dtype(np.float32)
    wl = Workload("two", ((1 << 18,), (3, 1 << 18), (5,)), (f32, f32, f32), "two large tensors, one small")
    res = sweeps.sweep_pages(WORLD, wl, 1, 0)
    assert (res["tensors"], res["bytes"]) == (2, 4 << 20)
    assert [row["memory"] for row in res["rows"]] == ["tensors", "huge pages", "small pages"]
    assert all(math.isfinite(row["median_ms"]) and row["median_ms"] > 0 for row in res["rows"])
    assert "memory pages" in sweeps.format_sweeps({"pages": res})


def test_powersgd_methods_report_bytes_the_peer_and_the_modelled_link():
    from mpi_gradreducer.bench import powersgd
    from mpi_gradreducer.bench.torch_methods import gloo_usable

    methods = ["reducer", "reducer-powersgd"] + (["torch-powersgd"] if gloo_usable(WORLD) else [])
    returned = bench.main(["--workload", "small", "--methods", *methods, "--powersgd-rank", "1",
                           "--powersgd-model-ranks", "4", "--reps", "1", "--warmup", "0"], comm=WORLD)
    res = returned["workloads"]["small"]
    assert set(res["methods"]) == set(methods) and res["powersgd_rank"] == 1
    stats = res["reducer_stats"]
    assert 0 < stats["reducer-powersgd"]["wire_bytes"] < stats["reducer"]["wire_bytes"] == 38440
    link = res["powersgd_link"]
    assert link["ranks"] == 4 and set(link["parts"]) == {"reducer", "reducer-powersgd"}
    b = link["break_even_Bps"]  # where the two modelled times meet
    if b not in (None, float("inf")):
        times = [powersgd.link_time_ms(link["parts"][m], b, 4) for m in ("reducer", "reducer-powersgd")]
        assert math.isclose(*times, rel_tol=1e-9)
    text = host.format_workload("small", res)
    assert "bytes per call (stats.bytes): reducer 38440, reducer-powersgd" in text
    assert ("reducer-powersgd / torch-powersgd = " in text) == ("torch-powersgd" in methods)
