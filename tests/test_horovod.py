"""``mpi_gradreducer.horovod``: Horovod's torch API against numpy, misuse on one rank, the migration table.

Collective tests run under ``mpiexec -n 4`` and ``-n 3`` (``--only-mpi``)
and at size 1. Each rank builds every rank's data from a seed all ranks
know, so each computes the expected answer itself. The tests that make a
``DistributedOptimizer`` run at 4 ranks only (the first torch optimizer of a
process imports ``torch._dynamo``, seconds on this machine). The training
script against DDP over gloo runs as a whole job from the single-process
session (``tests/test_horovod.py::test_train_horovod_matches_ddp``). The
engine (asynchronous handles, names, join, process sets), gradients,
sparse tensors, ``SyncBatchNorm`` and the timeline have files of their own
(``tests/test_horovod_*.py``).
"""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as np
import pytest

from conftest import HAS_TORCH, WORLD, assert_same_on_all_ranks, run_job
from mpi_gradreducer._core.topology import processor_names

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
SCRIPT = os.path.join(ROOT, "scripts", "train_horovod.py")
DOC = os.path.join(ROOT, "docs", "horovod.rst")
JOB_LIMIT = 300
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
LAST = SIZE - 1


def data(r: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Rank ``r``'s random float64 data (every rank can make every rank's)."""
    return np.random.default_rng([seed, r]).standard_normal(shape)


def every(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """All ranks' data, stacked."""
    return np.stack([data(r, shape, seed) for r in range(SIZE)])


def expect_everywhere(exc: type[BaseException], pattern: str, call) -> None:
    """``call()`` raises ``exc`` matching ``pattern`` on this rank (every rank runs this)."""
    with pytest.raises(exc, match=pattern):
        call()


# -- set-up -------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_topology_and_built(hvd):
    assert (hvd.size(), hvd.rank()) == (SIZE, RANK)
    assert hvd.is_initialized()
    names = processor_names(WORLD)
    here = [r for r, n in enumerate(names) if n == names[RANK]]
    assert (hvd.local_rank(), hvd.local_size()) == (here.index(RANK), len(here))  # by host, across hosts too
    assert hvd.local_size() * hvd.cross_size() == SIZE  # every host holds as many ranks (the launches here)
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.nccl_built() or hvd.ddl_built() or hvd.ccl_built()
                or hvd.rocm_built())
    assert isinstance(hvd.cuda_built(), bool) and isinstance(hvd.mpi_threads_supported(), bool)
    assert hvd.global_process_set.size() == SIZE and hvd.global_process_set.included()


@pytest.mark.mpi(min_size=1)
def test_calls_before_init_raise_and_init_again(hvd, torch):
    hvd.shutdown()
    assert not hvd.is_initialized()
    for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.barrier, lambda: hvd.allreduce(np.zeros(1))):
        with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
            call()
    names = processor_names(WORLD)[:LAST]  # collective: every rank, before the branches
    if SIZE > 1:  # the listed ranks only: the last rank is left out, and told so
        if RANK == LAST:
            with pytest.raises(ValueError, match=rf"rank {LAST} of MPI.COMM_WORLD is not in comm"):
                hvd.init(list(range(LAST)))
        else:
            hvd.init(list(range(LAST)))
            assert (hvd.size(), hvd.rank(), hvd.local_size()) == (LAST, RANK, names.count(names[RANK]))
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [LAST]
            hvd.shutdown()
    hvd.init(WORLD)
    hvd.init()  # a second init does nothing, as in Horovod
    assert hvd.size() == SIZE


# -- allreduce ------------------------------------------------------------------------------------------

OPS = ("Average", "Sum", "Min", "Max", "Product")
VARIANTS = ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_")


