"""One default blocking call is a short walk down the parts and back: few frames, few calls, no climb back up.

Measured on the call after warm-up (the gradients are then the last call's,
proven unchanged, as in a training loop), for a small model (the digits
MLP's four float32 gradients, one bucket that travels with the call header)
and for one large gradient (4 MiB, reduced where it lies): at most 8 Python
frames below ``__call__``, at most 80 calls (``cProfile``'s count, C
functions included), and no frame of the front class below a frame of the
internals (nothing calls back up into the reducer).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import WORLD, agree_on_failures
from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core.topology import Topology

pytestmark = pytest.mark.mpi

FRONT = str(Path(sys.modules["mpi_gradreducer.reducer"].__file__ or ""))
CORE = str(Path(FRONT).parent / "_core")
MODELS = {
    "small": [(64, 128), (128,), (128, 10), (10,)],
    "large": [(1024, 1024)],
}


def _walk(reducer: DistributedGradReducer, grads: list[np.ndarray]) -> tuple[int, list[str], list[str]]:
    """The deepest stack below ``__call__`` of one call, and every call of the front class from its internals."""
    stack: list[tuple[str, str]] = []  # (file, "file.py:function")
    deepest: list[tuple[str, str]] = []
    climbs: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            entry = (code.co_filename, f"{Path(code.co_filename).name}:{code.co_name}")
            if code.co_filename == FRONT and any(f.startswith(CORE) for f, _ in stack):
                climbs.append(" -> ".join(w for _, w in [*stack, entry]))
            stack.append(entry)
            if len(stack) > len(deepest):
                deepest[:] = stack
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        reducer(grads)
    finally:
        sys.setprofile(None)
    return len(deepest) - 1, [w for _, w in deepest], climbs  # frames below __call__


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_blocking_call_is_short_and_one_way(model: str):
    if Topology.of(WORLD).hosts > 1:
        pytest.skip("measured on one host")  # the same answer on every rank
    shapes = MODELS[model]
    rng = np.random.default_rng([5, WORLD.Get_rank()])
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    failures: list[str] = []
    with DistributedGradReducer([np.zeros(s, np.float32) for s in shapes], group=WORLD) as reducer:
        for _ in range(3):  # checked, remembered, armed for replay
            reducer(grads)
        depth, deepest, climbs = _walk(reducer, grads)
        profiler = cProfile.Profile()
        profiler.enable()
        reducer(grads)
        profiler.disable()
        calls = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
    if depth > 8:
        failures.append(f"{model}: {depth} frames below __call__: {' -> '.join(deepest)}")
    if calls > 80:
        failures.append(f"{model}: {calls} calls")
    if climbs:
        failures.append(f"{model}: the front class is called from its internals: {climbs[0]}")
    agree_on_failures(failures)
