"""``scripts/train_torch.py`` under ``mpiexec -n 4``: it learns, and it agrees with DDP.

Each case launches a whole MPI job with a hard time limit. torch and
scikit-learn are optional: without them the tests skip (they run in one
process, so a skip needs no agreement between ranks).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from conftest import run_job

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
SCRIPT = os.path.join(ROOT, "scripts", "train_torch.py")
TIMEOUT = 300

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
    pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn"),
]


def _run(*args: str) -> dict[str, str]:
    """Run the script on 4 ranks; returns the last value of every ``key=value`` in its output."""
    job = run_job(SCRIPT, *args, limit=TIMEOUT)  # without PYTHONUNBUFFERED: the script flushes its own lines
    assert job.returncode == 0, str(job)
    return dict(re.findall(r"(\w+)=(\S+)", job.stdout))


def test_torch_training_matches_ddp():
    """The worked example, with the reduction on a communication thread (``tests/jobs/torch_ddp.py`` holds
    the optimizer against DDP in the other modes)."""
    out = _run("--epochs", "3", "--check-ddp", "--overlap")
    assert out["ranks"] == "4" and out["overlap"] == "True"
    assert float(out["max_difference_vs_ddp"]) <= 1e-9
    assert float(out["test_accuracy"]) > 0.9
    assert float(out["loss"]) < 0.3
