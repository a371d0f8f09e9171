"""Horovod's own torch test suite against ``mpi_gradreducer.horovod``: each test its own MPI job.

Horovod's ``test/parallel/test_torch.py`` (release 0.28.1) and the
``test/utils/common.py`` it imports are taken from a Horovod source tree
given on the command line; they are never part of this repository. They are
copied into a temporary folder with exactly three changes, each applied
mechanically and checked to apply where expected (the run stops when the
files do not match):

1. ``import horovod.torch as hvd`` becomes ``import mpi_gradreducer.horovod as hvd``;
2. ``common.py``'s one import from ``horovod.runner`` (the ``in_thread``
   helper) becomes a local definition of it;
3. where the suite loops over torch's optimizers, ``Muon`` is left out too
   (it came to torch after Horovod's last release and takes 2-D parameters only).

Then every test runs as its own job, ``mpiexec -n N python -m mpi4py -m
pytest test_torch.py::TorchTests::<test>``, at each rank count, under a hard
time limit: on timeout the job's whole process tree is killed and the test
counts as hung (the running job's tree is killed too when this script is
interrupted). Each rank writes its own JUnit report (one ``mpiexec``
command line per rank), so a test fails when any rank fails it, and a job
whose failing rank left the others waiting is ended a few seconds later.
Jobs get the environment of the repository's test jobs (``tests/conftest.py``
``run_job``): no launch variables of an enclosing MPI job, one OpenMP thread,
the repository on ``PYTHONPATH``.

Usage::

    git -C horovod checkout v0.28.1      # or any tree holding that release's test/
    python scripts/horovod_suite.py --source horovod
    HOROVOD_SOURCE=horovod python scripts/horovod_suite.py --ranks 4 -k allreduce

It prints one line per test and a summary per rank count (passed, failed,
hung, skipped, each failure's name, each skip's reason, the time taken),
and exits 1 on any failure or hang (2 on bad arguments or files). Besides
the package, the copied files need ``pytest``, ``packaging``, ``cloudpickle``
and ``mock`` (``common.py`` imports the last two).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import signal
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = Path("test/parallel/test_torch.py")
COMMON_FILE = Path("test/utils/common.py")
CLASS = "TorchTests"
#: Seconds a job may go on after one of its ranks reported a failure (the others may wait for it forever).
GRACE_SECONDS = 5.0

#: The three changes: (file, old text, new text, how many times the old text must occur).
IMPORT_CHANGE = ("import horovod.torch as hvd\n", "import mpi_gradreducer.horovod as hvd\n", 1)
THREAD_CHANGE = (
    "from horovod.runner.util.threads import in_thread\n",
    "import threading\n"
    "\n"
    "\n"
    "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
    "    \"\"\"Start target(*args) on a new thread and return the thread (errors ignored when silent).\"\"\"\n"
    "    def run(*given):\n"
    "        try:\n"
    "            target(*given)\n"
    "        except Exception:\n"
    "            if not silent:\n"
    "                raise\n"
    "    thread = threading.Thread(target=run, args=tuple(args), name=name, daemon=daemon)\n"
    "    thread.start()\n"
    "    return thread\n",
    1,
)
MUON_CHANGE = ("subclass != torch.optim.SparseAdam\n",
               "subclass != torch.optim.SparseAdam and subclass.__name__ != 'Muon'\n", 3)


@dataclass
class Outcome:
    """How one test went in one job."""

    name: str
    ranks: int
    status: str  # passed, failed, hung or skipped
    seconds: float
    detail: str = ""


@dataclass
class Summary:
    """The outcomes of one rank count."""

    ranks: int
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)


def _change(text: str, old: str, new: str, times: int, where: Path) -> str:
    found = text.count(old)
    if found != times:
        raise SystemExit(f"horovod_suite: {where}: expected {old.strip()!r} {times} time(s), found it {found} "
                         "time(s); is this Horovod 0.28.1's test suite?")
    return text.replace(old, new)


def prepare(source: Path, folder: Path) -> list[str]:
    """Copy the two files from ``source`` into ``folder`` with the three changes; the suite's test names.

    Raises:
        SystemExit: a file is missing or does not match what the changes expect.
    """
    for part in (TEST_FILE, COMMON_FILE):
        if not (source / part).is_file():
            raise SystemExit(f"horovod_suite: {source / part}: not found; --source must be a Horovod source tree "
                             "(release 0.28.1) holding test/")
    tests = (source / TEST_FILE).read_text(encoding="utf-8")
    tests = _change(tests, *IMPORT_CHANGE, where=TEST_FILE)
    tests = _change(tests, *MUON_CHANGE, where=TEST_FILE)
    common = _change((source / COMMON_FILE).read_text(encoding="utf-8"), *THREAD_CHANGE, where=COMMON_FILE)
    (folder / TEST_FILE.parent).mkdir(parents=True)
    (folder / COMMON_FILE.parent).mkdir(parents=True)
    (folder / TEST_FILE).write_text(tests, encoding="utf-8")
    (folder / COMMON_FILE).write_text(common, encoding="utf-8")
    return test_names(tests)


def test_names(text: str) -> list[str]:
    """The ``test_*`` methods of the suite's test class, in file order."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == CLASS:
            return [f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
    raise SystemExit(f"horovod_suite: {TEST_FILE}: no class {CLASS}")


def job_environment() -> dict[str, str]:
    """The environment of the repository's test jobs (``tests/conftest.py``'s ``run_job``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_GRADREDUCER_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONUNBUFFERED", None)
    return env


def command(mpiexec: str, name: str, ranks: int, reports: Path) -> list[str]:
    """``mpiexec`` with one command line per rank (each writes its own JUnit report)."""
    cmd = [mpiexec]
    for r in range(ranks):
        if r:
            cmd.append(":")
        cmd += ["-n", "1", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                f"--junitxml={reports / f'rank{r}.xml'}", f"{TEST_FILE.name}::{CLASS}::{name}"]
    return cmd


def _report(path: Path) -> tuple[str, str] | None:
    """A rank's JUnit report as (status, detail), or None while it is not written."""
    try:
        case = ElementTree.parse(path).getroot().find(".//testcase")
    except (OSError, ElementTree.ParseError):
        return None
    if case is None:
        return "failed", "not collected"
    for tag in ("failure", "error"):
        bad = case.find(tag)
        if bad is not None:
            return "failed", (bad.get("message") or "").strip()
    skipped = case.find("skipped")
    if skipped is not None:
        return "skipped", (skipped.get("message") or "").strip()
    return "passed", ""


def run_test(name: str, ranks: int, folder: Path, mpiexec: str, limit: float) -> Outcome:
    """Run one test as its own job of ``ranks`` ranks, at most ``limit`` seconds."""
    from mpi_gradreducer import jobs  # with MPI not initialised here (see main)

    reports = Path(tempfile.mkdtemp(prefix=f"reports-{ranks}-", dir=folder))
    log = reports / "output.txt"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        job = jobs.Job(command(mpiexec, name, ranks, reports), cwd=folder / TEST_FILE.parent,
                       env=job_environment(), stdout=out, stderr=jobs.STDOUT)
        failed_at: float | None = None
        timed_out = False
        try:
            while job.poll() is None:
                now = time.monotonic()
                if now - t0 > limit or failed_at is not None and now - failed_at > GRACE_SECONDS:
                    timed_out = failed_at is None
                    break
                if failed_at is None and any((_report(reports / f"rank{r}.xml") or ("",))[0] == "failed"
                                             for r in range(ranks)):
                    failed_at = now
                time.sleep(0.1)
        finally:
            job.stop()  # on timeout, on an interruption of this script, and whatever a finished mpiexec left
    seconds = time.monotonic() - t0
    results = [_report(reports / f"rank{r}.xml") for r in range(ranks)]
    tail = log.read_text(errors="replace")[-3000:]
    failures = [f"rank {r}: {d}" for r, res in enumerate(results) if res and res[0] == "failed" for d in [res[1]]]
    # the cause first: a HorovodInternalError on one rank (another rank failed, or left) follows from another's
    failures.sort(key=lambda f: "HorovodInternalError" in f)
    if failures:
        return Outcome(name, ranks, "failed", seconds, "; ".join(f[:300] for f in failures)[:600])
    if timed_out:
        return Outcome(name, ranks, "hung", seconds, f"killed after {limit:.0f} s")
    if any(res is None for res in results) or job.poll() != 0:
        return Outcome(name, ranks, "failed", seconds, f"exit code {job.poll()}, no report from every rank; "
                                                         f"output ends: {tail[-600:]}")
    statuses = {res[0] for res in results if res}
    if statuses == {"skipped"}:
        return Outcome(name, ranks, "skipped", seconds, results[0][1] if results[0] else "")
    if statuses != {"passed"}:
        return Outcome(name, ranks, "failed", seconds, f"the ranks disagree: {sorted(statuses)}")
    return Outcome(name, ranks, "passed", seconds)


def _interrupted(signum: int, frame: object) -> None:
    raise SystemExit(f"horovod_suite: interrupted by signal {signum}")


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--source", default=os.environ.get("HOROVOD_SOURCE"),
                        help="a Horovod source tree at release 0.28.1 (default: $HOROVOD_SOURCE)")
    parser.add_argument("--ranks", default="2,4", help="rank counts, comma-separated (default: 2,4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test job (default: 120)")
    parser.add_argument("-k", dest="select", action="append", default=[],
                        help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args(argv)
    if not args.source:
        parser.error("give --source DIR or set HOROVOD_SOURCE")
    try:
        rank_counts = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks: expected comma-separated ints, got {args.ranks!r}")
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only launches the jobs: no MPI here
    sys.path.insert(0, str(ROOT))
    from mpi_gradreducer.launch import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        parser.error("no mpiexec found (next to this Python or on PATH)")
    folder = Path(tempfile.mkdtemp(prefix="horovod-suite-"))
    signal.signal(signal.SIGTERM, _interrupted)  # the running job's tree is killed on the way out
    try:
        names = prepare(Path(args.source), folder)
        if args.select:
            names = [n for n in names if any(s in n for s in args.select)]
        print(f"horovod_suite: {len(names)} tests from {args.source}, changed copies in {folder}", flush=True)
        summaries = []
        for ranks in rank_counts:
            summary = Summary(ranks)
            t0 = time.monotonic()
            for name in names:
                outcome = run_test(name, ranks, folder, mpiexec, args.timeout)
                summary.outcomes.append(outcome)
                detail = f"  ({_one_line(outcome.detail)})" if outcome.detail else ""
                print(f"[{ranks} ranks] {outcome.status:7} {outcome.seconds:6.1f} s  {name}{detail}", flush=True)
            summary.seconds = time.monotonic() - t0
            summaries.append(summary)
        bad = False
        for s in summaries:
            print(f"== {s.ranks} ranks: {s.count('passed')} passed, {s.count('failed')} failed, {s.count('hung')} "
                  f"hung, {s.count('skipped')} skipped of {len(s.outcomes)} in {s.seconds:.0f} s")
            for o in s.outcomes:
                if o.status != "passed":
                    print(f"   {o.status}: {o.name}: {_one_line(o.detail)}")
            bad = bad or s.count("failed") > 0 or s.count("hung") > 0
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"horovod_suite: kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
