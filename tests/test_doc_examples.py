"""Every Python example of README.rst and docs/*.rst runs (``tests/docexamples.py`` finds them), and holds.

Doctests (``>>>``) run here, in one process, and compare what they print.
The other examples run in ONE ``mpiexec -n 4`` job that execs each of them
on every rank, in order, under a hard time limit, then checks on every rank
what the example prints or claims (``tests/docclaims.py``: the values it
prints, averages, "the same bits"); each example is then one test here,
which fails with the traceback of every rank where it raised or its check
failed. Examples marked as fragments (``.. fragment: why`` before them) are
skipped, with the reason.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import tempfile

import pytest

from conftest import WORLD, run_job
from docclaims import CLAIMS, claims_of
from docexamples import Example, all_examples

EXAMPLES = all_examples()
RUNNABLE = [e for e in EXAMPLES if e.fragment is None and not e.doctest]
#: The one job that runs every example must be over within this.
LIMIT = 120.0

pytestmark = [pytest.mark.skipif(WORLD.Get_size() > 1, reason="launches its own MPI job: run from a single process")]


def test_examples_are_found():
    """The README's examples are found, and at least one of each kind: a broken finder fails here."""
    assert any(e.path == "README.rst" for e in RUNNABLE)
    assert any(e.doctest for e in EXAMPLES)
    fragments = [e for e in EXAMPLES if e.fragment is not None]
    # printed in the log of every run (pytest -s or -rP shows it): what was not run, and why
    print(f"\n{len(EXAMPLES)} examples; {len(fragments)} fragments not run:")
    for e in fragments:
        print(f"  {e.id}: {e.fragment}")


def test_every_runnable_example_has_one_check_and_every_check_one_example():
    """An example added later gets its check (tests/docclaims.py); a check whose example changed is found."""
    for e in RUNNABLE:
        assert len(claims_of(e.path, e.code)) == 1, f"{e.id}: {len(claims_of(e.path, e.code))} checks"
    for c in CLAIMS:
        matched = [e.id for e in RUNNABLE if c in claims_of(e.path, e.code)]
        assert len(matched) == 1, f"the check of {c.path} {c.marker!r} matches {matched}"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.doctest], ids=lambda e: e.id)
def test_doctest(example: Example):
    if example.fragment is not None:
        pytest.skip(f"{example.id} is a fragment: {example.fragment}")
    parser = doctest.DocTestParser()
    test = parser.get_doctest(example.code, {"__name__": "__main__"}, example.id, example.path, example.line - 1)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)


@pytest.fixture(scope="module")
def ran() -> dict[str, str]:
    """Run every runnable example in one 4-rank job; the errors per example."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump([{"id": e.id, "path": e.path, "code": e.code} for e in RUNNABLE], f)
        job = run_job("doc_examples.py", src, dst, runner=True, limit=LIMIT,
                      env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
        started = re.findall(r"^example (\S+)$", job.stdout, re.M)
        assert job.returncode == 0 and os.path.exists(dst), (
            f"the examples' job failed (last example started: {started[-1] if started else 'none'})\n{job}")
        with open(dst) as f:
            return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("example", [e for e in EXAMPLES if not e.doctest], ids=lambda e: e.id)
def test_example(example: Example, ran: dict[str, str]):
    if example.fragment is not None:
        pytest.skip(f"{example.id} is a fragment: {example.fragment}")
    assert example.id in ran, f"{example.id} was not run"
    assert not ran[example.id], f"{example.id} failed:\n{example.code}\n{ran[example.id]}"
