"""bucket_bytes="auto": a few caps are timed, one is kept, the same on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import WORLD, expected_mean, rank_value
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core.tuning import BucketTuner

pytestmark = pytest.mark.mpi


def test_auto_picks_one_cap_agreed_by_every_rank_and_results_stay_right():
    shapes = [(1000,)] * 200 + [(300, 1024)]  # ~1.9 MiB of small tensors: several distinct plans
    params = [np.zeros(s, np.float32) for s in shapes]
    with DistributedGradReducer(params, bucket_bytes="auto") as reducer:
        tuner = reducer._tuner
        assert tuner is not None and len(tuner.candidates) >= 2
        calls = 0
        while reducer._tuner is not None:
            grads = [np.full(s, rank_value(WORLD, calls), np.float32) for s in shapes]
            reducer(grads)
            for g in grads:
                np.testing.assert_allclose(g, expected_mean(WORLD, calls), rtol=1e-6)
            calls += 1
            assert calls <= 2 * len(tuner.candidates)
        assert calls == 2 * len(tuner.candidates)
        chosen = np.array([reducer._bucket_bytes], dtype=np.int64)
        everyone = np.zeros(WORLD.Get_size(), dtype=np.int64)
        WORLD.Allgather(chosen, everyone)
        assert len(set(everyone.tolist())) == 1 and int(chosen[0]) in tuner.candidates
        grads = [np.full(s, rank_value(WORLD, 9.0), np.float32) for s in shapes]
        reducer(grads)
        np.testing.assert_allclose(grads[0], expected_mean(WORLD, 9.0), rtol=1e-6)


def test_tuner_takes_the_slowest_rank_into_account():
    tuner = BucketTuner([10, 20], rounds=1)
    assert tuner.current() == 10
    # Rank 0 finds 10 faster, every other rank finds 20 much faster.
    tuner.record(1.0 if WORLD.Get_rank() == 0 else 5.0)
    tuner.record(2.0 if WORLD.Get_rank() == 0 else 1.0)
    assert tuner.finished
    assert tuner.decide(WORLD) == (10 if WORLD.Get_size() == 1 else 20)
