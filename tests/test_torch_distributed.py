"""``mpi_gradreducer.torch.distributed``: torch.distributed's backend ``"mpi_gradreducer"`` against numpy.

Every test is collective: it runs under ``mpiexec -n N python -m pytest
--only-mpi`` (and at one rank with ``--with-mpi``). Rank ``r``'s tensors are
a function of ``r``, so that every rank computes what every collective must
give with numpy, without communication, and compares after it. The default
process group is made once for the module (``init_method="mpi://"``) and
destroyed after it.
"""

from __future__ import annotations

import datetime
import importlib.util
import re

import numpy as np
import pytest

from conftest import HAS_TORCH, WORLD, run_job

SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
TOLERANCE = 1e-9
REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "uint8", "int16", "int32",
          "int64", "bool", "uint16", "uint32", "uint64")


@pytest.fixture(scope="module")
def dist(torch):
    """``torch.distributed`` with the default group over this backend (the module's tests share it)."""
    import torch.distributed as d

    import mpi_gradreducer.torch  # noqa: F401 (registers the backend)

    assert not d.is_initialized()
    d.init_process_group("mpi_gradreducer", init_method="mpi://")
    yield d
    d.destroy_process_group()


def _values(torch, dtype_name: str, rank: int, n: int = 7):
    """Rank ``rank``'s tensor: small values whose products and sums stay exact in every dtype."""
    dtype = getattr(torch, dtype_name)
    base = (np.arange(n) + rank) % 3 + 1
    if dtype_name == "bool":
        return torch.tensor((np.arange(n) + rank) % 2 == 0)
    if dtype.is_complex:
        return torch.tensor(base + 1j * (base % 2), dtype=dtype)
    return torch.tensor(base, dtype=dtype)


def _numpy(t) -> np.ndarray:
    import torch

    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.numpy()


def _expected(torch, dtype_name: str, op: str, n: int = 7) -> np.ndarray:
    """What the reduction of every rank's ``_values`` is, by numpy, in the tensors' dtype."""
    rows = np.stack([_numpy(_values(torch, dtype_name, r, n)) for r in range(SIZE)])
    if dtype_name == "bool":
        return {"SUM": rows.any(0), "MAX": rows.any(0), "BOR": rows.any(0), "PRODUCT": rows.all(0),
                "MIN": rows.all(0), "BAND": rows.all(0), "BXOR": np.logical_xor.reduce(rows, 0)}[op]
    if op == "AVG":
        return rows.mean(0)
    return {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max, "BAND": np.bitwise_and.reduce,
            "BOR": np.bitwise_or.reduce, "BXOR": np.bitwise_xor.reduce}[op](rows, 0)


def _valid(dtype_name: str, op: str) -> bool:
    floating = dtype_name.startswith(("float", "bfloat", "complex"))
    if dtype_name.startswith("complex"):
        return op in ("SUM", "AVG")  # torch itself refuses the rest
    if op == "AVG":
        return floating
    if op in ("MIN", "MAX"):
        return not dtype_name.startswith("complex")
    if op in ("BAND", "BOR", "BXOR"):
        return not floating
    return True


def _close(got: np.ndarray, want: np.ndarray, dtype_name: str) -> None:
    if dtype_name in ("float16", "bfloat16"):
        np.testing.assert_allclose(got, want, rtol=1e-2)
    elif dtype_name.startswith(("float", "complex")):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


# -- reductions ---------------------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", REDUCTIONS)
def test_all_reduce_every_op_and_dtype(torch, dist, dtype_name, op):
    t = _values(torch, dtype_name, RANK)
    reduce_op = getattr(dist.ReduceOp, op)
    if not _valid(dtype_name, op):
        # ours names the operation and the ReduceOp; torch's own (complex tensors) "all_reduce does not support"
        with pytest.raises((TypeError, ValueError), match=f"all_reduce: ReduceOp.{op}|all_reduce does not support"):
            dist.all_reduce(t, op=reduce_op)
        return
    dist.all_reduce(t, op=reduce_op)
    _close(_numpy(t), _expected(torch, dtype_name, op), dtype_name)


