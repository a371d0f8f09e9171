"""elastic.GlobalBatch: the same global batch at every number of ranks, and the reducer's mean over it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer.elastic import GlobalBatch


@pytest.mark.parametrize("size, micro", [(256, 32), (97, 8), (5, 64), (1, 1), (64, 1)])
def test_every_sample_once_in_micro_batches_that_fit(size, micro):
    batch = GlobalBatch(size, micro)
    for ranks in range(1, 11):
        shares = [batch.share(r, ranks) for r in range(ranks)]
        steps = batch.accumulation(ranks)
        assert all(len(s) == steps for s in shares), "every rank makes the same number of calls"
        samples = sorted(i for s in shares for part in s for i in part)
        assert samples == list(range(size)), f"{ranks} ranks: each sample exactly once"
        assert all(len(part) <= micro for s in shares for part in s)
        counts = [sum(len(p) for p in s) for s in shares]
        assert max(counts) - min(counts) <= 1, "shares differ by one sample at most"
        assert steps == max(1, math.ceil(max(counts) / micro)), "no more micro-batches than the largest share needs"


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_bad_sizes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"size: expected an int >= 1"):
        GlobalBatch(bad, 4)
    with pytest.raises(ValueError, match=r"micro: expected an int >= 1"):
        GlobalBatch(4, bad)


def test_bad_ranks_are_refused_by_name():
    batch = GlobalBatch(8, 2)
    with pytest.raises(ValueError, match=r"ranks: expected an int >= 1, got 0"):
        batch.share(0, 0)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 3\), got 3"):
        batch.share(3, 3)


@pytest.mark.mpi
def test_the_reducer_gives_the_mean_over_the_global_batch_whatever_the_ranks():
    """Per-sample gradients of random floats; each rank sums its share's micro-batches; degree=the batch: the
    world and each half of it (a shrink) get the mean over the same 96 samples."""
    batch = GlobalBatch(96, 7)
    rng = np.random.default_rng(11)
    per_sample = rng.standard_normal((batch.size, 5, 3))
    expected = per_sample.mean(axis=0)
    half = WORLD.Split(WORLD.Get_rank() % 2, key=WORLD.Get_rank())
    for comm in (WORLD, half):
        grads = [np.zeros((5, 3))]
        with DistributedGradReducer([np.zeros((5, 3))], group=comm, degree=batch.size) as reducer:
            for part in batch.share(comm.Get_rank(), comm.Get_size()):
                grads[0] += per_sample[list(part)].sum(axis=0)
            reducer(grads)
        np.testing.assert_allclose(grads[0], expected, rtol=1e-12, atol=1e-15)
    half.Free()
    assert MPI.Is_initialized()
