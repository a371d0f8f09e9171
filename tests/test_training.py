"""The digits demo: data-parallel training equals single-process training, and it learns.

The demo is ``scripts/train_digits.py`` (its data and model in
``scripts/digits_model.py``); the checks that compare it with one process
are ``scripts/check_training.py``. They are imported here from ``scripts/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
from contextlib import redirect_stdout

import numpy as np
import pytest
from mpi4py import MPI

from conftest import run_job

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
SCRIPTS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
CHECK_SCRIPT = os.path.join(SCRIPTS, "check_training.py")

if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)  # the scripts import one another, as when run from there
td = importlib.import_module("train_digits")
ct = importlib.import_module("check_training")

#: The same answer on every rank (one environment), so skips agree.
HAVE_SKLEARN = importlib.util.find_spec("sklearn") is not None

needs_sklearn = pytest.mark.skipif(not HAVE_SKLEARN, reason="needs scikit-learn (the examples extra)")


def _synthetic(seed: int = 0, n: int = 600) -> td.Data:
    """Digits-shaped random data (64 features, 10 classes), for runs without scikit-learn."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((10, 64))
    y = rng.integers(0, 10, n)
    x = centers[y] + 0.8 * rng.standard_normal((n, 64))
    return td.Data(x[: n * 3 // 4], y[: n * 3 // 4], x[n * 3 // 4 :], y[n * 3 // 4 :])


@pytest.fixture(scope="module")
def digits() -> td.Data:
    """The demo's split, loaded once per module."""
    if not HAVE_SKLEARN:
        pytest.skip("needs scikit-learn (the examples extra)")
    return td.load_data(0)


def _groups_of(n: int) -> MPI.Intracomm:
    """WORLD cut into consecutive groups of ``n`` ranks; this rank's group."""
    return WORLD.Split(WORLD.Get_rank() // n, WORLD.Get_rank())


@pytest.mark.parametrize("kind", ["synthetic", pytest.param("digits", marks=needs_sklearn)])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_data_parallel_equals_single_process(ranks: int, kind: str, request: pytest.FixtureRequest) -> None:
    if WORLD.Get_size() % ranks:
        pytest.skip(f"{ranks} ranks per group do not divide {WORLD.Get_size()}")
    data = request.getfixturevalue("digits") if kind == "digits" else _synthetic()
    comm = _groups_of(ranks)
    try:
        assert comm.Get_size() == ranks
        diff = ct.check_equivalence(comm, data, steps=25, batch_size=60)
    finally:
        comm.Free()
    assert diff <= ct.EQUIVALENCE_TOLERANCE


@pytest.mark.parametrize("batch_size", [7, 61])
def test_uneven_shares_still_equal_single_process(batch_size: int) -> None:
    """Global batches that the ranks cannot share evenly (a rank may even get nothing)."""
    diff = ct.check_equivalence(WORLD, _synthetic(1), steps=12, batch_size=batch_size, seed=3)
    assert diff <= ct.EQUIVALENCE_TOLERANCE


@pytest.mark.mpi(min_size=2)
def test_the_tolerance_catches_a_wrong_split() -> None:
    """Negative control: ranks that all train on the first share do not match the whole batch."""
    data = _synthetic(2)
    x = data.x_train.astype(np.float64)
    params = td.init_params(64, 128, 10, 0, np.float64)
    start = [p.copy() for p in params]
    alone = ct.Alone([p.copy() for p in params], 0.05, 0.9)
    wrong = td.Trainer(WORLD, params, 0.05, 0.9)
    for batch in td.global_batches(len(x), 64, 0, 0)[:5]:
        first = td.my_share(batch, 0, WORLD.Get_size())
        wrong.step(x[first], data.y_train[first], len(batch))
        alone.step(x[batch], data.y_train[batch], len(batch))
    wrong.free()
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(alone.params, start, strict=True))
    off = max(float(np.max(np.abs(a - b))) for a, b in zip(wrong.params, alone.params, strict=True))
    assert moved > 1e-2
    assert off > 1e3 * ct.EQUIVALENCE_TOLERANCE


def test_loss_travels_with_the_gradients() -> None:
    """The reported loss is the global batch's mean loss, on every rank."""
    data = _synthetic(4)
    x = data.x_train.astype(np.float64)
    params = td.init_params(64, 128, 10, 0, np.float64)
    td.broadcast_parameters(params)
    batch = td.global_batches(len(x), 40, 0, 0)[0]
    mine = td.my_share(batch, WORLD.Get_rank(), WORLD.Get_size())
    expected = td.forward_backward(params, x[batch], data.y_train[batch], 1 / len(batch),
                                   [np.empty_like(p) for p in params])
    trainer = td.Trainer(WORLD, params, 0.0, 0.0)
    loss = trainer.step(x[mine], data.y_train[mine], len(batch))
    trainer.free()
    assert loss == pytest.approx(expected, rel=1e-12)


def test_training_on_digits_reaches_95_percent(digits: td.Data) -> None:
    data = digits
    result = td.train(WORLD, data, td.Settings(epochs=10))
    assert result.steps == 10 * (len(data.x_train) // 64)
    assert len(result.losses) == result.steps and len(result.accuracies) == 10
    assert result.losses[-1] < result.losses[0] / 5
    assert result.accuracies[-1] >= 0.95
    assert result.compute_seconds > 0 and result.reduce_seconds > 0
    # Every rank ends with the same accuracy: the same weights.
    acc = np.array([result.accuracies[-1]])
    low, high = acc.copy(), acc.copy()
    WORLD.Allreduce(MPI.IN_PLACE, low, op=MPI.MIN)
    WORLD.Allreduce(MPI.IN_PLACE, high, op=MPI.MAX)
    assert low[0] == high[0]


@pytest.mark.mpi(min_size=4)
def test_training_with_powersgd_rank_1_reaches_95_percent(digits: td.Data) -> None:
    """``--powersgd 1``: PowerSGD(rank=1, start_iter=10) in the demo's epochs, on 4 ranks (skipped on fewer)."""
    result = td.train(WORLD, digits, td.Settings(epochs=10, powersgd=1))
    assert result.accuracies[-1] >= 0.95
    n_in, hidden, n_out = digits.x_train.shape[1], td.Settings.hidden, 10
    # each weight matrix sends P and Q (rank 1); the biases and the loss go as they are; float32
    assert result.last_step_bytes == 4 * ((n_in + hidden) + (hidden + n_out) + hidden + n_out + 1)


@needs_sklearn
@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the examples extra)")
def test_command_line_prints_accuracy_and_writes_plot_and_timeline() -> None:
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="digits-") if WORLD.Get_rank() == 0 else None)
    png, trace = os.path.join(directory, "curves.png"), os.path.join(directory, "trace.json")
    out = io.StringIO()
    with redirect_stdout(out):
        status = td.main(["--epochs", "1", "--no-progress", "--plot", png, "--timeline", trace])
    with redirect_stdout(io.StringIO()):
        check = ct.main(["--equivalence", "--steps", "5"])
    text = out.getvalue()
    verdict = None
    if WORLD.Get_rank() == 0:
        with open(trace) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        verdict = (
            "test accuracy:" in text and "time per step:" in text,
            os.path.getsize(png) > 10_000,
            {e["name"] for e in events} == {"forward/backward", "reduce", "update"},
            {e["pid"] for e in events} == set(range(WORLD.Get_size())),
        )
        shutil.rmtree(directory, ignore_errors=True)
    else:
        assert text == ""
    assert status == 0 and check == 0
    assert WORLD.bcast(verdict) == (True, True, True, True)


