"""Horovod's ``ElasticSampler`` resumed mid-epoch on fewer ranks: every sample of the epoch once."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import WORLD

pytestmark = pytest.mark.mpi

SAMPLES, BATCH = 103, 4  # a length that no rank count divides evenly


def _committed_run(hvd, shuffle: bool, batches: int) -> tuple[list[int], dict[str, int]]:
    """On every rank: ``batches`` batches committed, then one more taken and lost (as a rank's loss loses it)."""
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=shuffle, seed=5)
    sampler.set_epoch(3)
    it = iter(sampler)
    seen: list[int] = []
    for b in range(batches):
        seen += [next(it) for _ in range(BATCH)]
        sampler.record_batch(b, BATCH)
    committed = sampler.state_dict()
    next(it)  # past the commit: rolled back with the state
    return seen, committed


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("batches", [0, 1, 5])
def test_resumed_on_fewer_ranks_every_sample_of_the_epoch_is_seen_once(torch, shuffle, batches):
    import mpi_gradreducer.horovod as hvd

    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    hvd.init()
    try:
        seen, committed = _committed_run(hvd, shuffle, batches)
    finally:
        hvd.shutdown()
    assert WORLD.allgather(committed) == [committed] * size
    assert committed == {"epoch": 3, "processed_num": batches * BATCH * size}

    survivors = list(range(max(1, size - 1)))
    rest: list[int] = []
    try:
        hvd.init(survivors)  # every rank calls it; those left out get a ValueError
    except ValueError:
        assert rank not in survivors
    else:
        try:
            resumed = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=shuffle, seed=5)
            resumed.load_state_dict(committed)
            assert (resumed.num_replicas, resumed.rank) == (len(survivors), rank)
            rest = list(resumed)
            assert len(rest) == len(resumed)
        finally:
            hvd.shutdown()

    before = [i for part in WORLD.allgather(seen) for i in part]
    after = [i for part in WORLD.allgather(rest) for i in part]
    assert len(set(before)) == len(before), "a sample seen twice before the loss"
    counts = Counter(before + after)
    assert sorted(counts) == list(range(SAMPLES)), "a sample skipped"
    left = SAMPLES - len(before)
    padding = -left % len(survivors)  # the last share made even, as Horovod's sampler does
    assert sum(c - 1 for c in counts.values()) == padding, counts.most_common(3)