@pytest.mark.mpi
def test_half_sums_are_the_float32_sum_rounded_once(torch, dist):
    """float16 and bfloat16 sums are the package's: float32 in rank order, rounded once."""
    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(3)
        rows = [torch.randn(1000, generator=g).to(dtype) for _ in range(SIZE)]
        t = rows[RANK].clone()
        dist.all_reduce(t)
        want = rows[0].float()
        for r in rows[1:]:
            want = want + r.float()
        assert torch.equal(t, want.to(dtype)), dtype


@pytest.mark.mpi
def test_all_reduce_strided_large_and_empty(torch, dist):
    big = torch.full((3, 700_000), float(RANK + 1), dtype=torch.float64).t()  # strided, more than one chunk
    dist.all_reduce(big)
    assert torch.equal(big, torch.full((700_000, 3), SIZE * (SIZE + 1) / 2, dtype=torch.float64))
    empty = torch.empty(0, 4)
    dist.all_reduce(empty)
    scalar = torch.tensor(float(RANK))
    dist.all_reduce(scalar, op=dist.ReduceOp.MAX)
    assert scalar.item() == SIZE - 1


@pytest.mark.mpi
def test_all_reduce_coalesced_and_coalescing_manager(torch, dist):
    tensors = [torch.full((4,), float(RANK)), torch.full((2, 3), float(2 * RANK))]
    dist.all_reduce_coalesced(tensors)
    s = SIZE * (SIZE - 1) / 2
    assert torch.equal(tensors[0], torch.full((4,), s)) and torch.equal(tensors[1], torch.full((2, 3), 2 * s))
    from torch.distributed.distributed_c10d import _coalescing_manager

    more = [torch.full((3,), float(RANK + k)) for k in range(3)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in more:
            dist.all_reduce(t)
    cm.wait()
    for k, t in enumerate(more):
        assert torch.equal(t, torch.full((3,), s + SIZE * k))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "PRODUCT"])
def test_reduce_at_every_root(torch, dist, op):
    for root in range(SIZE):
        for dtype_name in ("float32", "bfloat16", "int32"):
            if not _valid(dtype_name, op):
                continue
            t = _values(torch, dtype_name, RANK)
            before = t.clone()
            dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op))
            if RANK == root:
                _close(_numpy(t), _expected(torch, dtype_name, op), dtype_name)
            else:
                assert torch.equal(t, before)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64", "bool"])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MIN"])
def test_reduce_scatter_and_reduce_scatter_tensor(torch, dist, dtype_name, op):
    if not _valid(dtype_name, op):
        return
    n = 3
    whole = [_values(torch, dtype_name, RANK, n * SIZE) for _ in range(1)][0]
    want = _expected(torch, dtype_name, op, n * SIZE)[RANK * n:(RANK + 1) * n]
    out = torch.empty(n, dtype=whole.dtype)
    dist.reduce_scatter_tensor(out, whole, op=getattr(dist.ReduceOp, op))
    _close(_numpy(out), want, dtype_name)
    out2 = torch.empty(n, dtype=whole.dtype)
    dist.reduce_scatter(out2, list(whole.split(n)), op=getattr(dist.ReduceOp, op))
    _close(_numpy(out2), want, dtype_name)
    from torch.distributed.distributed_c10d import _coalescing_manager

    outs = [torch.empty(n, dtype=whole.dtype) for _ in range(2)]
    with _coalescing_manager(async_ops=True) as cm:
        for o in outs:
            dist.reduce_scatter_tensor(o, whole, op=getattr(dist.ReduceOp, op))
    cm.wait()
    for o in outs:
        _close(_numpy(o), want, dtype_name)


# -- data movement ---------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_broadcast_every_root_and_dtype(torch, dist):
    for root in range(SIZE):
        for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8, torch.bool,
                      torch.uint32, torch.float8_e4m3fn):
            src = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
            t = src.clone() if RANK == root else torch.zeros(2, 3, dtype=dtype)
            dist.broadcast(t, src=root)
            assert torch.equal(t.view(torch.uint8) if dtype.itemsize == 1 else t,
                               src.view(torch.uint8) if dtype.itemsize == 1 else src), (root, dtype)


