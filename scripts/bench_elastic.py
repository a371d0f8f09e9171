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
"""

from __future__ import annotations

import os
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
                state.step += 1
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


def _ompi_job(out: Path, env: dict[str, str]) -> jobs.Job:
    venv = Path(os.environ.get("MPI_GRADREDUCER_OMPI_VENV", ROOT / ".venv-ompi"))
    launcher = Launcher.detect(str(venv / "bin" / "mpiexec"))
    variables = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    environ = launcher.environment({k: v for k, v in os.environ.items() if not k.startswith("MPI_GRADREDUCER_")})
    environ.update(variables)
    environ["OMPI_MCA_btl_tcp_if_include"] = "lo"  # the job's TCP stays on the loopback
    command = launcher.command([str(venv / "bin" / "python"), str(ROOT / "tests" / "jobs" / "elastic_train.py"),
                                "--out", str(out), "--steps", "150"], ranks=4, oversubscribe=True,
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
        firsts = []
        for log in out.glob("log.*"):
            pid = log.name.split(".")[1]
            new = (out / f"pid.new.{pid}").exists()
            if replace != new:
                continue
            resumed = False  # the first step completed after the first resume that followed the kill
            for line in log.read_text().splitlines():
                words = line.split()
                if words[0] == "resume" and float(words[3]) > killed:
                    resumed = True
                elif words[0] == "commit" and resumed:
                    firsts.append(float(words[2]) - killed)
                    break
        if not firsts:
            raise RuntimeError("no step completed after the kill")
        return min(firsts)


def bench_recovery(replace: bool = False) -> None:
    times = [_after_kill(replace) for _ in range(3)]
    what = "replacement joined (kill to its first completed step)" if replace else \
        "recovery (kill to the survivors' next completed step)"
    print(f"{what}: {statistics.median(times):.2f} s (runs: {', '.join(f'{t:.2f}' for t in times)}; 4 ranks, "
          "Open MPI with --with-ft ulfm, a commit every step)")


def main() -> None:
    if sys.argv[1:] == ["_step"]:
        _step_job()
        return
    which = sys.argv[1:] or ["commit", "step", "recovery", "replacement"]
    for name in which:
        {"commit": bench_commit, "step": bench_step, "recovery": bench_recovery,
         "replacement": lambda: bench_recovery(True)}[name]()


if __name__ == "__main__":
    main()
