"""A command run as a process group of its own, with a deadline, and the whole group ended when it is over.

MPI jobs leave processes behind when they go wrong: ``mpiexec``'s proxies,
ranks stuck in a collective, a program a rank started. :class:`Job` starts a
command as the leader of a new session (and so of a process group) and, when
it has to be stopped (past its deadline, on ``KeyboardInterrupt`` or any
other exception), ends the group and every process below the leader: SIGTERM
first, then SIGKILL after a grace period to those still there, then it reaps
the leader. :func:`run` is the one-shot form::

    from mpi_gradreducer import jobs

    done = jobs.run(["mpiexec", "-n", "2", "python", "train.py"], timeout=600)
    if done.timed_out:
        ...  # the whole job was ended
    print(done.returncode, done.stdout, done.seconds)

A :class:`Job` is for a job a caller watches while it runs (read its lines as
they come, kill one of its ranks from outside, stop it on Ctrl-C)::

    with jobs.Job(command, on_line=print) as job:
        ...                     # the job runs
        job.finish(timeout=60)  # wait; past 60 s it is stopped

Output is read by threads as it comes, so a full pipe never blocks the job,
and a process that escaped the group but holds its pipes cannot block the
caller: what was read by then is returned. Finding the processes below the
leader reads ``/proc`` (Linux); elsewhere only the group is signalled.
:func:`marked` and :func:`kill_marked` find and end the processes that carry
a variable of the job's environment, wherever they went.

Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["GRACE", "PIPE", "STDOUT", "Finished", "Job", "descendants", "kill_marked", "marked", "run"]

#: Seconds between SIGTERM and SIGKILL when a job is stopped.
GRACE = 5.0
#: ``stdout``/``stderr``: read the stream (see :attr:`Job.stdout`).
PIPE = subprocess.PIPE
#: ``stderr``: into the same stream as ``stdout``.
STDOUT = subprocess.STDOUT
#: Seconds to wait for the output a stopped job's processes still hold, and for its group to be gone.
_SETTLE = 5.0


@dataclass(frozen=True)
class Finished:
    """A job that is over.

    Attributes:
        command: the argument vector it ran.
        returncode: the leader's exit status (negative: the signal that ended it).
        stdout: its standard output as read (with ``stderr=STDOUT`` both streams); ``""`` when not read.
        stderr: its standard error as read; ``""`` when not read.
        timed_out: it was stopped at its deadline.
        killed: it was stopped, and SIGTERM and the grace period did not end the whole group: SIGKILL did.
        seconds: from its start until it was over.
    """

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed: bool
    seconds: float


def _stat(pid: str) -> tuple[str, int, int] | None:
    """``(state, parent, process group)`` of process ``pid`` from ``/proc``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2])


