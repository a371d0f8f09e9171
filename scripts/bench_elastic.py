"""Elastic mode's costs: a commit, a commit every digits step, a recovery and a replacement.

::

    python scripts/bench_elastic.py                 # all four (the last two need .venv-ompi)
    python scripts/bench_elastic.py commit step      # only these

- ``commit``: one process; an ``ArrayState`` commit of the digits
  perceptron's parameters and momenta, and of 64 MiB, over one ``np.copyto``
  of the same bytes into buffers made once (interleaved, medians of 9 blocks).
- ``step``: 4 ranks (``mpiexec -n 4`` of this venv's MPI); a digits training
  step (forward, backward, reduction, update) with a commit after it, over
  the same step without (interleaved blocks of 50 steps, medians).
- ``recovery``: Open MPI with ULFM, 4 ranks, a commit every step; one rank
  SIGKILLed from outside; the seconds from the kill to the survivors' first
  step completed after the recovery (their next commit), median of 3 runs.
- ``replacement``: as ``recovery`` with room for 4 in a host file; the
  seconds from the kill to the new rank's first completed step.
- ``detect [--settings off,10,2,1]``: as ``recovery``, but rank 2 is
  stopped (SIGSTOP: alive and silent, as a hung process or a host cut off)
  instead of killed; for each ``MPI_GRADREDUCER_ELASTIC_DETECT`` setting,
  the seconds from the stop to the survivors' next completed step (ULFM's
  heartbeat detector is what sees it), and the step time before the stop.
  The stopped process is SIGKILLed afterwards, so that the job ends.
- ``chaos [--periods 15,60] [--seconds 120]``: Open MPI with ULFM, room for 4
  ranks in a host file, a commit every step (``tests/jobs/elastic_train.py``,
  20 ms of compute a step at 4 ranks, the global batch's 80 ms shared: 27 ms
  at 3); the same number of steps undisturbed, then with a
  random live process SIGKILLed every period while replacements join. Prints,
  for each period, the training efficiency as torchft reports it (the
  undisturbed run's time for those steps over the disturbed run's), the
  committed steps lost per failure (0 when each resumes from its last
  commit), and the median recovery (kill to the survivors' next completed
  step) and rejoin (kill to a replacement's first completed step) times. It
  checks what the tests check: exit status 0, every finishing process at the
  last step with bit-identical parameters, no rank process left running.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mpi_gradreducer import jobs
from mpi_gradreducer.launch import Launcher

ROOT = Path(__file__).resolve().parents[1]


def bench_commit() -> None:
    import numpy as np

    from mpi_gradreducer import elastic

    sys.path.insert(0, str(ROOT / "scripts"))
    from digits_model import init_params

    params = init_params(64, 128, 10, 0, np.float64)
    moments = [np.zeros_like(p) for p in params]
    for name, arrays in (("digits perceptron + momenta", params + moments),
                         ("64 MiB", [np.ones(8 << 20, np.float64)])):
        state = elastic.ArrayState(arrays, step=0)
        buffers = [np.empty_like(a) for a in arrays]
        reps = 2000 if state.nbytes < 1 << 20 else 5
        ratios = []
        for _ in range(9):
            t0 = time.perf_counter()
            for _ in range(reps):
                state.commit()
            t1 = time.perf_counter()
            for _ in range(reps):
                for b, a in zip(buffers, arrays, strict=True):
                    np.copyto(b, a)
            t2 = time.perf_counter()
            ratios.append((t1 - t0) / (t2 - t1))
        print(f"commit of {name} ({state.nbytes} B): {statistics.median(ratios):.2f} x one np.copyto of the same "
              f"bytes ({(t1 - t0) / reps * 1e6:.1f} us a commit)")


def bench_step() -> None:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    done = jobs.run([mpiexec, "-n", "4", sys.executable, str(Path(__file__).resolve()), "_step"], timeout=600,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(done.stdout.strip() or done.stderr[-2000:])


def _step_job() -> None:
    import numpy as np
    from mpi4py import MPI

    from mpi_gradreducer import DistributedGradReducer, elastic

    sys.path.insert(0, str(ROOT / "scripts"))
    from digits_model import Momentum, forward_backward, init_params, load_data

    data = load_data()
    comm = MPI.COMM_WORLD
    params = init_params(64, 128, 10, 0, np.float64)
    opt = Momentum(params, 0.05, 0.9)
    state = elastic.ArrayState([*params, *opt.velocity], step=0)
    reducer = DistributedGradReducer(params, group=state.comm)
    grads = reducer.allocate_grads()
    rng = np.random.default_rng(comm.Get_rank())

    def steps(n: int, commit: bool) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            rows = rng.integers(0, len(data.x_train), 32)
            forward_backward(params, data.x_train[rows], data.y_train[rows], 1.0 / (32 * comm.Get_size()), grads)
            reducer(grads)
            opt.step(grads)
            if commit:
                state.step += 1  # type: ignore[attr-defined]  # a plain value of the state
                state.commit()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / n

    steps(50, False)
    plain, with_commit = [], []
    for _ in range(9):
        plain.append(steps(50, False))
        with_commit.append(steps(50, True))
    if comm.Get_rank() == 0:
        ratio = statistics.median(w / p for w, p in zip(with_commit, plain, strict=True))
        print(f"digits step with a commit every step: {ratio:.3f} x the step without "
              f"({statistics.median(plain) * 1e3:.3f} ms -> {statistics.median(with_commit) * 1e3:.3f} ms, "
              f"{comm.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0].split(',')[0].strip()})")
    reducer.free()


def _ompi_job(out: Path, env: dict[str, str], steps: int = 150, more: tuple[str, ...] = ()) -> jobs.Job:
    venv = Path(os.environ.get("MPI_GRADREDUCER_OMPI_VENV", ROOT / ".venv-ompi"))
    launcher = Launcher.detect(str(venv / "bin" / "mpiexec"))
    variables = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    environ = launcher.environment({k: v for k, v in os.environ.items() if not k.startswith("MPI_GRADREDUCER_")})
    environ.update(variables)
    environ["OMPI_MCA_btl_tcp_if_include"] = "lo"  # the job's TCP stays on the loopback
    command = launcher.command([str(venv / "bin" / "python"), str(ROOT / "tests" / "jobs" / "elastic_train.py"),
                                "--out", str(out), "--steps", str(steps), *more], ranks=4, oversubscribe=True,
                               fault_tolerance=True, env=variables)
    return jobs.Job(command, env=environ, stderr=jobs.STDOUT)


def _after_kill(replace: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {}
        if replace:
            (out / "hosts").write_text("localhost:4\n")
            env["MPI_GRADREDUCER_ELASTIC_HOSTFILE"] = str(out / "hosts")
        with _ompi_job(out, env) as job:
            deadline = time.monotonic() + 120
            while not any("commit 20 " in p.read_text() for p in out.glob("log.*")):
                if time.monotonic() > deadline or job.poll() is not None:
                    raise RuntimeError("the job did not reach step 20")
                time.sleep(0.01)
            killed = time.time()
            os.kill(int((out / "pid.2").read_text()), signal.SIGKILL)
            if job.finish(180).timed_out:
                raise RuntimeError(f"the job did not end within 180 s of the kill:\n{job.stdout[-3000:]}")
        firsts = [t for log in out.glob("log.*")
                  if replace == (out / f"pid.new.{log.name.split('.')[1]}").exists()
                  and (t := _first_step_after(log, killed)) is not None]
        if not firsts:
            raise RuntimeError("no step completed after the kill")
        return min(firsts)


def _first_step_after(log: Path, since: float) -> float | None:
    """Seconds from ``since`` (``time.time()``) to the first step that a process completed after its first resume
    that followed ``since``, from its log; None when there is none."""
    resumed = False
    for words in (line.split() for line in log.read_text().splitlines()):
        if words and words[0] == "resume" and float(words[3]) > since:
            resumed = True
        elif words and words[0] == "commit" and resumed:
            return float(words[2]) - since
    return None


def _after_stop(detect: str, wait: float = 30.0) -> tuple[float | None, float, int]:
    """Rank 2 SIGSTOPped (alive, silent) after step 20: the seconds to the survivors' next completed step (None
    when none came within ``wait``; the stopped process is then SIGKILLed so that the job ends), and the median
    step time before the stop, and mpiexec's exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {"MPI_GRADREDUCER_ELASTIC_DETECT": detect} if detect != "off" else {}
        with _ompi_job(out, env, steps=int(wait * 40) + 200) as job:
            deadline = time.monotonic() + 120
            while not any("commit 20 " in p.read_text() for p in out.glob("log.*")):
                if time.monotonic() > deadline or job.poll() is not None:
                    raise RuntimeError(f"the job did not reach step 20:\n{job.stdout[-3000:]}")
                time.sleep(0.01)
            victim = int((out / "pid.2").read_text())
            stopped = time.time()
            os.kill(victim, signal.SIGSTOP)

            def resumed() -> float | None:
                return next((t for log in out.glob("log.*") if (t := _first_step_after(log, stopped)) is not None),
                            None)

            while (first := resumed()) is None and time.time() < stopped + wait and job.poll() is None:
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)  # the job ends only without it
            done = job.finish(180)
            if done.timed_out:
                raise RuntimeError(f"the job did not end within 180 s:\n{done.stdout[-3000:]}")
            finals = len(list(out.glob("final.*.txt")))
            if finals != 3:
                raise RuntimeError(f"{finals} processes finished, not 3 (exit status {done.returncode}):\n"
                                   f"{done.stdout[-3000:]}")
        zero = (out / f"log.{(out / 'pid.0').read_text()}").read_text().splitlines()
        times = [float(line.split()[2]) for line in zero if line.startswith("commit ")
                 and float(line.split()[2]) < stopped]
        step = statistics.median(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 2 \
            else float("nan")
        return first, step, done.returncode


def bench_detect(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_elastic.py detect")
    parser.add_argument("--settings", default="off,10,2,1",
                        help="MPI_GRADREDUCER_ELASTIC_DETECT values, comma-separated ('off': unset)")
    parser.add_argument("--wait", type=float, default=30.0, help="give up on detection after this long")
    args = parser.parse_args(argv)
    for detect in args.settings.split(","):
        first, step, status = _after_stop(detect, args.wait)
        seen = f"{first:.2f} s" if first is not None else f"not within {args.wait:g} s"
        print(f"a stopped rank (SIGSTOP), MPI_GRADREDUCER_ELASTIC_DETECT={detect}: stop to the survivors' next "
              f"completed step {seen}; {step * 1e3:.1f} ms a step before the stop; exit status {status} (4 ranks, "
              "Open MPI with --with-ft ulfm, a commit every step)", flush=True)


def bench_recovery(replace: bool = False) -> None:
    times = [_after_kill(replace) for _ in range(3)]
    what = "replacement joined (kill to its first completed step)" if replace else \
        "recovery (kill to the survivors' next completed step)"
    print(f"{what}: {statistics.median(times):.2f} s (runs: {', '.join(f'{t:.2f}' for t in times)}; 4 ranks, "
          "Open MPI with --with-ft ulfm, a commit every step)")


class ChaosError(RuntimeError):
    """A chaos run that did not end as it must (a failed exit, differing parameters, a process left)."""


def _events(out: Path) -> dict[int, list[list[str]]]:
    """Each process's log, as lists of words, by process id."""
    return {int(p.name.split(".")[1]): [line.split() for line in p.read_text().splitlines() if line.strip()]
            for p in out.glob("log.*")}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def chaos_run(steps: int, period: float | None, seed: int = 0, limit: float = 1800, keep: Path | None = None,
              most: int | None = None) -> dict[str, object]:
    """One run of ``steps`` steps at 4 ranks with room for 4, a random live process killed every ``period`` s.

    ``keep``: a folder to copy the job's files and output into (to look at a failure); ``most``: at most
    this many kills.

    Returns:
        ``seconds`` (from the first commit to the last step's), ``kills`` (their times), ``lost`` (committed
        steps lost per kill), ``recovery`` and ``rejoin`` (seconds per kill, where seen), ``status``
        (mpiexec's exit status) and ``finished`` (the processes that reached the last step).

    Raises:
        ChaosError: no process finished, or they ended with differing parameters or short of the last
            step, or a rank process was left running.
    """
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        try:
            return _chaos(out, steps, period, rng, limit, most)
        finally:
            if keep is not None:
                shutil.copytree(out, keep, dirs_exist_ok=True)


def _chaos(out: Path, steps: int, period: float | None, rng: random.Random, limit: float,
           most: int | None) -> dict[str, object]:
    """The run of :func:`chaos_run` in ``out``."""
    (out / "hosts").write_text("localhost:4\n")
    kills: list[float] = []
    # the compute of a constant global batch, shared: a step at 3 ranks takes 4/3 of one at 4
    with _ompi_job(out, {"MPI_GRADREDUCER_ELASTIC_HOSTFILE": str(out / "hosts")}, steps,
                   ("--share-compute", "4")) as job:
        deadline = time.monotonic() + limit
        started: float | None = None
        while job.poll() is None:
            if time.monotonic() > deadline:
                raise ChaosError(f"the job did not end within {limit} s:\n{job.finish(5).stdout[-3000:]}")
            if started is None and any("commit " in p.read_text() for p in out.glob("log.*")):
                started = time.monotonic()
            if period and started is not None and time.monotonic() - started >= period * (len(kills) + 1) \
                    and (most is None or len(kills) < most):
                pids = [int(p.read_text()) for p in out.glob("pid.*") if p.read_text().strip()]
                live = [pid for pid in pids if _alive(pid) and not (out / f"final.{pid}.txt").exists()]
                if live:
                    kills.append(time.time())
                    os.kill(rng.choice(live), signal.SIGKILL)
            time.sleep(0.01)
        done = job.finish(60)
    (out / "output").write_text(done.stdout)
    pids = [int(p.read_text()) for p in out.glob("pid.*") if p.read_text().strip()]
    left = [pid for pid in pids if _alive(pid)]
    if left:
        raise ChaosError(f"rank processes left running after the job: {left}")
    finals = sorted(out.glob("final.*.npy"))
    if not finals:
        raise ChaosError(f"no process finished (exit status {done.returncode}):\n{done.stdout[-4000:]}")
    import numpy as np

    first = np.load(finals[0]).view(np.uint32)
    if any(not np.array_equal(np.load(f).view(np.uint32), first) for f in finals[1:]):
        raise ChaosError("the finishing processes' parameters differ")
    ends = [int((out / f"final.{f.name.split('.')[1]}.txt").read_text().split()[0]) for f in finals]
    if set(ends) != {steps}:
        raise ChaosError(f"the finishing processes ended at steps {ends}, not {steps}")
    events = _events(out)
    commits = sorted((float(w[2]), int(w[1]), pid) for pid, ws in events.items() for w in ws if w[0] == "commit")
    news = {pid for pid in events if (out / f"pid.new.{pid}").exists()}
    lost, recovery, rejoin = [], [], []
    for k in kills:
        resumes = [(float(w[3]), int(w[1]), pid) for pid, ws in events.items() for w in ws
                   if w[0] == "resume" and float(w[3]) > k and pid not in news]
        if resumes:
            when, step, pid = min(resumes)  # the first survivor to go on: what it had committed before the kill
            before = max((s for t, s, p in commits if p == pid and t < k), default=0)
            lost.append(max(0, before - step))
            nxt = [t for t, _, p in commits if p == pid and t > when]
            if nxt:
                recovery.append(min(nxt) - k)
        born = [p for p in news if (out / f"pid.new.{p}").stat().st_mtime > k]  # started after this kill
        joined = [t for t, _, p in commits if p in born and t > k]
        if joined:
            rejoin.append(min(joined) - k)
    # mpiexec's own status is reported, not judged: Open MPI 5.0.11's prterun exits with a SIGKILLed
    # replacement's 137 although every rank finished
    return {"seconds": commits[-1][0] - commits[0][0], "kills": kills, "lost": lost, "recovery": recovery,
            "rejoin": rejoin, "status": done.returncode, "finished": len(finals)}


def bench_chaos(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_elastic.py chaos")
    parser.add_argument("--periods", default="15,60", help="seconds between kills, comma-separated")
    parser.add_argument("--seconds", type=float, default=120.0, help="the undisturbed run's length, about")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    probe = chaos_run(200, None)
    rate = 199 / probe["seconds"]  # type: ignore[operator]
    steps = max(200, int(rate * args.seconds))
    for period in (float(p) for p in args.periods.split(",")):
        calm = chaos_run(steps, None)["seconds"]
        run = chaos_run(steps, period, args.seed)
        kills, lost = run["kills"], run["lost"]
        assert isinstance(kills, list) and isinstance(lost, list)
        recovery, rejoin = run["recovery"], run["rejoin"]
        assert isinstance(recovery, list) and isinstance(rejoin, list)
        print(f"chaos, a kill every {period:g} s: efficiency {calm / run['seconds']:.1%} ({steps} steps: "  # type: ignore[operator]
              f"{calm:.1f} s undisturbed, {run['seconds']:.1f} s with {len(kills)} kills); committed steps lost "
              f"per failure {statistics.mean(lost) if lost else 0:.2f}; recovery "
              f"{statistics.median(recovery) if recovery else float('nan'):.2f} s, rejoin "
              f"{statistics.median(rejoin) if rejoin else float('nan'):.2f} s (medians; 4 ranks with room for 4, "
              "Open MPI with --with-ft ulfm, a commit every step)", flush=True)


def main() -> None:
    if sys.argv[1:] == ["_step"]:
        _step_job()
        return
    if sys.argv[1:2] == ["chaos"]:
        bench_chaos(sys.argv[2:])
        return
    if sys.argv[1:2] == ["detect"]:
        bench_detect(sys.argv[2:])
        return
    benches = {"commit": bench_commit, "step": bench_step, "recovery": bench_recovery,
               "replacement": lambda: bench_recovery(True)}
    which = sys.argv[1:] or list(benches)
    unknown = [name for name in which if name not in benches]
    if unknown:
        print(f"usage: bench_elastic.py [{' '.join(benches)} ...] | chaos ... | detect ...; "
              f"got {' '.join(unknown)!r} (see the module's docstring)", file=sys.stderr)
        sys.exit(2)
    for name in which:
        benches[name]()


if __name__ == "__main__":
    main()