def test_overlapped_steps_give_bitwise_the_same_parameters() -> None:
    data = _synthetic(3)
    results = []
    for overlap in (False, True):
        params = td.init_params(data.x_train.shape[1], 32, 10, 7, np.float64)
        trainer = td.Trainer(WORLD, params, 0.05, 0.9, overlap=overlap)
        try:
            for batch in td.global_batches(len(data.x_train), 48, 0, 0)[:6]:
                mine = td.my_share(batch, WORLD.Get_rank(), WORLD.Get_size())
                trainer.step(data.x_train[mine], data.y_train[mine], len(batch))
        finally:
            trainer.free()
        results.append([p.copy() for p in params])
    for a, b in zip(*results, strict=True):
        assert a.tobytes() == b.tobytes()


def test_sharded_optimizer_and_uneven_shares_equal_their_references() -> None:
    data = _synthetic(4)
    diff, state, full = ct.check_shard(WORLD, data, steps=6, batch_size=48)
    assert diff <= ct.EQUIVALENCE_TOLERANCE
    assert state <= full / WORLD.Get_size() * 1.05 + 8 * 64  # momentum for this rank's pieces only
    diff, contributors = ct.check_uneven(WORLD, data, steps=5, batch_size=48)
    assert diff <= ct.EQUIVALENCE_TOLERANCE
    counts = ct.uneven_counts(WORLD.Get_size(), 5)
    assert contributors == [sum(n > c for n in counts) for c in range(max(counts))]


@needs_sklearn
def test_command_line_shard_and_uneven_under_mpiexec() -> None:
    import re

    job = run_job(CHECK_SCRIPT, "--shard", "--uneven", "--steps", "8", limit=120)  # 4 ranks, from one process
    out = job.stdout
    assert job.returncode == 0, str(job)
    shard = re.search(r"^shard: optimizer state per rank (\d+) bytes \(max over ranks\) vs (\d+) unsharded = "
                      r"1/([\d.]+) \(4 ranks\); max \|difference\| sharded vs unsharded = (\S+) \(ok", out, re.M)
    assert shard, out
    assert 3.8 <= float(shard.group(3)) <= 4.0 and float(shard.group(4)) <= ct.EQUIVALENCE_TOLERANCE
    uneven = re.search(r"^uneven: batches per rank \[8, 7, 6, 5\], contributors per call "
                       r"\[4, 4, 4, 4, 4, 3, 2, 1\]; max \|difference\| vs one process = (\S+) \(ok", out, re.M)
    assert uneven and float(uneven.group(1)) <= ct.EQUIVALENCE_TOLERANCE, out
