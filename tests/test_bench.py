"""The benchmark's entry point, in process, on a tiny workload, over real MPI."""

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

pytestmark = pytest.mark.mpi

ALWAYS = ("limit", "per-tensor", "reducer", "reducer-novalidate", "reducer-views")


def _shared_tempdir() -> str:
    """A directory made by rank 0, its name known to every rank."""
    path = tempfile.mkdtemp(prefix="bench-") if WORLD.Get_rank() == 0 else None
    return WORLD.bcast(path, root=0)


def test_main_writes_every_method_with_positive_times():
    directory = _shared_tempdir()
    path = os.path.join(directory, "bench.json")
    try:
        returned = bench.main(
            ["--workload", "many-small", "--small-count", "12", "--small-size", "300",
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
    env = written["environment"]
    assert env["ranks"] == WORLD.Get_size()
    assert env["mpi_library_version"] and env["numpy"] == np.__version__
    for key in ("hostname", "date", "command_line", "constants"):
        assert env[key]
    res = written["workloads"]["many-small"]
    assert (res["tensors"], res["bytes"], res["ranks"]) == (12, 12 * 300 * 4, WORLD.Get_size())
    expected = set(ALWAYS) | ({"torch-gloo"} if written["torch_gloo"] else set())
    assert set(res["methods"]) == expected
    for name, m in res["methods"].items():
        assert len(m["times_ms"]) == 1, name
        for key in ("median_ms", "min_ms", "algbw_GBps", "ratio_to_limit"):
            assert math.isfinite(m[key]) and m[key] > 0, (name, key, m[key])
        assert math.isfinite(m["busbw_GBps"]) and m["busbw_GBps"] >= 0
    assert res["methods"]["limit"]["ratio_to_limit"] == 1.0
    assert math.isfinite(res["validation_cost_percent"])
    assert returned["workloads"]["many-small"]["methods"].keys() == res["methods"].keys()


def test_workload_shapes():
    r = bench.resnet50()
    assert (r.count, r.elements) == (161, 25_557_032)
    b = bench.bert_base()
    assert (b.count, b.elements) == (199, 109_482_240)
    quarter = bench.bert_base(0.25)
    assert 0.2 < quarter.elements / b.elements < 0.3
    m = bench.mixed()
    assert {d.name for d in m.dtypes} == {"float16", "float32"}
    with pytest.raises(ValueError):
        bench.bert_base(0.0)