def _table() -> dict[int, tuple[str, int, int]]:
    """Every live process's ``(state, parent, process group)`` (Linux; elsewhere empty)."""
    found = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if entry.isdigit() and (stat := _stat(entry)) is not None:
            found[int(entry)] = stat
    return found


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` in the process tree, zombies left out (Linux ``/proc``; elsewhere none).

    Args:
        pid: the root of the tree (not included).

    Returns:
        Their process ids, parents before their children.
    """
    children: dict[int, list[int]] = {}
    for child, (state, parent, _) in _table().items():
        if state != "Z":
            children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def marked(variable: str, value: str) -> dict[int, str]:
    """The live processes whose environment holds ``variable=value`` (Linux ``/proc``; elsewhere none).

    A variable set in a job's environment (``Job(env=...)``) is inherited by
    every process the job starts, so it finds them wherever they went: in a
    session of their own, reparented after their parent died, or in another
    network namespace. A zombie shows no environment, and is not found.

    Args:
        variable: the environment variable's name.
        value: its value.

    Returns:
        Their process ids to their command lines.
    """
    needle = f"{variable}={value}".encode()
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found[int(entry.name)] = _cmdline(int(entry.name))
    return found


def kill_marked(variable: str, value: str, wait: float = 5.0) -> dict[int, str]:
    """SIGKILL every process of :func:`marked`, again and again until none is left, at most ``wait`` seconds.

    Returns:
        Those still alive then (pid to command line): none, unless a kill failed.
    """
    deadline = time.monotonic() + wait
    while (left := marked(variable, value)) and time.monotonic() < deadline:
        _send(list(left), 0, signal.SIGKILL)
        time.sleep(0.05)
    return left


def _members(group: int) -> list[int]:
    """The live processes of process group ``group``, zombies left out."""
    table = _table()
    if table:
        return [pid for pid, (state, _, pgrp) in table.items() if pgrp == group and state != "Z"]
    try:  # no /proc: ask the kernel whether anyone is left in the group
        os.killpg(group, 0)
    except OSError:
        return []
    return [group]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie."""
    stat = _stat(str(pid))
    if stat is not None:
        return stat[0] != "Z"
    if os.path.isdir("/proc"):
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _send(pids: Sequence[int], group: int, sig: int) -> None:
    """Send ``sig`` to process group ``group`` (none for 0) and to ``pids``, ignoring those that are gone."""
    try:
        if group:
            os.killpg(group, sig)
    except OSError:  # no process left in the group, or none of ours
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


class Job:
    """A command running as the leader of a session (and process group) of its own.

    Used as a context manager, it is stopped on the way out when it still
    runs or when the block raised (``KeyboardInterrupt`` included).

    Args:
        command: the program and its arguments.
        env: its whole environment (default: this process's).
        cwd: its working directory (default: this process's).
        input: text written to its standard input, which is then closed (default: no input, ``/dev/null``).
        stdout: :data:`PIPE` (read here), ``None`` (this process's) or an open file.
        stderr: :data:`PIPE`, :data:`STDOUT` (into ``stdout``), ``None`` or an open file.
        on_line: called with each line of ``stdout`` (newline included) as it is read, in a reading thread;
            with ``stdout=PIPE`` only. Should it raise, it is called no more, the output is still read to
            its end, and :meth:`finish` raises the error once the job has ended.
        grace: seconds between SIGTERM and SIGKILL when it is stopped.

    Raises:
        ValueError: ``on_line`` without ``stdout=PIPE``, or a negative ``grace``.
        OSError: the program cannot be started.
    """

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, input: str | None = None,
                 stdout: int | IO[Any] | None = PIPE, stderr: int | IO[Any] | None = PIPE,
                 on_line: Callable[[str], object] | None = None, grace: float = GRACE) -> None:
        if on_line is not None and stdout != PIPE:
            raise ValueError(f"on_line: needs stdout=PIPE (the lines are read here), got stdout={stdout!r}")
        if grace < 0:
            raise ValueError(f"grace: expected seconds >= 0, got {grace!r}")
        self.command = list(command)
        self.grace = grace
        #: True once :meth:`stop` ended it at a deadline (see :meth:`finish`).
        self.timed_out = False
        #: True once :meth:`stop` had to SIGKILL it.
        self.killed = False
        #: What ``on_line`` raised, if it did (it is called no more after that; :meth:`finish` raises it).
        self.line_error: Exception | None = None
        self._out: list[str] = []
        self._err: list[str] = []
        self.started = time.monotonic()
        self._ended: float | None = None
        self.process: subprocess.Popen[str] = subprocess.Popen(
            self.command, env=None if env is None else dict(env), cwd=cwd,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE, stdout=stdout, stderr=stderr,
            text=True, errors="replace", start_new_session=True)
        self._threads = [threading.Thread(target=self._read, args=(stream, into, callback), daemon=True)
                         for stream, into, callback in ((self.process.stdout, self._out, on_line),
                                                        (self.process.stderr, self._err, None))
                         if stream is not None]
        if input is not None:
            self._threads.append(threading.Thread(target=self._write, args=(input,), daemon=True))
        for thread in self._threads:
            thread.start()

    def _read(self, stream: IO[str], into: list[str], on_line: Callable[[str], object] | None) -> None:
        """Read ``stream`` to its end (a reader that stopped early would leave the job blocked on a full pipe):
        an error of ``on_line`` is kept for :meth:`finish` to raise, and the lines after it are only stored."""
        with stream:
            for line in stream:
                into.append(line)
                if on_line is not None:
                    try:
                        on_line(line)
                    except Exception as exc:
                        self.line_error, on_line = exc, None

    def _write(self, text: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            with stdin:
                stdin.write(text)
        except (BrokenPipeError, ValueError):  # it exited without reading it all
            pass

    @property
    def pid(self) -> int:
        """The leader's process id, which is also the id of its process group."""
        return self.process.pid

    @property
    def stdout(self) -> str:
        """What was read of its standard output so far (``""`` unless ``stdout=PIPE``)."""
        return "".join(self._out)

    @property
    def stderr(self) -> str:
        """What was read of its standard error so far (``""`` unless ``stderr=PIPE``)."""
        return "".join(self._err)

    def poll(self) -> int | None:
        """The leader's exit status, or None while it runs."""
        return self.process.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (nothing when no process of it is left)."""
        _send((), self.pid, sig)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the leader to exit, at most ``timeout`` seconds (None: for good).

        Returns:
            Its exit status, or None when it still runs (it is left running).
        """
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def _drained(self, deadline: float | None) -> bool:
        """Wait until the readers have seen the end of their streams, at most until ``deadline`` (None: for good)."""
        for thread in self._threads:
            thread.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        """End the job: SIGTERM to its group and every process below the leader, SIGKILL to what is left
        after :attr:`grace` seconds; reap the leader. Sets :attr:`killed` when SIGKILL was needed.

        The processes below the leader are found before the first signal, so
        those that left the group (a new session) are ended too, as long as
        they were still below it then.
        """
        # (a leader already reaped has no descendants of its own, and its pid may belong to another process now:
        # only its group, which keeps the id from reuse while it has members, is signalled)
        below = descendants(self.pid) if self.process.poll() is None else []
        _send(below, self.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while True:
            left = ([pid for pid in {*_members(self.pid), *below} if _alive(pid)]
                    if self.process.poll() is not None else [self.pid])
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if left:
            self.killed = True
            _send([*below, *(descendants(self.pid) if self.process.poll() is None else [])], self.pid,
                  signal.SIGKILL)
        self.process.wait()
        settle = time.monotonic() + _SETTLE
        while _members(self.pid) and time.monotonic() < settle:
            time.sleep(0.02)
        self._ended = self._ended or time.monotonic()

    def finish(self, timeout: float | None) -> Finished:
        """Wait for the job's end, its output included; past ``timeout`` seconds, :meth:`stop` it.

        The deadline covers the output too: a process that outlives the
        leader and holds its pipes keeps the job running. After a stop, the
        output still held by an escaped process is waited for a few seconds,
        then what was read is returned.

        Args:
            timeout: seconds from now; None: no deadline.

        Returns:
            How it ended.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            status = self.wait(timeout)
            if status is not None:
                self._ended = time.monotonic()
            if status is None or not self._drained(deadline):
                self.timed_out = True
                self.stop()
        except BaseException:
            self.stop()
            raise
        self._drained(time.monotonic() + _SETTLE)
        if self.line_error is not None:
            raise self.line_error
        return self.result()

    def result(self) -> Finished:
        """How it ended (call once it is over: after :meth:`finish`, :meth:`stop` or the ``with`` block)."""
        status = self.process.poll()
        if status is None:
            raise RuntimeError(f"result: the job still runs (pid {self.pid}): {' '.join(self.command)[:200]}")
        ended = self._ended if self._ended is not None else time.monotonic()
        return Finished(self.command, status, self.stdout, self.stderr, self.timed_out, self.killed,
                        ended - self.started)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None or self.process.poll() is None:
            self.stop()
        self._drained(time.monotonic() + _SETTLE)


def run(command: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None, capture: bool = True, merge: bool = False,
        input: str | None = None, on_line: Callable[[str], object] | None = None,
        grace: float = GRACE) -> Finished:
    """Run ``command`` as a process group of its own until it ends, at most ``timeout`` seconds.

    Past the deadline, or when this call is interrupted (``KeyboardInterrupt``
    or any exception), the whole group and every process below the leader are
    ended (:meth:`Job.stop`), and the exception, if any, goes on.

    Args:
        command: the program and its arguments.
        timeout: seconds it may take, its output included; None: no limit.
        env: its whole environment (default: this process's).
        cwd: its working directory.
        capture: read its output (else it writes to this process's).
        merge: with ``capture``: its standard error into the same text as its standard output.
        input: text for its standard input (default: ``/dev/null``).
        on_line: with ``capture``: called with each line of its (merged) output as it is read.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        How it ended: ``timed_out`` tells a deadline apart from an exit.
    """
    stdout = PIPE if capture else None
    stderr = (STDOUT if merge else PIPE) if capture else None
    with Job(command, env=env, cwd=cwd, input=input, stdout=stdout, stderr=stderr, on_line=on_line,
             grace=grace) as job:
        return job.finish(timeout)