@pytest.mark.mpi
def test_all_gather_forms(torch, dist):
    mine = torch.full((2, 2), float(RANK), dtype=torch.float64)
    out = [torch.empty(2, 2, dtype=torch.float64) for _ in range(SIZE)]
    dist.all_gather(out, mine)
    for r in range(SIZE):
        assert torch.equal(out[r], torch.full((2, 2), float(r), dtype=torch.float64))
    flat = torch.empty(SIZE * 2, 2, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, torch.arange(SIZE, dtype=torch.float64).repeat_interleave(4).reshape(SIZE * 2, 2))
    strided = torch.empty(2, SIZE * 2, dtype=torch.float64).t()  # a strided output is written back
    dist.all_gather_into_tensor(strided, mine)
    assert torch.equal(strided, flat)
    from torch.distributed.distributed_c10d import _coalescing_manager

    outs = [torch.empty(SIZE * 3, dtype=torch.int16) for _ in range(2)]
    with _coalescing_manager(async_ops=True) as cm:
        for k, o in enumerate(outs):
            dist.all_gather_into_tensor(o, torch.full((3,), RANK + k, dtype=torch.int16))
    cm.wait()
    for k, o in enumerate(outs):
        assert torch.equal(o, (torch.arange(SIZE, dtype=torch.int16) + k).repeat_interleave(3))


@pytest.mark.mpi
def test_object_forms(torch, dist):
    gathered = [None] * SIZE
    dist.all_gather_object(gathered, {"rank": RANK, "name": "x" * RANK})
    assert gathered == [{"rank": r, "name": "x" * r} for r in range(SIZE)]
    objects = [("root", 7), None] if RANK == 0 else [None, None]
    dist.broadcast_object_list(objects, src=0)
    assert objects == [("root", 7), None]
    at_root = [None] * SIZE if RANK == 0 else None
    dist.gather_object(RANK * 10, at_root, dst=0)
    if RANK == 0:
        assert at_root == [r * 10 for r in range(SIZE)]
    got: list = [None]
    dist.scatter_object_list(got, [f"for {r}" for r in range(SIZE)] if RANK == 0 else None, src=0)
    assert got == [f"for {RANK}"]


@pytest.mark.mpi
def test_gather_and_scatter_every_root(torch, dist):
    for root in range(SIZE):
        mine = torch.full((3,), RANK + 0.5)
        into = [torch.empty(3) for _ in range(SIZE)] if RANK == root else None
        dist.gather(mine, into, dst=root)
        if RANK == root:
            assert all(torch.equal(into[r], torch.full((3,), r + 0.5)) for r in range(SIZE))
        out = torch.empty(2, dtype=torch.int32)
        parts = [torch.full((2,), 100 * r + root, dtype=torch.int32) for r in range(SIZE)] if RANK == root else None
        dist.scatter(out, parts, src=root)
        assert torch.equal(out, torch.full((2,), 100 * RANK + root, dtype=torch.int32))


@pytest.mark.mpi
@pytest.mark.parametrize("wrong", ["count", "size"])  # (dtype and type: torch checks them itself, on the root)
def test_a_bad_root_list_raises_on_every_rank_naming_the_entry(torch, dist, wrong):
    root = SIZE - 1
    good = [torch.zeros(3) for _ in range(SIZE)]
    bad = {"count": good[:-1] or [torch.zeros(3), torch.zeros(3)], "size": [*good[:-1], torch.zeros(4)]}[wrong]
    expected = {"count": rf": expected {SIZE} tensors \(one per rank\) at the root, got {len(bad)}",
                "size": rf"\[{SIZE - 1}\]: expected 3 elements of torch.float32, got 4 of torch.float32"}[wrong]
    for op in ("gather", "scatter"):
        mine = torch.full((3,), float(RANK))
        said = f"rank {root}: " if SIZE > 1 else ""
        with pytest.raises((TypeError, ValueError), match=f"{said}{op}: {op}_list{expected}"):
            if op == "gather":
                dist.gather(mine, bad if RANK == root else None, dst=root)
            else:
                dist.scatter(mine, bad if RANK == root else None, src=root)
        assert torch.equal(mine, torch.full((3,), float(RANK)))  # nothing written
    dist.gather(torch.ones(3), good if RANK == root else None, dst=root)  # and the group goes on


