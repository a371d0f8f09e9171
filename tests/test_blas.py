"""The BLAS thread limit of the products the reducer computes (one process)."""

import os

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from mpi_gradreducer._core.blas import BlasThreads, share_of_cores


def _counts() -> list[int]:
    return [lib["num_threads"] for lib in ThreadpoolController().select(user_api="blas").info()]


def test_numpy_blas_is_seen():
    np.ones((4, 4)) @ np.ones((4, 4))
    assert _counts(), "no BLAS library found: the limit would do nothing"


def test_limited_lowers_and_restores():
    before = _counts()
    with BlasThreads(1).limited():
        assert all(n == 1 for n in _counts())
        a = np.random.default_rng(0).standard_normal((300, 300))
        np.testing.assert_allclose(a @ np.eye(300), a)
    assert _counts() == before


def test_limited_never_raises_a_count():
    before = _counts()
    with BlasThreads(max(before) + 8).limited():
        assert _counts() == before
    with BlasThreads(1).limited(), BlasThreads(max(before) + 8).limited():
        assert all(n == 1 for n in _counts())
    assert _counts() == before


def test_limited_restores_after_an_exception():
    before = _counts()
    with pytest.raises(ValueError, match="inside"), BlasThreads(1).limited():
        raise ValueError("inside")
    assert _counts() == before


@pytest.fixture
def affinity():
    """Sets this thread's cores (``share_of_cores`` reads them) for a test; puts them back after."""
    before = os.sched_getaffinity(0)
    yield lambda cores: os.sched_setaffinity(0, cores)
    os.sched_setaffinity(0, before)


def test_a_rank_bound_to_one_core_gets_that_core(affinity):
    """A launcher's binding is the rank's share, however many ranks share the host (1 rank included)."""
    affinity({min(os.sched_getaffinity(0))})
    assert [share_of_cores(n) for n in (1, 2, 3, 64)] == [1, 1, 1, 1]


def test_a_rank_bound_to_some_cores_gets_those(affinity):
    machine, allowed = os.cpu_count() or 1, sorted(os.sched_getaffinity(0))
    if machine < 3 or len(allowed) < 2:
        pytest.skip(f"needs a binding to 2 of 3 or more cores ({len(allowed)} of {machine} here)")
    affinity(set(allowed[:2]))
    assert [share_of_cores(n) for n in (1, 2, 3, 64)] == [2, 2, 2, 2]


def test_an_unbound_rank_gets_the_cores_divided_by_the_ranks_on_its_host(affinity):
    cores = os.cpu_count() or 1
    try:
        affinity(set(range(cores)))
    except OSError:
        pytest.skip("this process may not run on every core of the machine (a cpuset)")
    assert share_of_cores(1) == share_of_cores(0) == cores
    assert share_of_cores(cores) == 1 and share_of_cores(10 * cores) == 1
    if cores >= 2:
        assert share_of_cores(2) == cores // 2