def _expected(op: str, stacked: np.ndarray, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    x = stacked * pre
    reduced = {"Average": x.sum(0) / SIZE, "Sum": x.sum(0), "Min": x.min(0), "Max": x.max(0),
               "Product": x.prod(0)}[op]
    return reduced * post


def _call(hvd, variant: str, tensor, **kwargs):
    result = getattr(hvd, variant)(tensor, **kwargs)
    if variant.endswith("async") or variant.endswith("async_"):
        result = hvd.synchronize(result)
    return result


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_against_numpy(hvd, torch, op, variant):
    shape = (3, 5)
    scale = {"prescale_factor": 0.5, "postscale_factor": 3.0} if op in ("Average", "Sum") else {}
    tensor = torch.from_numpy(data(RANK, shape, seed=len(op)))
    before = tensor.clone()
    result = _call(hvd, variant, tensor, op=getattr(hvd, op), name=f"t.{op}", **scale)
    expected = _expected(op, every(shape, seed=len(op)), scale.get("prescale_factor", 1.0),
                         scale.get("postscale_factor", 1.0))
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-12, atol=1e-12)
    if variant.endswith("_"):
        assert result is tensor
    else:
        assert torch.equal(tensor, before)  # the input is not modified
    assert result.dtype == torch.float64 and result.shape == shape
    assert_same_on_all_ranks(WORLD, [result.numpy()])


@pytest.mark.mpi(min_size=2)
def test_allreduce_average_flag_and_dtypes(hvd, torch):
    with pytest.warns(DeprecationWarning):
        summed = hvd.allreduce(torch.full((2,), float(RANK)), average=False)
    assert summed.tolist() == [SIZE * (SIZE - 1) / 2] * 2
    ints = hvd.allreduce(torch.full((4,), RANK + 1, dtype=torch.int32), op=hvd.Sum)
    assert ints.dtype == torch.int32 and ints.tolist() == [SIZE * (SIZE + 1) // 2] * 4
    half = hvd.allreduce(torch.full((3,), 0.5, dtype=torch.bfloat16), op=hvd.Sum)
    assert half.dtype == torch.bfloat16 and half.tolist() == [0.5 * SIZE] * 3
    scalar = hvd.allreduce(torch.tensor(float(RANK)), op=hvd.Max)
    assert scalar.shape == () and float(scalar) == LAST


@pytest.mark.mpi(min_size=2)
def test_allreduce_fp16_compression(hvd, torch):
    shape = (64,)
    tensor = torch.from_numpy(data(RANK, shape, seed=7)).float()
    result = hvd.allreduce(tensor, compression=hvd.Compression.fp16)
    assert result.dtype == torch.float32
    wire = [data(r, shape, seed=7).astype(np.float32).astype(np.float16) for r in range(SIZE)]
    total = np.zeros(shape, np.float32)
    for w in wire:  # float16 on the wire, summed in float32 in rank order, scaled, rounded once
        total += w.astype(np.float32)
    expected = (total * np.float32(1 / SIZE)).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(result.numpy(), expected)
    half = torch.from_numpy(data(RANK, shape, seed=8)).half()  # float16 tensors: summed the same way, with Max too
    scaled = hvd.allreduce(half, op=hvd.Sum, prescale_factor=0.5)
    total = np.zeros(shape, np.float32)
    for r in range(SIZE):
        total += (data(r, shape, seed=8).astype(np.float16).astype(np.float32) * np.float32(0.5)).astype(np.float16)
    np.testing.assert_array_equal(scaled.numpy(), total.astype(np.float16))
    largest = np.max([data(r, shape, seed=8).astype(np.float16) for r in range(SIZE)], axis=0)
    np.testing.assert_array_equal(hvd.allreduce(half, op=hvd.Max).numpy(), largest)
    assert hvd.allreduce(torch.zeros(0, dtype=torch.float16)).shape == (0,)
    assert not np.array_equal(result.numpy(), every(shape, seed=7).mean(0).astype(np.float32))  # it did compress
    assert_same_on_all_ranks(WORLD, [result.numpy()])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", ["grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
                                     "grouped_allreduce_async_"])
def test_grouped_allreduce(hvd, torch, variant):
    shapes = [(2, 3), (5,), (1, 1, 4)]
    tensors = [torch.from_numpy(data(RANK, s, seed=i)) for i, s in enumerate(shapes)]
    result = _call(hvd, variant, tensors, op=hvd.Sum, postscale_factor=0.25)
    assert len(result) == len(shapes)
    for i, (s, out) in enumerate(zip(shapes, result, strict=True)):
        np.testing.assert_allclose(out.numpy(), every(s, seed=i).sum(0) * 0.25, rtol=1e-12, atol=1e-12)
    if variant.endswith("_"):
        assert all(a is b for a, b in zip(result, tensors, strict=True))


# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_allgather_uneven_first_dimensions(hvd, torch):
    mine = torch.from_numpy(data(RANK, (RANK + 1, 2, 3)))
    expected = np.concatenate([data(r, (r + 1, 2, 3)) for r in range(SIZE)])
    np.testing.assert_array_equal(hvd.allgather(mine).numpy(), expected)
    np.testing.assert_array_equal(hvd.synchronize(hvd.allgather_async(mine)).numpy(), expected)
    ints = torch.arange(RANK, dtype=torch.int16)  # rank 0 sends nothing
    assert hvd.allgather(ints).tolist() == [i for r in range(SIZE) for i in range(r)]
    grouped = hvd.grouped_allgather([mine, ints])
    np.testing.assert_array_equal(grouped[0].numpy(), expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"])
def test_broadcast(hvd, torch, variant):
    tensor = torch.from_numpy(data(RANK, (4, 2))).float()
    result = _call(hvd, variant, tensor, root_rank=LAST)
    np.testing.assert_array_equal(result.numpy(), data(LAST, (4, 2)).astype(np.float32))
    if variant.endswith("_"):
        assert result is tensor
    elif RANK != LAST:
        np.testing.assert_array_equal(tensor.numpy(), data(RANK, (4, 2)).astype(np.float32))


def _splits(source: int) -> list[int]:
    return [(source + d) % 3 for d in range(SIZE)]


@pytest.mark.mpi(min_size=2)
def test_alltoall_with_splits(hvd, torch):
    rows = sum(_splits(RANK))
    tensor = torch.from_numpy(data(RANK, (rows, 2)))
    out, received = hvd.alltoall(tensor, splits=torch.tensor(_splits(RANK), dtype=torch.int32))
    pieces = []
    for source in range(SIZE):
        theirs = data(source, (sum(_splits(source)), 2))
        start = sum(_splits(source)[:RANK])
        pieces.append(theirs[start:start + _splits(source)[RANK]])
    np.testing.assert_array_equal(out.numpy(), np.concatenate(pieces))
    assert received.dtype == torch.int32 and received.tolist() == [_splits(s)[RANK] for s in range(SIZE)]
    equal = hvd.alltoall(torch.full((SIZE, 2), RANK))  # no splits: equal parts, the tensor only (Horovod 0.28)
    assert isinstance(equal, torch.Tensor) and equal[:, 0].tolist() == list(range(SIZE))
    out2, received2 = hvd.synchronize(hvd.alltoall_async(tensor, splits=np.array(_splits(RANK))))
    assert torch.equal(out2, out) and received2.tolist() == received.tolist()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["Average", "Sum", "Max"])
