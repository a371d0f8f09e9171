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
ALONE = ("the call", "the floor", "the proof: the same arrays, unchanged", "opening the call", "writing the header",
         "reading its sums", "the copies in", "the collectives", "the scaling", "the copies out",
         "the watchdog's arming", "the rest")
TURNS = ("the floor", "the steps back to back", "+ the proof", "+ the header", "the call",
         "Python function calls per call")


@pytest.mark.parametrize("args", [[], ["--count", "40", "--size", "64"]])
def test_profile_call_times_every_step(args):
    job = subprocess.run([sys.executable, str(SCRIPT), "--number", "50", "--repeat", "2", "--reps", "20", *args],
                         capture_output=True, text=True, timeout=120, check=False)
    assert job.returncode == 0, job.stderr
    alone, turns = job.stdout.split("in turns")
    rows = [dict(re.findall(r"^ +(.+?)\s+(-?[0-9.]+)$", part, re.MULTILINE)) for part in (alone, turns)]
    assert tuple(rows[0]) == ALONE and tuple(rows[1]) == TURNS, job.stdout
    assert all(float(v) > 0 for v in [*list(rows[0].values())[:-1], *rows[1].values()]), job.stdout
