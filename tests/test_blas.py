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


def test_share_of_cores():
    cores, machine = len(os.sched_getaffinity(0)), os.cpu_count()
    if cores < machine:  # bound to some cores by the launcher: those are this rank's share
        assert all(share_of_cores(n) == cores for n in (0, 1, cores, 10 * machine))
        return
    assert share_of_cores(1) == share_of_cores(0) == cores
    assert share_of_cores(cores) == 1
    assert share_of_cores(10 * cores) == 1
    assert share_of_cores(2) == max(1, cores // 2)