def test_reducescatter(hvd, torch, op):
    first = 2 * SIZE + 1  # uneven: rank 0 gets one row more
    tensor = torch.from_numpy(data(RANK, (first, 3), seed=3))
    scale = {"prescale_factor": 2.0, "postscale_factor": 0.5} if op != "Max" else {}
    result = hvd.reducescatter(tensor, op=getattr(hvd, op), **scale)
    full = _expected(op, every((first, 3), seed=3), scale.get("prescale_factor", 1.0),
                     scale.get("postscale_factor", 1.0))
    counts = [first // SIZE + (1 if r < first % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    np.testing.assert_allclose(result.numpy(), full[start:start + counts[RANK]], rtol=1e-12, atol=1e-12)
    asynchronous = hvd.synchronize(hvd.reducescatter_async(tensor, op=getattr(hvd, op), **scale))
    assert torch.equal(asynchronous, result)
    assert torch.equal(hvd.grouped_reducescatter([tensor], op=getattr(hvd, op), **scale)[0], result)


# -- gradients through the collectives ----------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_gradients_through_collectives(hvd, torch):
    """Each input's gradient, against numpy: Horovod's backward functions (allgather's averages, as Horovod's)."""
    weights = [data(r, (SIZE + 1, 2), seed=11) for r in range(SIZE)]  # rank r's loss: sum(output * weights[r])

    x = torch.from_numpy(data(RANK, (3, 2), seed=12)).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5)
    (y * torch.from_numpy(weights[RANK][:3])).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), sum(w[:3] for w in weights) / SIZE, rtol=1e-12)

    parts = [torch.from_numpy(data(RANK, s, seed=13)).requires_grad_() for s in ((2,), (1, 2))]
    outs = hvd.grouped_allreduce(parts, op=hvd.Sum)
    (outs[0].sum() * (RANK + 1) + outs[1].sum()).backward()
    assert parts[0].grad.tolist() == [SIZE * (SIZE + 1) / 2] * 2 and parts[1].grad.tolist() == [[SIZE, SIZE]]

    rows = 1 + RANK % 2
    counts = [1 + r % 2 for r in range(SIZE)]
    x = torch.from_numpy(data(RANK, (rows, 2), seed=14)).requires_grad_()
    gathered = hvd.allgather(x)
    big = [data(r, (sum(counts), 2), seed=15) for r in range(SIZE)]
    (gathered * torch.from_numpy(big[RANK])).sum().backward()
    start = sum(counts[:RANK])
    np.testing.assert_allclose(x.grad.numpy(), sum(big)[start:start + rows] / SIZE, rtol=1e-12)

    x = torch.from_numpy(data(RANK, (SIZE + 1, 2), seed=16)).requires_grad_()
    (hvd.broadcast(x, root_rank=LAST) * torch.from_numpy(weights[RANK])).sum().backward()
    expected = sum(weights) / SIZE if RANK == LAST else np.zeros((SIZE + 1, 2))
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-12)

    splits = _splits(RANK)
    x = torch.from_numpy(data(RANK, (sum(splits), 2), seed=17)).requires_grad_()
    out, received = hvd.alltoall(x, splits=splits)
    assert not received.requires_grad
    received_rows = [sum(_splits(s)[d] for s in range(SIZE)) for d in range(SIZE)]
    grads = [data(d, (received_rows[d], 2), seed=18) for d in range(SIZE)]
    (out * torch.from_numpy(grads[RANK])).sum().backward()
    expected_rows = []
    for d in range(SIZE):  # my rows sent to d come back from d's gradient, at my place among its sources
        start = sum(_splits(s)[d] for s in range(RANK))
        expected_rows.append(grads[d][start:start + splits[d]])
    np.testing.assert_allclose(x.grad.numpy(), np.concatenate(expected_rows), rtol=1e-12)

    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():  # not recorded: the same calls, no graph
        assert not hvd.allreduce(x).requires_grad


# -- objects -----------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_objects(hvd):
    assert hvd.broadcast_object({"rank": RANK, "list": [RANK] * 3}, root_rank=LAST) == \
        {"rank": LAST, "list": [LAST] * 3}
    assert hvd.broadcast_object(RANK) == 0
    assert hvd.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]
    assert hvd.allgather_object(b"x" * RANK) == [b"x" * r for r in range(SIZE)]  # sizes differ, rank 0's is empty


