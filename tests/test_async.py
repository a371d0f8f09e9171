"""Asynchronous reduction and per-gradient readiness."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import WORLD, assert_same_on_all_ranks, expected_mean, rank_value, run_job
from mpi_gradreducer import DistributedGradReducer

SHAPES = [(40, 30), (30,), (300, 1024), (7,), (), (64, 64), (5, 0), (1000,)]


def _params():
    return [np.zeros(s, np.float32) for s in SHAPES]


def _grads(seed):
    rng = np.random.default_rng(seed + 1000 * WORLD.Get_rank())
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


PROGRESS = ["thread", "deferred"]


@pytest.mark.mpi
@pytest.mark.parametrize("progress", PROGRESS)
def test_async_and_readiness_match_the_blocking_call_bitwise(progress):
    with DistributedGradReducer(_params(), bucket_bytes=4 << 10, progress=progress) as reducer:
        assert reducer.progress == progress
        assert len(reducer.buckets) > 3
        for seed in range(3):
            expected = reducer(_grads(seed))
            handle = reducer.reduce_async(_grads(seed))
            got = handle.wait()
            assert handle.done()
            for e, g in zip(expected, got, strict=True):
                assert e.tobytes() == g.tobytes()
            # Readiness in a different order on every rank.
            grads = _grads(seed)
            step = reducer.begin(grads)
            order = np.random.default_rng(seed + 7 * WORLD.Get_rank()).permutation(len(SHAPES))
            for i in order:
                step.ready(int(i))
            assert step.wait() is grads
            for e, g in zip(expected, grads, strict=True):
                assert e.tobytes() == g.tobytes()
            assert_same_on_all_ranks(WORLD, grads)


@pytest.mark.mpi
@pytest.mark.parametrize("mean", [False, True])
def test_large_sums_are_the_same_bits_call_after_call_and_asynchronously(mean):
    """Large chunks (MPI's own Allreduce of them is not reproducible under every MPI), with random data."""
    shapes = [(300, 1024), (1000,), (2048, 1024)]

    def grads(seed):
        rng = np.random.default_rng(seed + 1000 * WORLD.Get_rank())
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    with DistributedGradReducer([np.zeros(s, np.float32) for s in shapes], mean=mean, progress="thread") as reducer:
        for seed in range(4):
            first = [g.tobytes() for g in reducer(grads(seed))]
            assert [g.tobytes() for g in reducer(grads(seed))] == first, f"seed {seed}: a second blocking call"
            assert [g.tobytes() for g in reducer.reduce_async(grads(seed)).wait()] == first, f"seed {seed}: async"


@pytest.mark.mpi
def test_buckets_launch_before_wait_and_done_polls():
    with DistributedGradReducer(_params(), bucket_bytes=4 << 10, progress="thread") as reducer:
        grads = [np.full(s, rank_value(WORLD, 2.0), np.float32) for s in SHAPES]
        step = reducer.begin(grads)
        for i in range(len(SHAPES)):
            step.ready(i)
        deadline = time.monotonic() + 30
        while not step.done():  # communication completes without wait()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        step.wait()
        for g in grads:
            np.testing.assert_allclose(g, expected_mean(WORLD, 2.0), rtol=1e-6)


@pytest.mark.mpi
def test_readiness_errors():
    with DistributedGradReducer(_params()) as reducer:
        step = reducer.begin(_grads(0))
        step.ready(3)
        with pytest.raises(ValueError, match=r"ready\(3\) was already called"):
            step.ready(3)
        with pytest.raises(IndexError, match=r"ready\(8\): expected a gradient index in \[0, 7\]"):
            step.ready(8)
        with pytest.raises(RuntimeError, match="still in flight"):
            reducer(_grads(0))
        step.mark_all_ready()
        step.wait()
        reducer(_grads(0))  # usable again


@pytest.mark.mpi
@pytest.mark.parametrize("progress", PROGRESS)
def test_wait_before_ready_raises_on_every_rank_without_hanging(progress):
    last = WORLD.Get_size() - 1
    with DistributedGradReducer(_params(), bucket_bytes=4 << 10, progress=progress) as reducer:
        step = reducer.begin(_grads(1))
        for i in range(len(SHAPES)):
            if not (WORLD.Get_rank() == last and i in (2, 5)):
                step.ready(i)
        with pytest.raises(RuntimeError,
                           match=rf"wait\(\) was called before ready\(\) for every gradient on rank {last} \(2\)"):
            step.wait()
        grads = reducer(_grads(2))  # still in step on every rank
        assert_same_on_all_ranks(WORLD, grads)


@pytest.mark.mpi
def test_free_stops_the_communication_thread():
    before = threading.active_count()
    reducer = DistributedGradReducer(_params(), progress="thread")
    reducer.reduce_async(_grads(0)).wait()
    assert threading.active_count() > before
    reducer.free()
    reducer.free()  # idempotent
    assert threading.active_count() <= before


def test_interpreter_exits_cleanly_with_a_live_reducer(tmp_path):
    """No thread or request left behind, no hang at exit, even without free()."""
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\n"
        "from mpi_gradreducer import DistributedGradReducer\n"
        "r = DistributedGradReducer([np.zeros(10), np.zeros((300, 1024))], timeout=30, progress='thread')\n"
        "h = r.reduce_async([np.ones(10), np.ones((300, 1024))])\n"
        "h.wait()\n"
        "s = r.begin([np.ones(10), np.ones((300, 1024))])\n"
        "s.ready(1)\n"
        "print('exiting', flush=True)\n"
    )
    job = run_job(str(script), ranks=2, runner=False)
    assert job.returncode == 0, str(job)
    assert job.stdout.count("exiting") == 2, str(job)


@pytest.mark.mpi
def test_reducer_timeline_is_valid_trace_json(tmp_path):
    import json

    name = str(tmp_path / "trace.json") if WORLD.Get_rank() == 0 else "unused"
    with DistributedGradReducer(_params(), bucket_bytes=4 << 10, timeline=name) as reducer:
        reducer(_grads(0))
        reducer.reduce_async(_grads(1)).wait()
    if WORLD.Get_rank() == 0:
        with open(name) as f:
            trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        spans = [e for e in events if e.get("ph") == "X"]
        assert {e["pid"] for e in spans} == set(range(WORLD.Get_size()))
        assert {e["name"] for e in spans} >= {"allreduce", "pack", "unpack"}
        assert all(e["dur"] >= 0 and "bucket" in e["args"] for e in spans)
        assert {e["args"]["call"] for e in spans} == {1, 2}


@pytest.mark.mpi
def test_auto_progress_is_the_same_on_every_rank_and_bad_modes_are_named():
    with DistributedGradReducer(_params()) as reducer:
        mine = np.array([("thread", "deferred").index(reducer.progress)], dtype=np.int64)
        everyone = np.zeros(WORLD.Get_size(), dtype=np.int64)
        WORLD.Allgather(mine, everyone)
        assert len(set(everyone.tolist())) == 1
    with pytest.raises(ValueError, match=r"progress: expected one of \('auto', 'thread', 'deferred'\), got 'fast'"):
        DistributedGradReducer(_params(), progress="fast")
