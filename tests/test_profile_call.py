"""``scripts/profile_call.py`` still finds every step it times (it reads the reducer's internals).

It runs in a process of its own (a 1-rank ``COMM_WORLD``), with a hard time
limit, from the single-process session only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WORLD

pytestmark = pytest.mark.skipif(WORLD.Get_size() > 1, reason="runs a script in a process of its own: one rank")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_call.py"
STEPS = ("the call", "the floor", "the proof: the same arrays, unchanged", "opening the call", "writing the header",
         "reading its sums", "the copies in", "the collectives", "the copies out", "the watchdog's arming", "the rest")


@pytest.mark.parametrize("args", [[], ["--count", "40", "--size", "64"]])
def test_profile_call_times_every_step(args):
    job = subprocess.run([sys.executable, str(SCRIPT), "--number", "50", "--repeat", "2", *args],
                         capture_output=True, text=True, timeout=120, check=False)
    assert job.returncode == 0, job.stderr
    rows = dict(re.findall(r"^  (.+?)\s+(-?[0-9.]+)$", job.stdout, re.MULTILINE))
    assert set(rows) == {*STEPS, "Python function calls per call"}, job.stdout
    assert all(float(rows[s]) > 0 for s in STEPS[:-1]), job.stdout
    assert float(rows["Python function calls per call"]) >= 10, job.stdout
