"""The one check of the GPU path, run once from the repository root on a machine
with an NVIDIA GPU, CuPy, numpy and mpi4py but no internet::

    scripts/device_check.sh          # or: python3 scripts/device_check.py

1. installs the wheels that ``scripts/fetch_device_wheels.sh`` downloaded
   (MPICH, pytest, pytest-mpi, ml_dtypes) into a scratch folder, and puts
   MPICH's mpiexec and libmpi where mpi4py finds them; the package itself is
   used from the work tree through ``PYTHONPATH``;
2. finds an mpiexec whose ranks form one job (MPICH's own first: the one just
   installed, then the one next to ``$PYTHON``; rank 0 alone prints the world
   size it sees, which must be 2), prints ``python -m mpi_gradreducer.info``,
   and compiles and runs the batched-copy kernel once per dtype in one process;
3. runs the kernel-source tests in one process, then the GPU and staging
   tests under ``mpiexec -n 4``, each rank writing a junit XML file: the GPU
   step is ok only if its tests ran (none skipped for want of a GPU) and
   passed; the CUDA-aware smoke test runs when the MPI library says it reads
   device memory, and the summary says why not otherwise;
4. runs the GPU benchmark on ResNet-50 and on 1000 small tensors: ok only if
   its JSON result holds the timed reducer;
5. prints a summary: one line per step (ok, FAILED, TIMEOUT, NOT RUN,
   skipped), what did not run and why, and the benchmark's key ratios.

A failed step is reported and the next one still runs; without an mpiexec
that forms one job, the MPI steps are NOT RUN (and count as failures). Every
step has a time limit, cut so that the whole check ends within ``BUDGET``
seconds. Output is also written to ``$OUT/device_check.log``. Exit status 0
only when every step is ok (the wheel step may be skipped when the Python
already has everything).

Environment (all optional):

- ``WHEELS``: folder of wheels (default: ``.whl`` in the repository root; it
  is ignored by git, so it must be copied along with the working tree)
- ``OUT``: folder for the log and the benchmark's JSON (default: ``out``)
- ``PYTHON``: the Python that has cupy (default: ``python3``)
- ``SITE``: scratch install folder (default: ``/tmp/site``)
- ``NP``: ranks for the tests and the benchmark (default: 4)
- ``BUDGET``: seconds for the whole check (default: 300)
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Sequence
from types import ModuleType
from typing import IO

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
#: A test's skip message when it needs a GPU that is not there.
NO_GPU = "needs cupy and a CUDA device"
#: The GPU and staging tests, run under mpiexec.
TESTS = ["tests/test_gpu.py", "tests/test_staging.py"]

# Only rank 0 prints, after a barrier: one line, which cannot interleave. Ranks
# of an mpiexec that does not match mpi4py's MPI are separate jobs of size 1,
# each its own rank 0: several lines saying "world 1".
JOBCHECK = """from mpi4py import MPI
c = MPI.COMM_WORLD
c.Barrier()
if c.Get_rank() == 0:
    print("world", c.Get_size(), "|", MPI.Get_library_version().splitlines()[0].strip(), flush=True)"""

# Under mpiexec: pytest on each rank, writing $OUT/junit.RANK.xml.
PYTEST = """import sys, pytest
from mpi4py import MPI
out = sys.argv[1]
sys.exit(pytest.main(sys.argv[2:] + [f"--junitxml={out}/junit.{MPI.COMM_WORLD.Get_rank()}.xml"]))"""

# In the Python that has cupy: the batched-copy kernel once per dtype, and float32 denormals.
KERNELS = """import sys
import numpy as np
try:
    import cupy
    print(f"cupy {cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} device(s), "
          f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    print("device 0:", name.decode() if isinstance(name, bytes) else name)
except Exception as exc:
    print(f"no usable cupy: {type(exc).__name__}: {exc}")
    sys.exit(1)
from mpi_gradreducer._core import backend

pairs = [("float32", "float32"), ("float16", "float32"), ("float64", "float64"), ("complex64", "complex64")]
try:
    import ml_dtypes
    cupy.zeros(1, dtype=ml_dtypes.bfloat16)
    pairs.append((ml_dtypes.bfloat16, "float32"))
except Exception as exc:
    print(f"  bfloat16: not run (this cupy has no bfloat16 arrays: {type(exc).__name__})")
failed = 0
for item, wire in pairs:
    label = np.dtype(item).name
    try:
        members = [cupy.arange(5).astype(item), (cupy.arange(7) + 1).astype(item)]
        buf = cupy.zeros(12, dtype=wire)
        backend.batched_copy(members, buf, [0, 5], 2.0, False)
        want = np.concatenate([np.arange(5), np.arange(7) + 1]) * 2.0
        assert np.allclose(cupy.asnumpy(buf), want), ("pack", cupy.asnumpy(buf))
        out = [cupy.zeros_like(m) for m in members]
        backend.batched_copy(out, buf, [0, 5], 0.5, True)
        for m, o in zip(members, out, strict=True):
            assert np.array_equal(o.get().astype(np.float64), m.get().astype(np.float64)), ("unpack", o.get())
        print(f"  {label} via {wire}: ok")
    except Exception as exc:
        failed += 1
        print(f"  {label} via {wire}: FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:600]}")
tiny = np.array([1e-40, -3e-39], np.float32)
buf = cupy.zeros(2, cupy.float32)
backend.batched_copy([cupy.asarray(tiny)], buf, [0], 1.0, False)
kept = np.array_equal(buf.get().view(np.uint32), tiny.view(np.uint32))
print(f"  float32 denormals kept by a copy: {'ok' if kept else 'FAILED'}")
sys.exit(1 if failed or not kept else 0)
"""


class Tee:
    """A text stream that writes to the terminal and to the log file."""

    def __init__(self, *streams: IO[str]) -> None:
        self.streams = streams
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for s in self.streams:
                s.write(text)
                s.flush()
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def status_word(rc: int | str) -> str:
    """How a step's status reads in the summary."""
    if rc == 0:
        return "ok"
    if rc in (124, 137):
        return f"TIMEOUT (rc {rc})"
    if rc == "skip":
        return "skipped"
    if rc == "notrun":
        return "NOT RUN"
    return f"FAILED (rc {rc})"


def summary_line(name: str, rc: int | str, note: str = "") -> str:
    """One line of the summary: the step, its status and a note."""
    return f"{name:<36} {status_word(rc)}{' - ' + note if note else ''}"


def junit_verdicts(out: str, ranks: int, rc: int) -> tuple[list[tuple[str, int | str, str]], list[str]]:
    """The verdicts of the GPU, staging and CUDA-aware steps from ``out/junit.*.xml``.

    Returns:
        (name, status, note) per step (status 0 ok, 1 failed, or "notrun"),
        and a line for each other test that was skipped, with its reason.
    """
    files = sorted(glob.glob(os.path.join(out, "junit.*.xml")))
    cases: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (module, test) -> (outcome, message) per rank
    for path in files:
        for case in ET.parse(path).getroot().iter("testcase"):
            key = (case.get("classname", "").split(".")[-1], case.get("name", ""))
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                child = case.find(tag)
                if child is not None:
                    outcome, message = tag, (child.get("message") or "").strip()
                    break
            cases.setdefault(key, []).append((outcome, message))

    def verdict(name: str, modules: set[str]) -> tuple[str, int | str, str]:
        mine = {k: v for k, v in cases.items() if k[0] in modules}
        if len(files) < ranks:
            return name, 1, f"{len(files)} of {ranks} ranks wrote results (pytest status {rc})"
        bad = [k[1] for k, v in mine.items() if any(o in ("failure", "error") for o, _ in v)]
        passed = sum(1 for v in mine.values() if all(o == "passed" for o, _ in v))
        no_gpu = [k[1] for k, v in mine.items() if any(o == "skipped" and NO_GPU in m for o, m in v)]
        if bad:
            return name, 1, f"{len(bad)} failed: " + ", ".join(bad[:4])
        if no_gpu:
            return name, 1, f"{len(no_gpu)} of {len(mine)} skipped: {NO_GPU} (nothing of the GPU path ran)"
        if passed == 0:
            return name, 1, "no test ran"
        return name, 0, f"{passed} passed, {len(mine) - passed} skipped"

    verdicts = [verdict("GPU tests (test_gpu.py)", {"test_gpu"}),
                verdict("staging tests (CPU schedule)", {"test_staging"})]
    smoke = cases.get(("test_gpu", "test_cuda_aware_branches_smoke"))
    name = "CUDA-aware branches"
    if not smoke:
        verdicts.append((name, "notrun", "no result for the smoke test"))
    elif all(o == "passed" for o, _ in smoke):
        verdicts.append((name, 0, "Allreduce on device buffers and scaling through cupy ran and passed"))
    elif smoke[0][0] == "skipped":
        verdicts.append((name, "notrun", f"not run: {smoke[0][1]}"))
    else:
        verdicts.append((name, 1, f"{smoke[0][0]}: {smoke[0][1][:200]}"))
    skips = [f"  not run: {module}::{test}: {v[0][1][:160]}" for (module, test), v in sorted(cases.items())
             if v[0][0] == "skipped" and NO_GPU not in v[0][1] and test != "test_cuda_aware_branches_smoke"]
    return verdicts, skips


def bench_result(path: str, workload: str) -> tuple[bool, str]:
    """Whether the benchmark's JSON file holds the timed reducer for ``workload``, and what it says."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        return False, f"no result: {exc}"
    if "skipped" in data:
        return False, "skipped: " + str(data["skipped"])
    methods = data.get("workloads", {}).get(workload, {}).get("methods", {})
    staged = methods.get("reducer-staged", {}).get("median_ms")
    if staged is None:
        return False, f"no reducer-staged time for {workload} in {path}"
    return True, f"{workload}: reducer-staged {staged:.2f} ms"


def bench_summary(paths: Sequence[str]) -> list[str]:
    """The benchmark's key figures: each method's median, the staging ratios, what was skipped."""
    lines = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        if "skipped" in data:
            lines.append(f"{os.path.basename(path)}: skipped ({data['skipped']})")
            continue
        for name, w in data["workloads"].items():
            lines.append(f"{name}: " + ", ".join(f"{m} {v['median_ms']:.2f} ms" for m, v in w["methods"].items()))
            for m, e in w.get("efficiency", {}).items():
                parts = [f"{k} {e[k]:.2f}" for k in ("staging_efficiency", "copy_bound_over_staged") if k in e]
                lines.append(f"  {m}: " + ", ".join(parts))
            for m, why in w.get("skipped", {}).items():
                lines.append(f"  {m} skipped: {why}")
    return lines


def unpack_wheels(site: str, wheels: Sequence[str]) -> None:
    """Install wheels without pip (a wheel is a zip file): packages into ``site``, MPICH's bin and lib into
    ``site/mpich``, with the file modes stored in the wheel."""
    for whl in wheels:
        mpich = os.path.basename(whl).startswith("mpich-")
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if info.is_dir():
                    continue
                if parts[0].endswith(".data"):
                    if mpich and len(parts) > 3 and parts[1] == "data" and parts[2] in ("bin", "lib"):
                        dest = os.path.join(site, "mpich", *parts[2:])
                    elif len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                        dest = os.path.join(site, *parts[2:])
                    else:
                        continue
                else:
                    dest = os.path.join(site, *parts)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with z.open(info) as src, open(dest, "wb") as out:
                    out.write(src.read())
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(dest, mode or (0o755 if "/bin/" in dest else 0o644))


class Check:
    """The steps' shared state: settings, time budget, the summary, the mpiexec found."""

    def __init__(self) -> None:
        env = os.environ
        self.py = env.get("PYTHON", "python3")
        self.wheels = env.get("WHEELS", os.path.join(ROOT, ".whl"))
        self.out = env.get("OUT", "out")
        self.site = env.get("SITE", "/tmp/site")
        self.np = int(env.get("NP", "4"))
        self.budget = int(env.get("BUDGET", "300"))
        self.start = time.monotonic()
        self.summary: list[str] = []
        self.failed = False
        self.mpiexec = ""

    def elapsed(self) -> int:
        return int(time.monotonic() - self.start)

    def record(self, name: str, rc: int | str, note: str = "") -> None:
        """One line of the summary; anything but ok or skipped fails the check."""
        self.summary.append(summary_line(name, rc, note))
        if rc not in (0, "skip"):
            self.failed = True

    def timed(self, want: int, reserve: int, cmd: Sequence[str], capture: bool = False) -> tuple[int, str]:
        """``cmd`` under a time limit of ``want`` seconds, cut to what the budget leaves after ``reserve``.

        Its output goes to the terminal and the log, or with ``capture`` is
        returned instead. The status is 124 when the limit ended it (137 when
        it had to be killed), and 124 without running it when the budget has
        less than 10 s left for it.
        """
        secs = min(want, self.budget - self.elapsed() - reserve)
        if secs < 10:
            message = f"(no time left in the budget of {self.budget} s)\n"
            if capture:
                return 124, message
            print(message, end="")
            return 124, ""
        return limited(cmd, secs, capture)

    def run(self, name: str, want: int, reserve: int, cmd: Sequence[str]) -> None:
        """``cmd`` under a time limit, recorded by its status."""
        rc, _ = self.timed(want, reserve, cmd)
        self.record(name, rc)

    def mpi(self, name: str, want: int, reserve: int, args: Sequence[str]) -> None:
        """``mpiexec ARGS`` as :meth:`run`, or NOT RUN when no mpiexec forms one job."""
        if not self.mpiexec:
            print("(not run: no mpiexec forms one job)")
            self.record(name, "notrun", "no mpiexec forms one job")
            return
        self.run(name, want, reserve, [self.mpiexec, *args])


def _package_module(name: str) -> ModuleType:
    """``mpi_gradreducer.NAME`` (one that imports only the standard library), loaded from its file.

    This check runs before the package's dependencies can be imported here
    (mpi4py finds its MPI library only once step 1 has installed it), and
    importing the package would import them.
    """
    loaded = sys.modules.get(f"_device_check_{name}")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(f"_device_check_{name}",
                                                  os.path.join(ROOT, "mpi_gradreducer", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def limited(cmd: Sequence[str], secs: int, capture: bool = False) -> tuple[int, str]:
    """``cmd`` as a process group of its own, ended after ``secs`` seconds (SIGTERM, then SIGKILL 5 s later:
    :mod:`mpi_gradreducer.jobs`).

    Returns:
        Its status (124 when the limit ended it, 137 when it had to be
        killed), and its output with ``capture`` (else printed as it comes).
    """
    done = _package_module("jobs").run(list(cmd), timeout=secs, merge=True,
                                       on_line=None if capture else sys.stdout.write)
    rc = (137 if done.killed else 124) if done.timed_out else done.returncode
    return rc, done.stdout if capture else ""


def step(title: str) -> None:
    print(f"\n== {title}")


def install_wheels(c: Check) -> int:
    """0 when every wheel went in, 2 when the binary wheels had to be left out (they do not fit
    this Python), 1 on failure."""
    wheels = sorted(glob.glob(os.path.join(c.wheels, "*.whl")))
    mpich = [w for w in wheels if os.path.basename(w).startswith("mpich-")]
    others = [w for w in wheels if w not in mpich]
    pure = [w for w in others if w.endswith("-none-any.whl")]
    try:
        shutil.rmtree(c.site, ignore_errors=True)
        os.makedirs(c.site)
    except OSError:
        return 1
    if limited([c.py, "-m", "pip", "--version"], 60, capture=True)[0] != 0:
        print(f"no pip for {c.py}: unpacking the wheels")
        try:
            unpack_wheels(c.site, wheels)
        except (OSError, zipfile.BadZipFile) as exc:
            print(f"unpacking failed: {exc}")
            return 1
        return 0
    pip = [c.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check"]
    partial = False
    if others and limited([*pip, "--target", c.site, *others], 60)[0] != 0:
        print("retrying with the pure-Python wheels only")
        shutil.rmtree(c.site, ignore_errors=True)
        os.makedirs(c.site)
        if pure and limited([*pip, "--target", c.site, *pure], 60)[0] != 0:
            return 1
        partial = True
    # pip --target leaves out a wheel's data/lib folder, which holds MPICH's
    # libmpi.so.12: MPICH goes to a prefix of its own.
    if mpich and limited([*pip, "--prefix", os.path.join(c.site, "mpich"), *mpich], 60)[0] != 0:
        return 1
    return 2 if partial else 0


def wheels_step(c: Check) -> None:
    step(f"1. wheels from {c.wheels} into {c.site}")
    wheels = sorted(glob.glob(os.path.join(c.wheels, "*.whl")))
    if wheels:
        for w in wheels:
            print(f"  {os.path.getsize(w):10d}  {os.path.basename(w)}")
        rc = install_wheels(c)
        if rc == 2:
            c.record("install wheels", 1, "binary wheels left out (another Python version?)")
        else:
            c.record("install wheels", rc)
    else:
        print(f"no wheels in {c.wheels}: using what this Python already has.")
        print(f"({c.wheels} is ignored by git: a copy of the working tree made from git leaves it out;")
        print(" copy it along explicitly, see docs/gpu.rst.)")
        c.record("install wheels", "skip", f"no wheels in {c.wheels} (git-ignored: copy it along)")
    env = os.environ
    env["PYTHONPATH"] = os.pathsep.join([c.site, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    libmpi = next((p for p in (os.path.join(c.site, "mpich", "lib", "libmpi.so.12"),
                               os.path.join(c.site, "lib", "libmpi.so.12")) if os.path.isfile(p)), "")
    if libmpi:
        # mpi4py >= 4 loads the MPI library named by MPI4PY_LIBMPI; an mpi4py
        # linked against libmpi.so.12 finds it through LD_LIBRARY_PATH.
        env["MPI4PY_LIBMPI"] = libmpi
        env["LD_LIBRARY_PATH"] = os.pathsep.join([os.path.dirname(libmpi)]
                                                 + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    # Should the fallback be a system Open MPI: it refuses root without these.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    print(f"PYTHONPATH={env['PYTHONPATH']}")
    print(f"MPI4PY_LIBMPI={env.get('MPI4PY_LIBMPI', '')}")


def mpiexec_candidates(c: Check) -> list[str]:
    """MPICH's own first: the one installed from the wheels, then the one a user of ``$PYTHON``'s
    environment would run (:func:`mpi_gradreducer.launch.find_mpiexec`: beside it, else on PATH),
    also where ``$PYTHON`` is a link out of its environment."""
    find_mpiexec = _package_module("launch").find_mpiexec
    found = [os.path.join(c.site, "mpich", "bin", "mpiexec"), os.path.join(c.site, "bin", "mpiexec")]
    pythons = [shutil.which(c.py)]
    rc, prefix = limited([c.py, "-c", "import sys; print(sys.prefix)"], 20, capture=True)
    if rc == 0 and prefix.strip():
        pythons.append(os.path.join(prefix.strip().splitlines()[-1], "bin", "python"))
    found += [find_mpiexec(python) for python in pythons if python] or [find_mpiexec()]
    candidates: list[str] = []
    for m in found:
        if m and os.path.isfile(m) and os.access(m, os.X_OK) and m not in candidates:
            candidates.append(m)
    return candidates


def mpi_step(c: Check) -> None:
    step("2a. an mpiexec whose ranks form one job")
    candidates = mpiexec_candidates(c)
    for m in candidates:
        _, out = c.timed(30, 0, [m, "-n", "2", c.py, "-c", JOBCHECK], capture=True)
        print(f"{m}:")
        for line in out.rstrip("\n").split("\n")[-4:]:
            print(f"  {line}")
        worlds = [line for line in out.splitlines() if line.startswith("world ")]
        if len(worlds) == 1 and worlds[0].startswith("world 2 "):
            c.mpiexec = m
            break
    if c.mpiexec:
        os.environ["PATH"] = os.path.dirname(c.mpiexec) + os.pathsep + os.environ.get("PATH", "")
        c.record("mpiexec -n 2 forms one job", 0, c.mpiexec)
    else:
        c.record("mpiexec -n 2 forms one job", 1, "none of: " + (" ".join(candidates) or "no mpiexec found"))

    step("2b. python -m mpi_gradreducer.info (2 ranks)")
    c.mpi("info (2 ranks)", 30, 0, ["-n", "2", c.py, "-m", "mpi_gradreducer.info"])

    step("2c. cupy, and the batched-copy kernel once per dtype (1 process)")
    c.run("cupy + batched_copy kernel", 45, 0, [c.py, "-c", KERNELS])


def tests_step(c: Check) -> list[str]:
    """Steps 3a and 3b; returns the tests that did not run, with their reasons."""
    step("3a. tests/test_kernel_source.py (1 process; no MPI, no GPU)")
    # ok only when every test ran and passed: pytest's last line is then "N passed in ...".
    rc, out = c.timed(45, 90, [c.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                               "tests/test_kernel_source.py"], capture=True)
    print("\n".join(out.rstrip("\n").split("\n")[-6:]))
    last = ([line for line in out.splitlines() if re.search(r"passed|failed|skipped|error", line)] or [""])[-1]
    name = "kernel-source tests (1 process)"
    if rc == 0 and re.match(r"[0-9]+ passed in ", last):
        c.record(name, 0, last.rsplit(" in ", 1)[0])
    else:
        c.record(name, 1 if rc == 0 else rc, last or "no pytest summary")

    step(f"3b. {' '.join(TESTS)} ({c.np} ranks)")
    names = ("GPU tests (test_gpu.py)", "staging tests (CPU schedule)", "CUDA-aware branches")
    if not c.mpiexec:
        for name in names:
            c.record(name, "notrun", "no mpiexec forms one job")
        return []
    rc, _ = c.timed(150, 75, [c.mpiexec, "-n", str(c.np), c.py, "-c", PYTEST, c.out, "-q", "-p", "no:cacheprovider",
                              "--only-mpi", "-rs", *TESTS])
    print(f"(pytest exit status: {rc})")
    try:
        verdicts, skips = junit_verdicts(c.out, c.np, rc)
    except (OSError, ET.ParseError):
        traceback.print_exc()
        c.record(names[0], 1, f"no junit results (pytest status {rc})")
        return []
    for line in skips:
        print(line)
    for name, status, note in verdicts:
        c.record(name, status, note)
    return skips


def bench_step(c: Check) -> list[str]:
    """Step 4; returns the JSON files the benchmark writes."""
    runs = [("4a", "bench gpu resnet50", "bench_gpu.json", "resnet50", 70, 30),
            ("4b", "bench gpu many-small", "bench_gpu_many_small.json", "many-small", 40, 10)]
    for label, name, file, workload, want, reserve in runs:
        step(f"{label}. bench gpu {workload} ({c.np} ranks)")
        path = os.path.join(c.out, file)
        if not c.mpiexec:
            c.record(name, "notrun", "no mpiexec forms one job")
            continue
        rc, _ = c.timed(want, reserve, [c.mpiexec, "-n", str(c.np), c.py, "-m", "mpi_gradreducer.bench", "gpu",
                                        "--workload", workload, "--reps", "5", "--json", path])
        ok, note = bench_result(path, workload)
        if rc == 0 and ok:
            c.record(name, 0, note)
        elif rc in (124, 137):
            c.record(name, rc, note)
        else:
            c.record(name, 1, f"status {rc}; {note}")
    return [os.path.join(c.out, run[2]) for run in runs]


def main() -> int:
    """Run every step and print the summary; returns 0 when every step is ok."""
    os.chdir(ROOT)
    c = Check()
    os.makedirs(c.out, exist_ok=True)
    for stale in ["bench_gpu.json", "bench_gpu_many_small.json", "skips.txt",
                  *map(os.path.basename, glob.glob(os.path.join(c.out, "junit.*.xml")))]:
        with_path = os.path.join(c.out, stale)
        if os.path.exists(with_path):
            os.remove(with_path)
    log = open(os.path.join(c.out, "device_check.log"), "w")
    sys.stdout = sys.stderr = Tee(sys.stdout, log)  # what print and tracebacks write goes to both

    wheels_step(c)
    mpi_step(c)
    skips = tests_step(c)
    jsons = bench_step(c)

    step(f"5. summary ({c.elapsed()} s of a budget of {c.budget} s)")
    print("\n".join(c.summary))
    if skips:
        print("tests not run, and why:")
        print("\n".join(skips))
    try:
        lines = bench_summary(jsons)
    except (OSError, ValueError, KeyError, TypeError):
        traceback.print_exc()
        lines = []
    if lines:
        print("\n".join(lines))
    print("result: every step ok" if not c.failed else "result: NOT every step ok (exit status 1)")
    print(f"log: {os.path.join(c.out, 'device_check.log')}")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
