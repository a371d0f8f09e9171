"""Tensor Fusion in ``mpi_gradreducer.horovod``: buckets and settings (no MPI), fused reductions over real MPI.

Collective tests run under ``mpiexec -n N python -m pytest --only-mpi`` (and
at size 1 with ``--with-mpi``); rank ``r`` contributes ``(r + 1)`` times a
pattern, so every expected value is known in closed form.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_on_all_ranks
from mpi_gradreducer._core.summers import Summers
from mpi_gradreducer._core.topology import Topology
from mpi_gradreducer.horovod.execute import Local, buckets, fused, wire_dtype
from mpi_gradreducer.horovod.negotiation import Request, Response
from mpi_gradreducer.horovod.settings import Settings

SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
AVERAGE, SUM, MAX = 0, 1, 4


def _sizes(found):
    return [[count for _, count in bucket] for bucket in found]


def test_buckets_fill_up_to_the_threshold_and_a_larger_member_goes_alone():
    members = [(None, n) for n in (10, 10, 30, 5, 100, 1)]
    assert _sizes(buckets(members, 4, 80)) == [[10, 10], [30], [5], [100], [1]]
    assert _sizes(buckets(members, 4, 0)) == [[10], [10], [30], [5], [100], [1]]  # 0: fusion off
    assert _sizes(buckets(members, 4, 128 << 20)) == [[10, 10, 30, 5, 100, 1]]


def test_settings_from_the_environment():
    assert Settings.from_environment({}) == Settings(128 << 20, 1e-3, 60.0, None)
    got = Settings.from_environment({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "3.5",
                                     "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
                                     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})
    assert got == Settings(0, 3.5e-3, 10.0, 30.0)
    assert Settings.from_environment({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_check is None
    with pytest.raises(ValueError, match=r"HOROVOD_FUSION_THRESHOLD: expected a non-negative integer, got '64MB'"):
        Settings.from_environment({"HOROVOD_FUSION_THRESHOLD": "64MB"})
    with pytest.raises(ValueError, match=r"HOROVOD_CYCLE_TIME: expected a finite non-negative number, got '-1'"):
        Settings.from_environment({"HOROVOD_CYCLE_TIME": "-1"})


ENTRIES = (("float32", (5,)), ("float16", (7,)), ("int32", (3, 2)), ("float64", (0,)), ("float32", (40,)),
           ("complex64", (4,)))


def _pattern(dtype: str, shape: tuple[int, ...], op: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n) % 7 + 1).astype(wire_dtype(dtype, op))


@pytest.mark.mpi
@pytest.mark.parametrize("op", [AVERAGE, SUM, MAX], ids=["Average", "Sum", "Max"])
@pytest.mark.parametrize("threshold", [0, 64, 128 << 20], ids=["off", "64B", "128MiB"])
def test_fused_reductions_of_several_operations_match_closed_forms(op, threshold):
    """Two operations of one cycle, mixed dtypes, fused up to the threshold; the last rank (of several) takes
    part in the second from ``join()`` (the identity)."""
    entries = [e for e in ENTRIES if not (op == MAX and e[0].startswith("complex"))]
    first, second = entries[:3], entries[3:]
    comm = WORLD.Dup()
    summers = Summers(comm, Topology.of(comm))
    factors = (2.0, 0.5) if op != MAX else (1.0, 1.0)
    joined = SIZE - 1 if SIZE > 1 else -1
    items = []
    try:
        for k, part in enumerate((first, second)):
            request = Request(f"k{k}", "allreduce", "hvd.allreduce", tuple(part), op=op, factors=factors)
            local = None if k == 1 and RANK == joined else \
                Local([_pattern(d, s, op) * (RANK + 1) for d, s in part])
            items.append((Response(request.key, "allreduce", (request,)), local))
        outputs = fused(summers, items, threshold, {})
    finally:
        summers.free()
        comm.Free()
    contributing = [[r + 1 for r in range(SIZE)], [r + 1 for r in range(SIZE) if r != joined]]
    checked = []
    for k, part in enumerate((first, second)):
        if items[k][1] is None:
            assert outputs[k] == [None] * len(part)
            continue
        for (dtype, shape), got in zip(part, outputs[k], strict=True):
            base = _pattern(dtype, shape, op).astype(np.complex128 if dtype.startswith("complex") else np.float64)
            if op == MAX:
                expected = base * max(contributing[k])
            else:
                expected = base * sum(contributing[k])
                if op == AVERAGE:
                    expected = expected / SIZE
                    if dtype == "int32":
                        expected = np.trunc(expected)
            assert got.dtype == wire_dtype(dtype, op) and got.shape == (int(np.prod(shape)),)
            tolerance = 1e-3 if dtype == "float16" else 1e-6
            assert np.allclose(got.astype(expected.dtype), expected, rtol=tolerance, atol=0), (dtype, got, expected)
            checked.append(got)
    served = WORLD.Split(int(RANK == joined), RANK)  # every rank: collective
    try:
        if RANK != joined:
            assert_same_on_all_ranks(served, checked)
    finally:
        served.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("threshold", ["0", "4096"])
def test_many_in_place_async_allreduces_under_a_fusion_threshold(torch, threshold, monkeypatch):
    """Horovod's per-gradient pattern: every tensor in place, by name, in one cycle or several."""
    import mpi_gradreducer.horovod as hvd

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", threshold)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    hvd.shutdown()  # settings are read by init
    hvd.init()
    try:
        dtypes = (torch.float32, torch.float64, torch.float16, torch.int64)
        tensors = [torch.full((k % 37 + 1, 3), float(RANK + 1), dtype=dtypes[k % 4]) for k in range(120)]
        handles = [hvd.allreduce_async_(t, name=f"fusion.{k}", op=hvd.Sum) for k, t in enumerate(tensors)]
        for t, h in zip(tensors, handles, strict=True):
            assert hvd.synchronize(h) is t
        total = SIZE * (SIZE + 1) / 2
        assert all(float(t.min()) == float(t.max()) == total for t in tensors)
        averaged = hvd.grouped_allreduce([t.double() for t in tensors[:10]], name="fusion.grouped")
        assert all(float(a.min()) == float(a.max()) == total for a in averaged)
    finally:
        hvd.shutdown()
    assert MPI.Is_initialized()