# -- misuse raises the same error on every rank ------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_different_shapes_raise_horovods_error_on_every_rank(hvd, torch):
    """Ranks that disagree raise Horovod's type (a RuntimeError) with our message, naming both ranks."""
    shape = (3,) if RANK != LAST else (4,)
    expect_everywhere(hvd.HorovodInternalError,
                      rf"the ranks disagree on 'noname.\d+': rank 0 called hvd.allreduce of \[float32 \(3,\)\] with "
                      rf"op=Average but rank {LAST} called hvd.allreduce of \[float32 \(4,\)\]",
                      lambda: hvd.allreduce(torch.zeros(shape)))
    dims = (2, 3) if RANK != LAST else (2, 4)
    expect_everywhere(RuntimeError, r"only the first dimension may differ",
                      lambda: hvd.allgather(torch.zeros(dims)))
    expect_everywhere(RuntimeError, rf"rank 0 called hvd.broadcast .* from root_rank=0 but rank {LAST} called "
                                    rf"hvd.broadcast .* from root_rank=1",
                      lambda: hvd.broadcast(torch.zeros(2), root_rank=0 if RANK != LAST else 1))
    expect_everywhere(RuntimeError, r"rank 0 called hvd.allreduce of \[int32 \(2,\)\]",
                      lambda: hvd.allreduce(torch.zeros(2, dtype=torch.int32 if RANK == 0 else torch.float32)))
    expect_everywhere(RuntimeError, r"with op=Sum but rank \d+ called hvd.allreduce of \[float32 \(2,\)\] with op=Max",
                      lambda: hvd.allreduce(torch.zeros(2), op=hvd.Sum if RANK == 0 else hvd.Max))
    kinds = hvd.allreduce if RANK != LAST else hvd.allgather
    expect_everywhere(RuntimeError, r"the ranks disagree", lambda: kinds(torch.zeros(2)))
    expect_everywhere(RuntimeError, r"the ranks disagree on 'name'", lambda: hvd.reducescatter(
        torch.zeros(SIZE * (2 if RANK == LAST else 1)), name="name"))
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]  # usable after


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_raises_on_every_rank(hvd, torch):
    here = RANK == LAST
    expect_everywhere(TypeError, rf"rank {LAST}: hvd.allreduce: tensor: expected a torch.Tensor, got list",
                      lambda: hvd.allreduce([1.0] if here else torch.zeros(1)))
    expect_everywhere(ValueError, rf"rank {LAST}: hvd.allreduce: op: expected one of",
                      lambda: hvd.allreduce(torch.zeros(1), op=17 if here else hvd.Sum))
    expect_everywhere(NotImplementedError, rf"rank {LAST}: hvd.allreduce: op=Adasum is not implemented",
                      lambda: hvd.allreduce(torch.zeros(1), op=hvd.Adasum if here else hvd.Sum))
    expect_everywhere(ValueError, rf"rank {LAST}: hvd.broadcast: root_rank: expected a rank in \[0, {LAST}\], got "
                                  rf"{SIZE}",
                      lambda: hvd.broadcast(torch.zeros(1), SIZE if here else 0))
    expect_everywhere(ValueError, rf"rank {LAST}: hvd.alltoall: splits: expected ints that sum to the first dimension",
                      lambda: hvd.alltoall(torch.zeros(SIZE), splits=[1] * (SIZE - 1) + [2 if here else 1]))
    expect_everywhere(ValueError, r"rank 0: hvd.allreduce: the op parameter supersedes average",
                      lambda: hvd.allreduce(torch.zeros(1), op=hvd.Sum, average=True))
    expect_everywhere(ValueError, rf"rank {LAST}: hvd.reducescatter: prescale_factor: expected a finite number",
                      lambda: hvd.reducescatter(torch.zeros(SIZE), prescale_factor=float("nan") if here else 1.0))
    expect_everywhere(ValueError, r"rank 0: hvd.reducescatter: tensors\[0\]: expected at least one dimension",
                      lambda: hvd.reducescatter(torch.tensor(1.0)))
    expect_everywhere(TypeError, rf"rank {LAST}: hvd.allgather: name: expected a str or None, got int",
                      lambda: hvd.allgather(torch.zeros(1), name=3 if here else None))
    expect_everywhere(ValueError, rf"rank {LAST}: hvd.broadcast_object: root_rank: expected a rank",
                      lambda: hvd.broadcast_object(1, root_rank=-1 if here else 0))

    class Broken(hvd.Compression.none):  # a compressor that fails on one rank, with an error of its own
        @staticmethod
        def compress(tensor):
            if here:
                raise ArithmeticError("broken compressor")
            return tensor, None

    expect_everywhere(RuntimeError, rf"rank {LAST}: broken compressor",
                      lambda: hvd.allreduce(torch.zeros(1), compression=Broken))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [SIZE]  # the counts of unnamed calls still agree


@pytest.mark.mpi(min_size=2)
def test_async_bad_input_raises_at_once_and_at_synchronize_elsewhere(hvd, torch):
    """As in Horovod, an ``*_async`` call with a bad argument raises at once; the others raise at synchronize."""
    here = RANK == LAST
    if here:
        with pytest.raises(ValueError, match=rf"rank {LAST}: hvd.allgather_async: tensors\[0\]: expected at least one"):
            hvd.allgather_async(torch.tensor(1.0))
    else:
        handle = hvd.allgather_async(torch.zeros(1))
        with pytest.raises(ValueError, match=rf"rank {LAST}: hvd.allgather_async: tensors\[0\]: expected at least"):
            hvd.synchronize(handle)
    with pytest.raises(TypeError, match=r"synchronize: handle: expected a handle from an \*_async call, got int"):
        hvd.synchronize(3)


