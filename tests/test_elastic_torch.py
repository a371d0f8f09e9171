"""Elastic torch training with Horovod's API (``scripts/elastic_digits.py``), a rank SIGKILLed mid-training.

Under Open MPI with ULFM (``tests/elastic_ompi.py``): the survivors' Horovod
context is made again (``hvd.size()`` becomes 3), the ``DistributedOptimizer``
is rebuilt on it, the reset callback rescales the learning rate, and the job
ends with every survivor holding the same parameters and a trained model.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

from elastic_ompi import OmpiJob, kill, wait_for, why_not_here

pytestmark = pytest.mark.slow
REASON = why_not_here()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_horovod_style_script_survives_a_lost_rank(tmp_path: Path) -> None:
    with OmpiJob("scripts/elastic_digits.py", "--epochs", "4", "--batch-size", "32", "--out", str(tmp_path)) as job:
        victim = int(wait_for(lambda: (tmp_path / "pid.1").exists() and (tmp_path / "pid.1").read_text(), 300,
                              "rank 1's pid", job))
        wait_for(lambda: any("epoch 1 " in p.read_text() for p in tmp_path.glob("log.*")), 300, "epoch 1", job)
        time.sleep(0.5)  # mid-epoch
        kill(victim)
        rc = job.wait(600)
        assert rc == 0, job.output[-5000:]
    finals = sorted(tmp_path.glob("final.*.npy"))
    assert len(finals) == 3, job.output[-3000:]
    first = np.load(finals[0])
    for f in finals[1:]:
        assert np.array_equal(np.load(f).view(np.uint32), first.view(np.uint32)), f"{f.name} differs"
    logs = "".join(p.read_text() for p in tmp_path.glob("log.*"))
    assert "reset size 3" in logs and "epoch 3 size 3" in logs, logs[-2000:]
    assert "lost rank 1 of 4" in job.output, job.output[-3000:]
    accuracy = float(re.search(r"accuracy (\S+) ranks 3", job.output).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9, job.output[-2000:]