@pytest.mark.mpi
def test_all_to_all_single_even_and_uneven(torch, dist):
    x = torch.arange(2 * SIZE, dtype=torch.float64) + 100 * RANK
    y = torch.empty(2 * SIZE, dtype=torch.float64)
    dist.all_to_all_single(y, x)
    want = torch.cat([torch.arange(2 * RANK, 2 * RANK + 2, dtype=torch.float64) + 100 * r for r in range(SIZE)])
    assert torch.equal(y, want)
    # uneven: rank r sends (r + k + 1) rows of 2 to rank k
    send = [RANK + k + 1 for k in range(SIZE)]
    recv = [r + RANK + 1 for r in range(SIZE)]
    x = torch.cat([torch.full((n, 2), float(10 * RANK + k)) for k, n in enumerate(send)])
    y = torch.empty(sum(recv), 2)
    dist.all_to_all_single(y, x, output_split_sizes=recv, input_split_sizes=send)
    assert torch.equal(y, torch.cat([torch.full((n, 2), float(10 * r + RANK)) for r, n in enumerate(recv)]))


@pytest.mark.mpi
def test_all_to_all_lists_of_any_sizes(torch, dist):
    inputs = [torch.full((RANK + k + 1,), RANK * 10 + k, dtype=torch.int64) for k in range(SIZE)]
    outputs = [torch.empty(r + RANK + 1, dtype=torch.int64) for r in range(SIZE)]
    dist.all_to_all(outputs, inputs)
    for r in range(SIZE):
        assert torch.equal(outputs[r], torch.full((r + RANK + 1,), r * 10 + RANK, dtype=torch.int64))


@pytest.mark.mpi
def test_barrier_and_monitored_barrier(torch, dist):
    dist.barrier()
    dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=60))


# -- point to point ------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_send_recv_ring_and_any_source(torch, dist):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty(4, dtype=torch.bfloat16)
    works = [dist.isend(torch.full((4,), float(RANK), dtype=torch.bfloat16), right),
             dist.irecv(got, left)]
    for w in works:
        w.wait()
    assert torch.equal(got, torch.full((4,), float(left), dtype=torch.bfloat16))
    if RANK == 0:
        sources = set()
        for _ in range(SIZE - 1):
            t = torch.empty(2)
            sources.add(dist.recv(t, tag=5))
            assert t[0].item() == t[1].item() - 1 and int(t[0].item()) in range(1, SIZE)
        assert sources == set(range(1, SIZE))
    else:
        dist.send(torch.tensor([float(RANK), RANK + 1.0]), 0, tag=5)
    dist.barrier()


@pytest.mark.mpi(min_size=2)
def test_wait_timeout_then_completion(torch, dist):
    """A receive whose sender comes late: ``wait(timeout)`` raises, the work completes afterwards."""
    if RANK == 1:
        t = torch.zeros(3)
        work = dist.irecv(t, 0, tag=9)
        assert not work.is_completed()
        with pytest.raises(RuntimeError, match="did not complete within"):
            work.wait(datetime.timedelta(seconds=0.2))
    dist.barrier()
    if RANK == 0:
        dist.send(torch.ones(3), 1, tag=9)
    if RANK == 1:
        assert work.wait()
        assert work.is_completed() and torch.equal(t, torch.ones(3))
    dist.barrier()


# -- async, subgroups, agreement ------------------------------------------------------------------------------


@pytest.mark.mpi
def test_async_work_and_futures(torch, dist):
    tensors = [torch.full((1000,), float(RANK + k)) for k in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
    for k, (w, f) in enumerate(zip(works, futures, strict=True)):
        assert w.wait(datetime.timedelta(seconds=60))
        assert w.is_completed()
        s = SIZE * (SIZE - 1) / 2 + SIZE * k
        assert torch.equal(tensors[k], torch.full((1000,), s))
        assert torch.equal(f.wait(), torch.full((1000,), 2 * s))


@pytest.mark.mpi(min_size=2)
def test_subgroups_are_sub_communicators(torch, dist):
    even = [r for r in range(SIZE) if r % 2 == 0]
    odd = [r for r in range(SIZE) if r % 2 == 1]
    groups = [dist.new_group(even), dist.new_group(odd)]
    mine = groups[RANK % 2]
    members = even if RANK % 2 == 0 else odd
    t = torch.full((3,), float(RANK))
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, torch.full((3,), float(sum(members))))
    out = [torch.empty(1) for _ in members]
    dist.all_gather(out, torch.tensor([float(RANK)]), group=mine)
    assert [o.item() for o in out] == [float(r) for r in members]
    b = torch.tensor([float(RANK)])
    dist.broadcast(b, src=members[-1], group=mine)
    assert b.item() == members[-1]
    assert dist.get_backend(mine) == "mpi_gradreducer"
    sub, _ = dist.new_subgroups(group_size=1)
    one = torch.full((2,), float(RANK))
    dist.all_reduce(one, group=sub)
    assert torch.equal(one, torch.full((2,), float(RANK)))
    for g in [*groups, sub]:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["shape", "dtype", "op", "root"])