@pytest.mark.mpi(min_size=1)
def test_unsupported_names_raise(hvd, torch):
    for call, pattern in ((lambda: hvd.run(print), "mpiexec"),):
        with pytest.raises(NotImplementedError, match=pattern):
            call()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    for framework in ("keras", "tensorflow", "mxnet"):
        with pytest.raises(ImportError, match=rf"horovod.{framework} has no equivalent here"):
            importlib.import_module(f"mpi_gradreducer.horovod.{framework}")


# -- functions and the optimizer (4 ranks) --------------------------------------------------------------


def _net(torch, seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _backward(torch, net, step: int = 0) -> None:
    g = torch.Generator().manual_seed(100 * step + RANK)
    net(torch.randn(5, 3, generator=g, dtype=torch.float64)).square().mean().backward()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["state_dict", "named_parameters", "list"])
def test_broadcast_parameters(hvd, torch, form):
    net = _net(torch, seed=RANK)
    net.register_buffer("count", torch.full((2,), RANK))
    params = {"state_dict": net.state_dict(), "named_parameters": net.named_parameters(),
              "list": list(net.parameters())}[form]
    hvd.broadcast_parameters(params, root_rank=LAST)
    reference = _net(torch, seed=LAST)
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert net.count.tolist() == ([LAST] * 2 if form == "state_dict" else [RANK] * 2)


@pytest.mark.mpi(min_size=4)
def test_optimizer_state_and_sum(hvd, torch):
    net = _net(torch, seed=0)
    inner = torch.optim.SGD(net.parameters(), lr=0.1 * (RANK + 1), momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters(), op=hvd.Sum)
    hvd.broadcast_optimizer_state(opt, root_rank=LAST)  # no state yet: the hyper-parameters travel
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * SIZE)
    _backward(torch, net)
    local = [p.grad.clone() for p in net.parameters()]
    opt.step()
    for p, g in zip(net.parameters(), local, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), WORLD.allreduce(g.numpy()), rtol=1e-13, atol=1e-15)
    if RANK == LAST:
        opt.param_groups[0]["lr"] = 0.5
        for state in opt.state.values():
            state["momentum_buffer"].fill_(7.0)
    hvd.broadcast_optimizer_state(opt, root_rank=LAST)
    assert opt.param_groups[0]["lr"] == 0.5
    assert all(float(s["momentum_buffer"].max()) == 7.0 for s in opt.state.values())
    opt.free()


@pytest.mark.mpi(min_size=4)
def test_optimizer_fp16_groups_and_passes(hvd, torch):
    net = _net(torch, seed=0).float()
    layers = [list(net[0].parameters())]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), named_parameters=net.named_parameters(),
                                   groups=layers, backward_passes_per_step=2)
    assert opt.reducer.options.ids[1:] == (1, 1, 2, 3)  # the listed layer together, every other parameter alone
    assert opt.backward_passes_per_step == 2
    opt.free()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), named_parameters=net.named_parameters(),
                                   compression=hvd.Compression.fp16, gradient_predivide_factor=2.0)
    opt.set_backward_passes_per_step(2)
    sums = [torch.zeros_like(p) for p in net.parameters()]
    for k in range(2):
        g = torch.Generator().manual_seed(10 * k + RANK)
        net(torch.randn(5, 3, generator=g)).square().mean().backward()
    for s, p in zip(sums, net.parameters(), strict=True):
        s.copy_(p.grad)
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    for s, p in zip(sums, net.parameters(), strict=True):
        np.testing.assert_allclose(p.grad.numpy(), WORLD.allreduce(s.numpy()) / SIZE, rtol=3e-3, atol=3e-4)
    assert_same_on_all_ranks(WORLD, [p.grad.numpy() for p in net.parameters()])
    opt.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("progress", ["deferred", "thread"])
