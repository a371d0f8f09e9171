"""Elastic torch training with Horovod's API (``scripts/elastic_digits.py``), a rank SIGKILLed mid-training.

Under Open MPI with ULFM (``tests/elastic_ompi.py``): the survivors' Horovod
context is made again (``hvd.size()`` becomes 3), the ``DistributedOptimizer``
is rebuilt on it, the reset callback rescales the learning rate, and the job
ends with every survivor holding the same parameters and a trained model.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from elastic_ompi import OmpiJob, kill, wait_for, why_not_here

pytestmark = pytest.mark.slow
REASON = why_not_here()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_horovod_style_script_survives_a_lost_rank(tmp_path: Path) -> None:
    # Enough epochs that training is surely still going when the kill lands (an epoch of digits takes well under a
    # second on a fast machine: with four epochs the job once ended before a half-second pause was over).
    with OmpiJob("scripts/elastic_digits.py", "--epochs", "12", "--batch-size", "32", "--out", str(tmp_path)) as job:
        victim = int(wait_for(lambda: (tmp_path / "pid.1").exists() and (tmp_path / "pid.1").read_text(), 300,
                              "rank 1's pid", job))
        wait_for(lambda: any("epoch 1 " in p.read_text() for p in tmp_path.glob("log.*")), 300, "epoch 1", job)
        kill(victim)  # as soon as epoch 1 begins: mid-epoch
        rc = job.wait(600)
        assert rc == 0, job.output[-5000:]
    finals = sorted(tmp_path.glob("final.*.npy"))
    assert len(finals) == 3, job.output[-3000:]
    first = np.load(finals[0])
    for f in finals[1:]:
        assert np.array_equal(np.load(f).view(np.uint32), first.view(np.uint32)), f"{f.name} differs"
    logs = "".join(p.read_text() for p in tmp_path.glob("log.*"))
    assert "reset size 3" in logs and "epoch 11 size 3" in logs, logs[-2000:]
    assert "lost rank 1 of 4" in job.output, job.output[-3000:]
    accuracy = float(re.search(r"accuracy (\S+) ranks 3", job.output).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9, job.output[-2000:]


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_horovod_s_elastic_example_finishes_at_full_size_with_a_replacement(tmp_path: Path) -> None:
    """Horovod's pytorch_mnist_elastic.py (its samplers fixed at the top by hvd.size() and hvd.rank()), a rank
    SIGKILLed with room for 4: the replacement's hvd.init() already says size 4 (and local rank 3 of 4, where it
    will be on this one host), and all four finish alike."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    with OmpiJob("tests/jobs/horovod_mnist_elastic.py", "--epochs", "6", "--out", str(tmp_path),
                 env={"MPI_GRADREDUCER_ELASTIC_HOSTFILE": str(hosts)}) as job:
        victim = int(wait_for(lambda: (tmp_path / "pid.1").exists() and (tmp_path / "pid.1").read_text(), 300,
                              "rank 1's pid", job))
        wait_for(lambda: any("epoch 2 " in p.read_text() for p in tmp_path.glob("log.*")), 300, "epoch 2", job)
        kill(victim)
        rc = job.wait(600)
        assert rc == 0, job.output[-5000:]
    logs = {p.name.split(".")[1]: p.read_text() for p in tmp_path.glob("log.*")}
    new = [p.name.split(".")[2] for p in tmp_path.glob("pid.new.*")]
    assert len(new) == 1, (new, job.output[-3000:])
    assert logs[new[0]].startswith("init size 4 rank 3 local_rank 3 local_size 4\n"), logs[new[0]][:500]
    assert "epoch 6 size 4" in logs[new[0]], logs[new[0]][-1000:]
    finals = sorted(tmp_path.glob("final.*.npy"))
    assert len(finals) == 4, job.output[-3000:]
    first = np.load(finals[0])
    for f in finals[1:]:
        assert np.array_equal(np.load(f).view(np.uint32), first.view(np.uint32)), f"{f.name} differs"
    accuracy = float(re.search(r"Accuracy: (\S+)% ranks 4", job.output).group(1))  # type: ignore[union-attr]
    assert accuracy > 90, job.output[-2000:]