def test_a_difference_on_one_rank_raises_on_every_rank(torch, dist, what):
    last = RANK == SIZE - 1
    shape = (3, 4) if what == "shape" and last else (3, 3)
    dtype = torch.float64 if what == "dtype" and last else torch.float32
    op = dist.ReduceOp.MAX if what == "op" and last else dist.ReduceOp.SUM
    t = torch.ones(shape, dtype=dtype)
    before = t.clone()
    with pytest.raises(ValueError, match=f"the ranks disagree.* at rank {SIZE - 1}"):
        if what == "root":
            dist.broadcast(t, src=SIZE - 1 if last else 0)
        else:
            dist.all_reduce(t, op=op)
    assert torch.equal(t, before)  # nothing was written
    if what == "shape":  # the future fails too, as C++ callers (DDP) see it: an error, not a value
        with pytest.raises(Exception, match="the ranks disagree"):
            dist.all_reduce(t, async_op=True).get_future().wait()
    same = torch.ones(3, 3)
    dist.all_reduce(same)  # and the group goes on
    assert torch.equal(same, torch.full((3, 3), float(SIZE)))


@pytest.mark.mpi
def test_unsupported_raises_naming_the_operation(torch, dist):
    with pytest.raises(ValueError, match="all_reduce: ReduceOp.PREMUL_SUM is not supported"):
        from torch._C._distributed_c10d import _make_nccl_premul_sum

        dist.all_reduce(torch.ones(2), op=_make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match="all_reduce: tensors of dtype torch.float8_e4m3fn cannot be reduced"):
        dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="all_to_all_single: input_split_sizes"):
        dist.all_to_all_single(torch.empty(SIZE), torch.empty(SIZE), input_split_sizes=[SIZE + 1] * SIZE,
                               output_split_sizes=[1] * SIZE)


@pytest.mark.mpi
def test_validate_never_skips_the_agreement(torch, dist):
    from mpi_gradreducer import Options

    group = dist.new_group(list(range(SIZE)), pg_options=Options(validate="never"))
    t = torch.full((5,), float(RANK))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((5,), SIZE * (SIZE - 1) / 2))
    dist.destroy_process_group(group)


# -- training ------------------------------------------------------------------------------------------------


def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _batch(torch, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)


def _reference(torch, steps: int) -> list:
    """One process that trains on every rank's batch (the mean over ranks of equal batches)."""
    model = _model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(_batch(torch, step, r) for r in range(SIZE)), strict=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi
def test_ddp_matches_one_process(torch, dist):
    from torch.nn.parallel import DistributedDataParallel

    steps = 6
    ddp = DistributedDataParallel(_model(torch), bucket_cap_mb=0.0005)  # several buckets: the overlap is used
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(torch, step, RANK)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    for got, want in zip(ddp.module.parameters(), _reference(torch, steps), strict=True):
        assert (got.detach() - want).abs().max().item() <= TOLERANCE


@pytest.mark.mpi
def test_fsdp2_matches_one_process(torch, dist):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    steps = 4
    model = _model(torch)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(torch, step, RANK)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    got = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    for g, want in zip(got, _reference(torch, steps), strict=True):
        assert (g.detach() - want).abs().max().item() <= TOLERANCE


# -- faults (whole jobs) ---------------------------------------------------------------------------------------

#: Seconds within which a job with a fault must have ended.
PROMPT = 60.0


