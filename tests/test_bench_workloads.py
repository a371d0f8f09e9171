"""The benchmarks' workloads: shapes, sizes and names (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_gradreducer import bench
from mpi_gradreducer.bench import workloads


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
    with pytest.raises(ValueError):
        bench.many_small(0, 10)


def test_small_is_the_digits_mlp():
    s = bench.small()
    assert s.shapes == ((64, 128), (128,), (128, 10), (10,))
    assert {d.name for d in s.dtypes} == {"float32"}
    assert (s.count, s.elements, s.nbytes) == (4, 9_610, 38_440)
    arrays = s.arrays()
    assert [a.shape for a in arrays] == list(s.shapes) and sum(a.nbytes for a in arrays) == s.nbytes
    assert s.facts(4)["bytes"] == 38_440


def test_every_name_makes_its_workload():
    for name in workloads.WORKLOADS:
        wl = bench.make_workload(name, scale=0.1, small_count=3, small_size=5)
        assert wl.name == name and wl.count > 0
    assert bench.make_workload("many-small", small_count=3, small_size=5).shapes == ((5,),) * 3
    with pytest.raises(ValueError, match="workload"):
        bench.make_workload("resnet18")
    assert all(isinstance(a, np.ndarray) for a in bench.many_small(2, 2).arrays())