def test_views_are_kept_per_site_once_the_same_tensors_come_twice(torch):
    """Armed on the second call with the same tensors; another state, another list or too few tensors: looked at
    again; at most CAPACITY sites, the least recently used forgotten first."""
    from mpi_gradreducer.horovod.views import CAPACITY, FEW, Views

    views = Views()
    ts = [torch.zeros(k + 1) for k in range(FEW)]
    arrays, entries = [t.numpy() for t in ts], tuple(("float32", (k + 1,)) for k in range(FEW))
    assert views.recall("a", ts) is None
    views.remember("a", ts, arrays, entries)
    assert views.recall("a", ts) is None  # seen once: not armed yet
    views.remember("a", ts, arrays, entries)
    found = views.recall("a", list(ts))  # another list of the same tensors
    assert found is not None and found[1] == entries and all(a is b for a, b in zip(found[0], arrays, strict=True))
    assert views.recall("b", ts) is None  # another site
    ts[2].requires_grad_(True)
    assert views.recall("a", ts) is None  # another state
    ts[2].requires_grad_(False)
    assert views.recall("a", ts) is not None
    assert views.recall("a", ts[:-1] + [torch.zeros(FEW)]) is None  # another tensor
    few = ts[:FEW - 1]
    views.remember("few", few, arrays[:FEW - 1], entries[:FEW - 1])
    views.remember("few", few, arrays[:FEW - 1], entries[:FEW - 1])
    assert views.recall("few", few) is None  # too few to keep
    for k in range(CAPACITY):  # CAPACITY more sites: "a" is the least recently used and goes
        views.remember(("site", k), ts, arrays, entries)
    assert views.recall("a", ts) is None


@pytest.mark.mpi
def test_grouped_in_place_calls_on_the_same_tensors_stay_right_when_the_tensors_change(torch):
    """The views of a grouped call's tensors are kept while the tensors are unchanged (horovod/views.py): each
    call is checked against the sum of every rank's random data, also after a tensor gets new memory, a new
    shape or another dtype, and after the list changes; and a list of the same tensors is recognised."""
    import mpi_gradreducer.horovod as hvd

    hvd.init()
    try:
        gen = torch.Generator().manual_seed(RANK)
        tensors = [torch.randint(-50, 50, (k % 13 + 1,), generator=gen).float() for k in range(40)]

        def reduce_and_check(ts: list) -> None:
            before = [t.clone() for t in ts]
            expected = [sum(WORLD.allgather(b.numpy())) for b in before]  # integer-valued floats: exact sums
            got = hvd.grouped_allreduce_(ts, name="views.grouped", op=hvd.Sum)
            assert len(got) == len(ts) and all(a is b for a, b in zip(got, ts, strict=True))
            for k, (t, e) in enumerate(zip(ts, expected, strict=True)):
                assert np.array_equal(t.numpy(), e), k
                t.copy_(torch.randint(-50, 50, t.shape, generator=gen, dtype=t.dtype))

        for _ in range(4):  # the third call on finds the views kept
            reduce_and_check(tensors)
        reduce_and_check(list(tensors))  # another list, the same tensors
        tensors[3].data = torch.randint(-50, 50, (tensors[3].numel(),), generator=gen).float()  # new memory
        reduce_and_check(tensors)
        reduce_and_check(tensors)
        tensors[7].data = torch.ones(tensors[7].numel() + 5)  # a new shape
        reduce_and_check(tensors)
        tensors[8].data = tensors[8].data.view(1, -1)  # the same memory, another shape
        reduce_and_check(tensors)
        tensors[9].data = tensors[9].data.double()  # another dtype
        for _ in range(3):
            reduce_and_check(tensors)
        tensors[11], tensors[12] = tensors[12], tensors[11]  # the list changes
        reduce_and_check(tensors)
        tensors.append(torch.ones(3))
        for _ in range(3):
            reduce_and_check(tensors)
    finally:
        hvd.shutdown()