def _ended_promptly(job) -> None:
    assert job.returncode != 0, f"the job should have failed\n{job}"
    assert job.seconds < PROMPT, f"the job took {job.seconds:.1f} s to end\n{job}"
    assert not job.lines(r"rank \d: finished"), f"a rank finished training despite the fault\n{job}"


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_healthy_ddp_job_finishes():
    job = run_job("torch_pg_faults.py", ranks=3, runner=False, limit=120)
    assert job.returncode == 0, str(job)
    assert len(job.lines(r"rank \d: finished")) == 3, str(job)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_an_exception_on_one_rank_ends_the_job():
    job = run_job("torch_pg_faults.py", "--fault=raise", "--rank=2", ranks=3, runner=False, limit=120,
                  env={"MPI_GRADREDUCER_ABORT_ON_EXCEPTION": "1"})
    _ended_promptly(job)
    assert "RuntimeError: injected failure on rank 2 at step 3" in job.stderr, str(job)
    assert re.search(r"mpi_gradreducer: rank 2: uncaught RuntimeError; aborting the job", job.stderr), str(job)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_the_watchdog_names_a_stalled_rank_and_ends_the_job():
    job = run_job("torch_pg_faults.py", "--fault=stall", "--rank=2", "--timeout=2", ranks=3, runner=False,
                  limit=120)
    _ended_promptly(job)
    fired = re.findall(r"mpi_gradreducer: rank (\d): call \d+, allreduce has not completed after [\d.]+ s "
                       r"\(timeout=2 s\); missing ranks: 2 ", job.stderr)
    assert fired and "2" not in fired, str(job)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_a_killed_rank_ends_the_job():
    job = run_job("torch_pg_faults.py", "--fault=kill", "--rank=2", "--timeout=5", ranks=3, runner=False,
                  limit=120)
    _ended_promptly(job)


# -- Lightning (a whole job) -----------------------------------------------------------------------------------

HAS_LIGHTNING = HAS_TORCH and importlib.util.find_spec("lightning") is not None


@pytest.mark.skipif(not HAS_LIGHTNING, reason="needs lightning (the test extra installs it)")
def test_lightning_trainer_with_ddp_over_the_backend():
    """``Trainer(strategy=DDPStrategy(process_group_backend="mpi_gradreducer"), MPIEnvironment)``: env:// from MPI."""
    job = run_job("lightning_ddp.py", ranks=2, runner=False, limit=300)
    assert job.returncode == 0, str(job)
    done = job.lines(r"rank (\d): backend (\S+) weights (\S+)")
    assert sorted(m[1] for m in done) == ["0", "1"], str(job)
    assert {m[2] for m in done} == {"mpi_gradreducer"} and len({m[3] for m in done}) == 1, str(job)


# -- a lost rank under ULFM (a whole job, Open MPI) ------------------------------------------------------------


@pytest.mark.slow
def test_ddp_survives_a_killed_rank_with_elastic(tmp_path):
    """``ElasticGroup``: rank 1 of 4 SIGKILLed mid-training; the 3 survivors remake the group and DDP, and finish."""
    from elastic_ompi import OmpiJob, kill, wait_for, why_not_here

    reason = why_not_here()
    if reason is not None:
        pytest.skip(reason)
    with OmpiJob("tests/jobs/elastic_ddp.py", "--out", str(tmp_path)) as job:
        victim = int(wait_for(lambda: (tmp_path / "pid.1").exists() and (tmp_path / "pid.1").read_text(), 300,
                              "rank 1's pid", job))
        wait_for(lambda: any("step 3 " in p.read_text() for p in tmp_path.glob("log.*")), 300, "step 3", job)
        kill(victim)
        assert job.wait(300) == 0, job.output[-5000:]
    finals = sorted(tmp_path.glob("final.*.npy"))
    assert [f.name for f in finals] == ["final.0.npy", "final.2.npy", "final.3.npy"], job.output[-3000:]
    first = np.load(finals[0])
    for f in finals[1:]:
        assert np.array_equal(np.load(f), first), f"{f.name} differs"
    lost = r"lost rank 1 of 4 .*; 3 ranks go on from the last commit"
    assert re.search(lost, job.output, re.S), job.output[-3000:]
    for r in (0, 2, 3):
        assert (tmp_path / f"log.{r}").read_text().splitlines()[-1] == "step 40 size 3 backend mpi_gradreducer"
