"""What each runnable example of the documentation prints or claims, checked on every rank after it ran.

``tests/jobs/doc_examples.py`` runs every example of README.rst and docs/
(those ``tests/docexamples.py`` finds, fragments aside) in one MPI job, and
after each one the check that :func:`claim_of` finds for it: with the
example's namespace, what it printed on this rank, and the reducer calls it
made (:class:`Spy`). A check raises ``AssertionError`` saying what does not
hold. It runs on every rank, and makes its collective calls before any
assertion, so that a failure on one rank never leaves the others waiting.
Every runnable example must have exactly one check
(``tests/test_doc_examples.py``): an example added later gets one too.

Before each example the job seeds numpy's and torch's global generators
differently on every rank (the ranks of a real job hold different data), so
that an example whose ranks agree only because they computed the same thing
on the same data cannot pass.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD


@dataclass
class Call:
    """One ``reducer(grads)`` of an example: copies of its dense numpy inputs, and its results."""

    inputs: list[np.ndarray]
    grads: list[Any]
    results: Any


class Spy:
    """Records every ``DistributedGradReducer.__call__`` whose gradients are all dense numpy arrays."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    @contextmanager
    def watching(self) -> Iterator[Spy]:
        from mpi_gradreducer import DistributedGradReducer

        original = DistributedGradReducer.__call__
        spy = self

        def call(reducer: Any, grads: Any, *args: Any, **kwargs: Any) -> Any:
            dense = all(isinstance(g, np.ndarray) for g in grads)
            inputs = [np.array(g, copy=True) for g in grads] if dense else []
            results = original(reducer, grads, *args, **kwargs)
            if dense:
                spy.calls.append(Call(inputs, list(grads), results))
            return results

        DistributedGradReducer.__call__ = call  # type: ignore[method-assign]
        try:
            yield self
        finally:
            DistributedGradReducer.__call__ = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class Claim:
    """The check of the example of ``path`` whose code holds ``marker``, and what it checks."""

    path: str
    marker: str
    what: str
    check: Callable[[dict[str, Any], str, Spy], None]


def _gathered(value: Any) -> list[Any]:
    return COMM.allgather(value)


def _same_everywhere(arrays: list[Any], what: str) -> None:
    """Every rank holds these arrays bit for bit (collective)."""
    mine = b"".join(np.ascontiguousarray(np.asarray(a)).tobytes() for a in arrays)
    every = _gathered(mine)
    differ = [r for r, b in enumerate(every) if b != every[0]]
    assert not differ, f"{what} differ between rank 0 and ranks {differ}"


def _inputs(spy: Spy) -> list[list[list[np.ndarray]]]:
    """Every rank's inputs of each recorded call (collective)."""
    return [_gathered(c.inputs) for c in spy.calls]


def _averaged(spy: Spy, inputs: list[list[list[np.ndarray]]], calls: int) -> None:
    """Each recorded call left in the caller's arrays the mean of every rank's ``inputs`` (local), to the
    rounding of a sum in the arrays' dtype: ``eps x sum |x|`` at most."""
    assert len(spy.calls) == calls, f"{len(spy.calls)} reducer calls, {calls} expected"
    for n, (c, every) in enumerate(zip(spy.calls, inputs, strict=True)):
        assert c.results is c.grads or list(c.results) == c.grads, f"call {n}: results not in the caller's list"
        for i, g in enumerate(c.grads):
            x = np.array([e[i] for e in every], dtype=np.float64)
            error = np.abs(g - x.mean(axis=0))
            bound = 2 * np.finfo(g.dtype).eps * np.abs(x).sum(axis=0)
            assert np.all(error <= bound), f"call {n}, grads[{i}]: not the mean of the ranks' inputs " \
                f"(off by up to {error.max():.3g})"


