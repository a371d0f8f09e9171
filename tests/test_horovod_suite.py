"""``scripts/horovod_suite.py``, the runner of Horovod's own torch suite, on a small suite of ours.

Horovod's files are not part of this repository, so these tests write a
tree of the same layout (``test/parallel/test_torch.py`` and
``test/utils/common.py``, with the lines the three changes expect) whose
tests pass, skip, fail on one rank while the other waits in a collective,
and hang; the runner must report each as such, end each job (the whole
process tree) and exit 1. Single-process tests: the runner launches its
own MPI jobs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HAS_TORCH, WORLD

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "horovod_suite.py"

TESTS = '''\
import os
import sys
import time
import unittest

import torch

import horovod.torch as hvd

sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))

from common import delay


def optimizers():
    return sorted(subclass.__name__ for subclass in torch.optim.Optimizer.__subclasses__()
                  if subclass.__module__.startswith('torch.optim') and
                  subclass != torch.optim.SparseAdam
                  )


class TorchTests(unittest.TestCase):

    def test_pass(self):
        hvd.init()
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
        done = []
        delay(lambda: done.append(1), 0.01).join()
        assert done == [1]

    def test_optimizers_without_muon(self):
        names = [subclass.__name__ for subclass in torch.optim.Optimizer.__subclasses__()
                 if subclass != torch.optim.SparseAdam
                 ]
        assert "SGD" in names and "Muon" not in names and "Muon" not in optimizers()
        assert all(n != "SparseAdam" for n in [subclass.__name__ for subclass in torch.optim.Optimizer.__subclasses__()
                                               if subclass != torch.optim.SparseAdam
                                               ])

    def test_skip(self):
        self.skipTest("No GPUs available")

    def test_fail_on_one_rank(self):
        hvd.init()
        assert hvd.rank() != 1, "rank 1 fails"
        hvd.barrier()  # the other rank waits here for rank 1, which never comes

    def test_hang(self):
        time.sleep(1000)
'''

COMMON = '''\
import time

from horovod.runner.util.threads import in_thread


def delay(func, seconds):
    def fn():
        time.sleep(seconds)
        func()

    return in_thread(target=fn)
'''


def _tree(root: Path, tests: str = TESTS, common: str = COMMON) -> Path:
    (root / "test" / "parallel").mkdir(parents=True)
    (root / "test" / "utils").mkdir(parents=True)
    (root / "test" / "parallel" / "test_torch.py").write_text(tests)
    (root / "test" / "utils" / "common.py").write_text(common)
    return root


def _run(*args: str, limit: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_GRADREDUCER_"))}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("HOROVOD_SOURCE", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=limit,
                          env=env, cwd=ROOT)


def _processes_running(word: str) -> list[str]:
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in cmdline and "pytest" in cmdline:
            found.append(f"{entry.parent.name}: {cmdline}")
    return found


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.skipif(WORLD.Get_size() > 1, reason="launches its own MPI jobs: run from a single process")
def test_the_runner_reports_each_outcome_and_ends_every_job(tmp_path):
    source = _tree(tmp_path / "horovod")
    proc = _run("--source", str(source), "--ranks", "2", "--timeout", "30", limit=600)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    status = {name: outcome for outcome, name in re.findall(r"^\[2 ranks\] (\w+)\s+\S+ s  (\w+)", out, flags=re.M)}
    assert status == {"test_pass": "passed", "test_optimizers_without_muon": "passed", "test_skip": "skipped",
                      "test_fail_on_one_rank": "failed", "test_hang": "hung"}, out
    assert "== 2 ranks: 2 passed, 1 failed, 1 hung, 1 skipped of 5" in out, out
    assert re.search(r"failed: test_fail_on_one_rank: rank 1: AssertionError: rank 1 fails", out), out
    assert re.search(r"hung: test_hang: killed after 30 s", out), out
    assert not _processes_running("test_hang"), "a rank of the hung job is still running"
    assert not _processes_running("test_fail_on_one_rank"), "a rank of the failed job is still running"
    assert not (source / "test" / "parallel" / "__pycache__").exists()  # the source tree is only read


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.skipif(WORLD.Get_size() > 1, reason="launches its own MPI jobs: run from a single process")
def test_the_runner_passes_and_selects(tmp_path):
    source = _tree(tmp_path / "horovod")
    proc = _run("--source", str(source), "--ranks", "2,3", "-k", "pass", "-k", "skip", limit=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for n in (2, 3):
        assert f"== {n} ranks: 1 passed, 0 failed, 0 hung, 1 skipped of 2" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.skipif(WORLD.Get_size() > 1, reason="launches its own MPI jobs: run from a single process")
def test_an_interrupted_runner_ends_its_job(tmp_path):
    source = _tree(tmp_path / "horovod")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_GRADREDUCER_"))}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    runner = subprocess.Popen([sys.executable, str(SCRIPT), "--source", str(source), "--ranks", "2", "-k", "hang"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        t0 = time.monotonic()
        while len(_processes_running("test_hang")) < 2:  # both ranks started
            assert time.monotonic() - t0 < 120 and runner.poll() is None, "the job did not start"
            time.sleep(0.2)
        runner.send_signal(signal.SIGTERM)
        out, err = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode != 0 and "interrupted by signal" in err, out + err
    assert not _processes_running("test_hang"), "the interrupted runner left ranks running"


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="runs the runner in a subprocess: from a single process")
def test_the_runner_refuses_files_it_does_not_expect(tmp_path):
    missing = _run("--source", str(tmp_path), limit=60)
    assert missing.returncode != 0 and "test/parallel/test_torch.py: not found" in missing.stderr
    changed = _tree(tmp_path / "other", tests=TESTS.replace("import horovod.torch as hvd", "import horovod as hvd"))
    proc = _run("--source", str(changed), limit=60)
    assert proc.returncode != 0
    assert "expected 'import horovod.torch as hvd' 1 time(s), found it 0 time(s)" in proc.stderr, proc.stderr
    fewer = _tree(tmp_path / "fewer", tests=TESTS.replace("and\n                  subclass != torch.optim.SparseAdam\n",
                                                          "and True\n", 1))
    proc = _run("--source", str(fewer), limit=60)
    assert "expected 'subclass != torch.optim.SparseAdam' 3 time(s), found it 2 time(s)" in proc.stderr
    nothing = _run(limit=60)
    assert nothing.returncode == 2 and "give --source DIR or set HOROVOD_SOURCE" in nothing.stderr


def test_the_changes_are_exactly_three(tmp_path):
    """What the runner writes differs from the source in the three places only (a line diff)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import horovod_suite
    finally:
        sys.path.pop(0)
    source = _tree(tmp_path / "horovod")
    folder = tmp_path / "copy"
    folder.mkdir()
    names = horovod_suite.prepare(source, folder)
    assert names == ["test_pass", "test_optimizers_without_muon", "test_skip", "test_fail_on_one_rank", "test_hang"]
    before = (source / "test/parallel/test_torch.py").read_text().splitlines()
    after = (folder / "test/parallel/test_torch.py").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert changed[0] == ("import horovod.torch as hvd", "import mpi_gradreducer.horovod as hvd")
    assert all(a + " and subclass.__name__ != 'Muon'" == b for a, b in changed[1:])
    assert len(changed) == 4
    common = (folder / "test/utils/common.py").read_text()
    assert "horovod.runner" not in common and "def in_thread(" in common
    assert common.replace(horovod_suite.THREAD_CHANGE[1], "") == \
        COMMON.replace(horovod_suite.THREAD_CHANGE[0], "")