@pytest.mark.mpi
@pytest.mark.parametrize("threshold", ["0", "5000", "134217728"])
def test_a_broadcast_of_many_tensors_travels_packed_and_every_rank_gets_the_root_s_bits(torch, threshold,
                                                                                          monkeypatch):
    """``broadcast_parameters`` with tensors below and above ``PACK_BELOW``, empty ones, several dtypes and random
    bits; the root is the last rank; buckets of up to the threshold (0: each tensor alone)."""
    import mpi_gradreducer.horovod as hvd
    from mpi_gradreducer.horovod.execute import PACK_BELOW

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", threshold)
    hvd.shutdown()  # settings are read by init
    hvd.init()
    try:
        root = SIZE - 1
        rng = np.random.default_rng(1234 + RANK)  # different data on every rank: only the root's may survive
        dtypes = (torch.float32, torch.float64, torch.float16, torch.int64, torch.bfloat16, torch.uint8)
        sizes = [k % 53 for k in range(150)] + [PACK_BELOW // 4, PACK_BELOW // 4 + 1, 0, 3]
        tensors = [torch.from_numpy(rng.standard_normal(n)).to(dtypes[k % len(dtypes)]) for k, n in enumerate(sizes)]
        mine = [t.clone() for t in tensors]
        hvd.broadcast_parameters({f"p{k:03d}": t for k, t in enumerate(tensors)}, root_rank=root)
        if RANK == root:
            assert all(torch.equal(a, b) for a, b in zip(tensors, mine, strict=True))
        assert_same_on_all_ranks(WORLD, [t.view(torch.uint8).numpy() for t in tensors if t.numel()])  # bitwise
        if SIZE > 1 and RANK != root:
            assert not all(torch.equal(a, b) for a, b in zip(tensors, mine, strict=True) if a.numel())
    finally:
        hvd.shutdown()
    assert MPI.Is_initialized()


def test_every_horovod_variable_is_honoured_ignored_with_a_reason_or_refused():
    from pathlib import Path

    from mpi_gradreducer.horovod.settings import HONOURED, NOT_APPLICABLE, REFUSED, VARIABLES

    assert {verdict for verdict, _ in VARIABLES.values()} == {HONOURED, NOT_APPLICABLE, REFUSED}
    got = Settings.from_environment({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CACHE_CAPACITY": "1024",
                                     "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_DISABLE_GROUP_FUSION": "1",
                                     "HOROVOD_CPU_OPERATIONS": "MPI", "HOROVOD_SOURCE": "/elsewhere"})
    assert got.hierarchical and not got.group_fusion
    assert not Settings.from_environment({}).hierarchical, "flat by default, as in Horovod"
    assert [note.split("=")[0] for note in got.ignored] == ["HOROVOD_AUTOTUNE", "HOROVOD_CACHE_CAPACITY"]
    assert "no autotuning" in got.ignored[0]
    with pytest.raises(ValueError, match=r"HOROVOD_CPU_OPERATIONS: expected MPI, got 'gloo': gloo is not supported"):
        Settings.from_environment({"HOROVOD_CPU_OPERATIONS": "gloo"})
    with pytest.raises(ValueError, match=r"HOROVOD_GLOO_TIMEOUT_SECONDS='30' is refused: gloo is not supported"):
        Settings.from_environment({"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
    table = (Path(__file__).resolve().parents[1] / "docs" / "horovod.rst").read_text()
    assert not [name for name in VARIABLES if f"``{name}``" not in table]  # docs/horovod.rst lists every one


@pytest.mark.mpi
def test_the_horovod_bench_times_every_method_against_the_reducer(torch):
    """``python -m mpi_gradreducer.bench horovod`` on a small case: every method timed, checked, and a ratio each."""
    from mpi_gradreducer.bench.horovod import METHODS, bench_small, format_small

    res = bench_small(WORLD, 20, 256, METHODS, reps=2, warmup=1)
    assert list(res["methods"]) == list(METHODS) and res["count"] == 20 and res["bytes"] == 256
    assert all(len(m["times_ms"]) == 2 and m["median_ms"] > 0 for m in res["methods"].values())
    assert {k for k in res if k.endswith("_over_reducer")} == {f"{m}_over_reducer" for m in METHODS[1:]}
    assert "async / reducer = " in format_small(res)