def check_numpy_loop(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """The first loop: every call averaged across ranks in the caller's arrays; the same parameters
    everywhere (every rank starts from rank 0's weights and takes the same steps)."""
    _same_everywhere(ns["params"], "the parameters")
    _averaged(spy, _inputs(spy), 3)


def check_torch_optimizer(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """Rank 0's parameters and optimizer state everywhere, then the same averaged steps: the same
    parameters and momentum buffers on every rank, though each rank drew its own model and data."""
    model, opt = ns["model"], ns["opt"]
    _same_everywhere([p.detach().numpy() for p in model.parameters()], "the model's parameters")
    buffers = [opt.state[p]["momentum_buffer"].numpy() for p in model.parameters()]
    _same_everywhere(buffers, "the momentum buffers")


def check_overlap(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """``begin``/``ready``/``wait``, then ``reduce_async``: the mean of every rank's 1.0 in place."""
    _same_everywhere(ns["grads"], "the gradients")
    for i, g in enumerate(ns["grads"]):
        assert g.dtype == np.float32 and np.all(g == 1.0), f"grads[{i}] is not the mean, 1.0"


def check_row_sparse(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """A new RowSparse of every rank's rows, values / degree; the table updated at rows 3 and 17 only."""
    size = COMM.Get_size()
    table, grads = ns["table"], ns["grads"]
    _same_everywhere([table], "the tables")
    sparse = grads[0]
    assert type(sparse).__name__ == "RowSparse" and list(sparse.indices) == [3, 17, 3] * size, sparse.indices
    assert np.all(sparse.values == np.float32(1.0 / size)), "values / degree expected"
    expected = np.zeros_like(table)
    expected[3] = -np.float32(0.1) * np.float32(2.0)
    expected[17] = -np.float32(0.1) * np.float32(1.0)
    np.testing.assert_allclose(table, expected, rtol=1e-6, atol=0)
    assert not ns["reducer"].nonfinite


def _powersgd_continues_with_the_same_bits(ns: dict[str, Any]) -> None:
    """After a pause (``state_dict``, ``load_state_dict``), later calls give the bits of the same calls
    without it: on the example's own configuration, through its warm-up calls and the compressed ones,
    pausing the same reducer and restarting from the state in a new one (random float data)."""
    from mpi_gradreducer import DistributedGradReducer

    params, options = ns["params"], ns["reducer"].options
    steady, paused = (DistributedGradReducer(params, options=options) for _ in range(2))
    rng = np.random.default_rng([7, COMM.Get_rank()])
    data = [[rng.standard_normal(p.shape).astype(p.dtype) for p in params] for _ in range(15)]
    results: dict[str, list[np.ndarray]] = {"steady": [], "paused": [], "restarted": []}
    restarted = None
    for k, grads in enumerate(data):
        if k == 12:  # compressed calls have begun: Q, errors and the iteration matter
            state = pickle.loads(pickle.dumps(paused.state_dict()))
            paused.load_state_dict(state)
            restarted = DistributedGradReducer(params, options=options)
            restarted.load_state_dict(state)
        for name, r in (("steady", steady), ("paused", paused), ("restarted", restarted)):
            if r is not None:
                g = [a.copy() for a in grads]
                r(g)
                results[name] += g
    for r in (steady, paused, restarted):
        assert r is not None
        r.free()
    for name in ("paused", "restarted"):
        for k, (a, b) in enumerate(zip(results["steady"][-6:], results[name][-6:], strict=True)):
            assert a.tobytes() == b.tobytes(), f"{name}: array {k} of the calls after the pause differs in its bits"


def check_powersgd_readme(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """The first call (before ``start_iter``) averages in place: every rank drew the same gradients, so the
    mean is their values; the pause keeps the bits."""
    inputs = _inputs(spy)
    _powersgd_continues_with_the_same_bits(ns)  # collective: before any assertion of this rank's own
    _averaged(spy, inputs, 1)


def check_powersgd_page(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """The mean of ones, in place; the pause keeps the bits."""
    _powersgd_continues_with_the_same_bits(ns)
    assert all(np.all(g == 1.0) for g in ns["grads"]), "the mean of ones is not 1.0"


def check_join(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """Rank r has 2 + r batches; call k's contributors are the ranks with k batches or more: what each
    rank prints, one line a call, and the same count on every rank of a call."""
    size, rank = COMM.Get_size(), COMM.Get_rank()
    expected = [str(sum(2 + r >= k for r in range(size))) for k in range(1, 3 + rank)]
    printed = out.split()
    every = _gathered(printed)
    assert printed == expected, f"rank {rank} printed {printed}, expected {expected}"
    for k in range(max(map(len, every))):  # one count per call, whichever rank printed it
        assert len({p[k] for p in every if len(p) > k}) == 1, f"call {k + 1}: the ranks printed {every}"
    assert np.all(ns["grads"][0] == 1.0), "the mean over the contributors of ones is not 1.0"


def check_sharding(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """Every element belongs to exactly one rank's pieces; every rank's updated pieces reach every rank's
    parameters: 1 - 0.1 x the mean of ones everywhere."""
    params = ns["params"]
    pieces = _gathered([(p.index, p.start, p.stop) for p in ns["shard"]])
    _same_everywhere(params, "the parameters")
    for i, p in enumerate(params):
        spans = sorted((start, stop) for mine in pieces for index, start, stop in mine if index == i)
        covered = 0
        for start, stop in spans:
            assert start == covered and stop > start, f"parameter {i}: pieces {spans} overlap or leave a gap"
            covered = stop
        assert covered == p.size, f"parameter {i}: pieces {spans} do not cover its {p.size} elements"
        assert np.all(p == np.float32(1) - np.float32(0.1)), f"parameter {i} is not 1 - 0.1 x 1.0 everywhere"


def check_compression(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """In place, each gradient in its own dtype; 0.5 exact (the example asserts the values)."""
    grads = ns["grads"]
    _same_everywhere(grads, "the gradients")
    assert [g.dtype for g in grads] == [np.float32, np.float64], [g.dtype for g in grads]


def check_first_loop(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """The getting-started loop: every call averaged; every parameter (not only the first element the
    example compares) the same on every rank."""
    check_numpy_loop(ns, out, spy)


def check_horovod_import(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """The module stands where ``horovod.torch`` did, with the names a training script calls."""
    hvd = ns["hvd"]
    missing = [n for n in ("init", "size", "rank", "local_rank", "DistributedOptimizer", "broadcast_parameters",
                           "broadcast_optimizer_state", "allreduce", "shutdown") if not callable(getattr(hvd, n, None))]
    assert hvd.__name__ == "mpi_gradreducer.horovod" and not missing, missing


def check_numpy_row_sparse(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """Every rank's rows reach the table (7 twice a rank, 42 once); the dense gradients averaged in place."""
    lr, table = ns["lr"], ns["table"]
    _same_everywhere([table, ns["w"], ns["b"]], "the parameters")
    expected = np.zeros_like(table)
    expected[7] = -np.float32(lr) * np.float32(2.0)
    expected[42] = -np.float32(lr) * np.float32(1.0)
    np.testing.assert_allclose(table, expected, rtol=1e-6, atol=0)
    assert np.all(ns["w"] == -np.float32(lr)) and np.all(ns["b"] == 0), "w -= lr * mean(1.0); b untouched"
    assert np.all(ns["g_w"] == 1.0) and np.all(ns["g_b"] == 1.0), "the dense gradients are the mean, 1.0"


def check_clip(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """After ``synchronize`` every ``.grad`` holds the average and the clipping is the same on every rank:
    the same gradients everywhere (each rank drew its own model and data), their norm at most 1."""
    model = ns["model"]
    grads = [p.grad.numpy() for p in model.parameters()]
    _same_everywhere(grads, "the clipped gradients")
    norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)))
    assert norm <= 1.0 + 1e-6, f"the gradients' norm is {norm} after clip_grad_norm_(max_norm=1.0)"


def check_hook(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """A bucket hook summing in float64: the mean, in place, rounded once into the float32 gradients (0.1
    exactly, on every rank)."""
    inputs = _inputs(spy)
    _same_everywhere(ns["grads"], "the gradients")
    _averaged(spy, inputs, 1)
    assert all(g.dtype == np.float32 and np.all(g == np.float32(0.1)) for g in ns["grads"]), "not 0.1 exactly"


def check_bucket_views(ns: dict[str, Any], out: str, spy: Spy) -> None:
    """``allocate_grads()`` hands out views (into the fusion buffers), and the same views hold every call's
    mean: (size + 1) / 2, the same on every rank."""
    inputs = _inputs(spy)
    grads = ns["grads"]
    _same_everywhere(grads, "the gradients")
    _averaged(spy, inputs, 3)
    assert all(c.grads[i] is g for c in spy.calls for i, g in enumerate(grads)), "not the same arrays every call"
    assert all(not g.flags.owndata for g in grads), "allocate_grads() gave arrays that own their memory"


CLAIMS = (
    Claim("README.rst", "rng = np.random.default_rng()  ", "averaged in place; the same parameters",
          check_numpy_loop),
    Claim("README.rst", "broadcast_optimizer_state(opt)", "the same parameters and optimizer state",
          check_torch_optimizer),
    Claim("README.rst", "handle = reducer.reduce_async(grads)", "averaged in place", check_overlap),
    Claim("README.rst", "RowSparse(token_ids, row_grads, table.shape)", "every rank's rows, values / degree",
          check_row_sparse),
    Claim("README.rst", "compression=PowerSGD(", "in place; the same bits after a pause", check_powersgd_readme),
    Claim("README.rst", "reducer.join()", "the contributors it prints", check_join),
    Claim("README.rst", "shard.allgather(params)", "pieces that cover each parameter once; updated params",
          check_sharding),
    Claim("docs/compression.rst", 'compression="fp16")', "dtypes kept", check_compression),
    Claim("docs/getting-started.rst", "broadcast_parameters(params)", "averaged in place; the same parameters",
          check_first_loop),
    Claim("docs/horovod.rst", "import mpi_gradreducer.horovod as hvd", "Horovod's names", check_horovod_import),
    Claim("docs/numpy.rst", "g_rows = RowSparse(", "rows and dense gradients", check_numpy_row_sparse),
    Claim("docs/numpy.rst", "def float64_sums(bucket):", "the mean through a float64 hook", check_hook),
    Claim("docs/performance.rst", "grads = reducer.allocate_grads()", "views that hold the mean", check_bucket_views),
    Claim("docs/powersgd.rst", "compression=PowerSGD(", "the same bits after a pause", check_powersgd_page),
    Claim("docs/torch.rst", "clip_grad_norm_(opt, max_norm=1.0)", "the same clipped average", check_clip),
)


def claims_of(path: str, code: str) -> list[Claim]:
    """The claims whose marker the example of ``path`` holds (exactly one is expected)."""
    return [c for c in CLAIMS if c.path == path and c.marker in code]
