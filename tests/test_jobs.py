"""mpi_gradreducer.jobs: real processes, their groups and the processes below them, ended within bounds."""

from __future__ import annotations

import ast
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mpi_gradreducer import jobs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")

PY = sys.executable
#: A child that ignores SIGTERM, says so, and sleeps.
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf', flush=True); time.sleep(300)"


def alive(pid: int) -> bool:
    """Process ``pid`` exists and is no zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], limit: float = 5) -> list[int]:
    deadline = time.monotonic() + limit
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def pids_in(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()]


def test_output_and_exit_status_pass_through():
    done = jobs.run([PY, "-c", "import sys; print('out'); sys.stderr.write('err\\n'); sys.exit(3)"], timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n"), done
    assert not done.timed_out and not done.killed and 0 < done.seconds < 60, done
    merged = jobs.run([PY, "-c", "import sys; print('a', flush=True); sys.stderr.write('b\\n')"], timeout=60,
                      merge=True)
    assert merged.returncode == 0 and merged.stdout == "a\nb\n" and merged.stderr == "", merged


def test_input_and_lines_as_they_come():
    lines: list[str] = []
    done = jobs.run([PY, "-c", "import sys; [print(l.upper(), end='') for l in sys.stdin]"], timeout=60,
                    input="x\ny\n", on_line=lines.append)
    assert done.returncode == 0 and lines == ["X\n", "Y\n"] and done.stdout == "X\nY\n", done


def test_a_failing_line_callback_stops_neither_the_reading_nor_the_job_and_is_raised_at_the_end():
    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        raise ValueError(f"cannot parse {line!r}")

    # 200,000 lines (about 1.4 MB): a reader that stopped at the first would leave the child blocked on a full
    # pipe until the deadline
    start = time.monotonic()
    with pytest.raises(ValueError, match="cannot parse 'line 0"):
        jobs.run([PY, "-c", "for i in range(200000): print('line', i)"], timeout=60, on_line=on_line)
    assert time.monotonic() - start < 30 and seen == ["line 0\n"]
    with jobs.Job([PY, "-c", "print('a'); print('b')"], on_line=on_line) as job:
        with pytest.raises(ValueError):
            job.finish(60)
        assert job.result().returncode == 0 and job.stdout == "a\nb\n"


def test_a_timeout_ends_the_job_and_its_grandchild_within_a_bound():
    start = time.monotonic()
    done = jobs.run(["sh", "-c", "sleep 300 & echo $!; sleep 300"], timeout=1, grace=2)
    took = time.monotonic() - start
    assert done.timed_out and not done.killed and done.returncode == -signal.SIGTERM, done
    assert 1 <= took < 4 and 1 <= done.seconds < 4, (took, done)
    grandchild = pids_in(done.stdout)
    assert len(grandchild) == 1 and not wait_gone(grandchild, 0.5), done


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    start = time.monotonic()
    done = jobs.run([PY, "-c", DEAF], timeout=2, grace=1)
    took = time.monotonic() - start
    assert done.timed_out and done.killed and done.returncode == -signal.SIGKILL, done
    assert done.stdout == "deaf\n" and 3 <= took < 6, (took, done)


def test_a_grandchild_that_ignores_sigterm_is_killed_too():
    script = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {DEAF!r}]); " \
             "print(p.pid, flush=True); time.sleep(300)"
    with jobs.Job([PY, "-c", script], grace=1) as job:
        while len(job.stdout.split()) < 2:  # its pid, then the grandchild's "deaf"
            assert job.poll() is None and time.monotonic() - job.started < 30, job.stderr
            time.sleep(0.02)
        grandchild = pids_in(job.stdout)
        job.stop()
    assert job.killed and job.poll() == -signal.SIGTERM, job.result()  # the child went at SIGTERM
    assert not wait_gone(grandchild, 0.5)


def test_a_process_in_a_session_of_its_own_below_the_job_is_ended():
    script = "import subprocess, time; p = subprocess.Popen(['sleep', '300'], start_new_session=True, " \
             "stdout=subprocess.DEVNULL); print(p.pid, flush=True); time.sleep(300)"
    done = jobs.run([PY, "-c", script], timeout=2, grace=1)
    escaped = pids_in(done.stdout)
    assert done.timed_out and len(escaped) == 1, done
    assert not wait_gone(escaped, 0.5), f"pid {escaped[0]} outlived the stop"


def test_a_survivor_holding_the_output_keeps_the_job_to_its_deadline():
    start = time.monotonic()
    done = jobs.run(["sh", "-c", "sleep 300 & echo $!"], timeout=1.5, grace=1)
    assert done.returncode == 0 and done.timed_out, done  # the leader exited at once; its child held stdout
    assert 1.5 <= time.monotonic() - start < 5 and not wait_gone(pids_in(done.stdout), 0.5), done


def test_an_interruption_ends_the_group_and_goes_on():
    pids: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        with jobs.Job(["sh", "-c", "sleep 300 & echo $!; wait"], grace=1) as job:
            while not job.stdout:
                time.sleep(0.02)
            pids = [job.pid, *pids_in(job.stdout)]
            raise KeyboardInterrupt
    assert len(pids) == 2 and not wait_gone(pids, 0.5), pids
    assert job.result().returncode == -signal.SIGTERM


def test_signal_reaches_the_group_and_a_finished_job_is_left_alone():
    with jobs.Job(["sh", "-c", "trap 'echo usr1; exit 5' USR1; echo ready; while :; do sleep 0.05; done"]) as job:
        while "ready" not in job.stdout:
            assert time.monotonic() - job.started < 30
            time.sleep(0.02)
        job.signal(signal.SIGUSR1)
        done = job.finish(timeout=30)
    assert done.returncode == 5 and done.stdout == "ready\nusr1\n" and not done.timed_out, done
    job.stop()  # nothing left: no signal, no change
    assert job.result() == done


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"on_line: needs stdout=PIPE"):
        jobs.Job(["true"], stdout=None, on_line=print)
    with pytest.raises(ValueError, match=r"grace: expected seconds >= 0, got -1"):
        jobs.Job(["true"], grace=-1)
    with pytest.raises(FileNotFoundError):
        jobs.run(["/no/such/program"], timeout=5)


def test_no_deadline_waits_for_the_end():
    done = jobs.run(["sh", "-c", "sleep 0.3; echo done"], timeout=None)
    assert done.returncode == 0 and done.stdout == "done\n" and not done.timed_out and done.seconds >= 0.3, done


@pytest.mark.parametrize("name", ["jobs", "launch"])
def test_it_imports_nothing_but_the_standard_library(name: str):
    """``scripts/device_check.py`` loads these two from their files, before the package's dependencies
    (numpy, mpi4py and its MPI library) can be imported."""
    tree = ast.parse((Path(jobs.__file__).parent / f"{name}.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    others = sorted(m for m in imported if m.split(".")[0] not in sys.stdlib_module_names)
    assert not others, f"mpi_gradreducer/{name}.py imports {others}: only the standard library expected"


def test_a_mark_in_the_environment_finds_a_process_that_left_the_group_and_the_tree():
    mark = f"t{os.getpid()}x{time.monotonic_ns()}"
    env = {**os.environ, "JOBS_TEST_MARK": mark}
    done = jobs.run(["sh", "-c", "setsid -f sleep 301 </dev/null >/dev/null 2>&1"], timeout=30, env=env)
    assert done.returncode == 0 and not done.timed_out, done  # its leader gone, the sleep in a session of its own
    deadline = time.monotonic() + 5
    while not (found := jobs.marked("JOBS_TEST_MARK", mark)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(found.values()) == ["sleep 301"], found
    assert jobs.marked("JOBS_TEST_MARK", mark + "0") == {}  # the whole value, not a prefix of it
    assert jobs.kill_marked("JOBS_TEST_MARK", mark) == {} and not wait_gone(list(found), 1), found