def test_optimizer_misuse_raises_on_every_rank(hvd, torch, progress):
    net = _net(torch, seed=0)
    here = RANK == LAST
    named = list(net.named_parameters())
    cases = [
        (ValueError, rf"rank {LAST}: DistributedOptimizer: named_parameters: expected unique names, got duplicates: "
                     r"0.weight", named[:1] + named if here else named),
        (ValueError, rf"rank {LAST}: DistributedOptimizer: named_parameters: expected every parameter of the "
                     r"optimizer to be named, got 1 unnamed: param_groups\[0\]\['params'\]\[3\] \(2,\)",
         named[:3] if here else named),
        (ValueError, rf"rank {LAST}: DistributedOptimizer: named_parameters: expected a sequence of \(name, "
                     r"parameter\) tuples", [p for _, p in named] if here else named),
    ]
    for exc, pattern, given in cases:
        with pytest.raises(exc, match=pattern):
            hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=given)
    with pytest.raises(NotImplementedError, match=rf"rank {LAST}: DistributedOptimizer: op=Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Adasum if here else hvd.Average)
    with pytest.raises(ValueError, match=r"rank 0: DistributedOptimizer: gradient_predivide_factor=2.0 is not "
                                         r"supported with op != Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match=r"rank 0: DistributedOptimizer: mean: set by Horovod's arguments"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mean=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=named,
                                   progress=progress)
    assert opt.reducer.progress == progress
    before = [p.detach().clone() for p in net.parameters()]
    opt.zero_grad()
    _backward(torch, net)
    pattern = rf"rank {LAST}: optimizer.zero_grad\(\) was called after loss.backward\(\) but before optimizer.step\(\)"
    with pytest.raises(RuntimeError, match=pattern):
        opt.zero_grad() if here else opt.step()
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))  # nothing stepped
    opt.zero_grad()
    _backward(torch, net, 1)
    opt.step()  # usable again
    assert_same_on_all_ranks(WORLD, [p.detach().numpy() for p in net.parameters()])
    opt.free()


# -- the training script against DDP (a whole job) --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.skipif(SIZE > 1, reason="launches its own MPI job: run from a single process")
def test_train_horovod_matches_ddp():
    """The Horovod-style script at 4 ranks, float64, 20 steps: plain, 2 passes per step, predivide 2."""
    proc = run_job(SCRIPT, "--compare-ddp", "--steps", "20", "--epochs", "3", limit=JOB_LIMIT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = {m[0]: (float(m[1]), float(m[2]), float(m[3])) for m in
             re.findall(r"case=(\w+) max_difference=(\S+) accuracy=(\S+) ddp_accuracy=(\S+)", proc.stdout)}
    assert set(cases) == {"plain", "passes2", "predivide2"}, proc.stdout
    for name, (difference, accuracy, ddp_accuracy) in cases.items():
        assert difference <= 1e-9, (name, proc.stdout)
        assert accuracy >= ddp_accuracy - 0.01 and accuracy > 0.5, (name, proc.stdout)


# -- the migration table ------------------------------------------------------------------------------------

#: Every name ``horovod.torch`` 0.28 exports (its ``__init__.py``).
HOROVOD_TORCH_0_28 = (
    "elastic Compression allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters "
    "allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async "
    "grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async grouped_allgather "
    "grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async "
    "reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async join barrier poll "
    "synchronize init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank "
    "local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built "
    "ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum "
    "Adasum Min Max Product HorovodInternalError DistributedOptimizer SyncBatchNorm").split()


def _table() -> dict[str, str]:
    """The migration table of docs/horovod.rst: name -> status."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return {m[0]: m[1] for m in re.findall(r"^\s*\*\s+-\s+``(?:hvd\.)?(\w+)``\s*\n\s+-\s+(\w[\w ]*?)\s*$", text,
                                            flags=re.M)}


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_migration_table_lists_every_name():
    import mpi_gradreducer.horovod as module

    table = _table()
    assert set(HOROVOD_TORCH_0_28) <= set(module.__all__), set(HOROVOD_TORCH_0_28) - set(module.__all__)
    assert set(table) == set(module.__all__), (set(table) ^ set(module.__all__))
    unsupported = {name for name, status in table.items() if status == "not supported"}
    assert unsupported == set(module.UNSUPPORTED) - {"Adasum"}, unsupported ^ set(module.UNSUPPORTED)
    assert table["Adasum"] == "supported with a difference"
    assert set(table.values()) <= {"supported", "supported with a difference", "not supported"}
    assert all(hasattr(module, name) for name in module.__all__)

