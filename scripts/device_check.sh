#!/usr/bin/env bash
# The one check of the GPU path, run once from the repository root on a machine
# with an NVIDIA GPU, CuPy, numpy and mpi4py but no internet:
#
#   scripts/device_check.sh
#
# 1. installs the wheels that scripts/fetch_device_wheels.sh downloaded (MPICH,
#    pytest, pytest-mpi, ml_dtypes) into a scratch folder, and puts MPICH's
#    mpiexec and libmpi where mpi4py finds them; the package itself is used
#    from the work tree through PYTHONPATH;
# 2. finds an mpiexec whose ranks form one job (MPICH's own first: the one just
#    installed, then the one next to $PYTHON; rank 0 alone prints the world size
#    it sees, which must be 2), prints `python -m mpi_gradreducer.info`, and
#    compiles and runs the batched-copy kernel once per dtype in one process;
# 3. runs the kernel-source tests in one process, then the GPU and staging
#    tests under mpiexec -n 4, each rank
#    writing a junit XML file: the GPU step is ok only if its tests ran (none
#    skipped for want of a GPU) and passed; the CUDA-aware smoke test runs when
#    the MPI library says it reads device memory, and the summary says why not
#    otherwise;
# 4. runs the GPU benchmark on ResNet-50 and on 1000 small tensors: ok only if
#    its JSON result holds the timed reducer;
# 5. prints a summary: one line per step (ok, FAILED, TIMEOUT, NOT RUN,
#    skipped), what did not run and why, and the benchmark's key ratios.
#
# A failed step is reported and the next one still runs; without an mpiexec
# that forms one job, the MPI steps are NOT RUN (and count as failures). Every
# step has a time limit, cut so that the whole script ends within BUDGET
# seconds. Output is also written to $OUT/device_check.log. Exit status 0 only
# when every step is ok (the wheel step may be skipped when the Python already
# has everything).
#
# Environment (all optional):
#   WHEELS  folder of wheels (default: .whl in the repository root; it is
#           ignored by git, so it must be copied along with the working tree)
#   OUT     folder for the log and the benchmark's JSON (default: out)
#   PYTHON  the Python that has cupy (default: python3)
#   SITE    scratch install folder (default: /tmp/site)
#   NP      ranks for the tests and the benchmark (default: 4)
#   BUDGET  seconds for the whole script (default: 300)
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
OUT=${OUT:-out}
SITE=${SITE:-/tmp/site}
NP=${NP:-4}
BUDGET=${BUDGET:-300}
mkdir -p "$OUT"
rm -f "$OUT/bench_gpu.json" "$OUT/bench_gpu_many_small.json" "$OUT"/junit.*.xml
exec > >(tee "$OUT/device_check.log") 2>&1

SUMMARY=()
FAILED=0
START=$SECONDS

step() { echo; echo "== $*"; }

# record NAME RC [NOTE]: one line of the summary.
record() {
  local word
  case $2 in
    0) word=ok ;;
    124 | 137) word="TIMEOUT (rc $2)" ;;
    skip) word=skipped ;;
    notrun) word="NOT RUN" ;;
    *) word="FAILED (rc $2)" ;;
  esac
  SUMMARY+=("$(printf '%-36s %s%s' "$1" "$word" "${3:+ - $3}")")
  case $2 in 0 | skip) ;; *) FAILED=1 ;; esac
}

# limit WANT [RESERVE]: WANT seconds, cut to what the budget leaves after RESERVE.
limit() {
  local left=$((BUDGET - (SECONDS - START) - ${2:-0}))
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# timed WANT RESERVE COMMAND...: the command under a time limit; rc 124 when
# the budget has no time left for it (it does not run then).
timed() {
  local secs
  secs=$(limit "$1" "$2")
  shift 2
  if [ "$secs" -lt 10 ]; then
    echo "(no time left in the budget of $BUDGET s)"
    return 124
  fi
  timeout --kill-after=5 "$secs" "$@"
}

# run NAME WANT RESERVE COMMAND...: the command under a time limit, recorded by its status.
run() {
  local name=$1 want=$2 reserve=$3 rc
  shift 3
  timed "$want" "$reserve" "$@"
  rc=$?
  record "$name" "$rc"
}

# -- 1. wheels ------------------------------------------------------------------------

# Without pip: a wheel is a zip file. Packages go to $SITE, MPICH's data
# folder (bin, lib) to $SITE/mpich, with the file modes stored in the wheel.
UNPACK='
import os, sys, zipfile
site = sys.argv[1]
for whl in sys.argv[2:]:
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
'

# install_wheels: 0 when all went in, 2 when the binary wheels had to be left
# out (they do not fit this Python), 1 on failure.
install_wheels() {
  local w partial=0 others=() pure=() mpich=()
  for w in "$WHEELS"/*.whl; do
    case $(basename "$w") in
      mpich-*) mpich+=("$w") ;;
      *-none-any.whl) others+=("$w"); pure+=("$w") ;;
      *) others+=("$w") ;;
    esac
  done
  rm -rf "$SITE" && mkdir -p "$SITE" || return 1
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "no pip for $PY: unpacking the wheels"
    timeout 60 "$PY" -c "$UNPACK" "$SITE" "$WHEELS"/*.whl || return 1
    return 0
  fi
  local pip=(timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check)
  if [ ${#others[@]} -gt 0 ] && ! "${pip[@]}" --target "$SITE" "${others[@]}"; then
    echo "retrying with the pure-Python wheels only"
    rm -rf "$SITE" && mkdir -p "$SITE" || return 1
    if [ ${#pure[@]} -gt 0 ]; then "${pip[@]}" --target "$SITE" "${pure[@]}" || return 1; fi
    partial=1
  fi
  # pip --target leaves out a wheel's data/lib folder, which holds MPICH's
  # libmpi.so.12: MPICH goes to a prefix of its own.
  if [ ${#mpich[@]} -gt 0 ]; then "${pip[@]}" --prefix "$SITE/mpich" "${mpich[@]}" || return 1; fi
  [ $partial = 0 ] || return 2
}

step "1. wheels from $WHEELS into $SITE"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  for w in "$WHEELS"/*.whl; do printf '  %10d  %s\n' "$(stat -c %s "$w")" "$(basename "$w")"; done
  install_wheels
  rc=$?
  case $rc in
    2) record "install wheels" 1 "binary wheels left out (another Python version?)" ;;
    *) record "install wheels" "$rc" ;;
  esac
else
  echo "no wheels in $WHEELS: using what this Python already has."
  echo "($WHEELS is ignored by git: a copy of the working tree made from git leaves it out;"
  echo " copy it along explicitly, see docs/gpu.rst.)"
  record "install wheels" skip "no wheels in $WHEELS (git-ignored: copy it along)"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LIBMPI=""
for d in "$SITE/mpich/lib" "$SITE/lib"; do
  if [ -f "$d/libmpi.so.12" ]; then LIBMPI=$d/libmpi.so.12; break; fi
done
if [ -n "$LIBMPI" ]; then
  # mpi4py >= 4 loads the MPI library named by MPI4PY_LIBMPI; an mpi4py linked
  # against libmpi.so.12 finds it through LD_LIBRARY_PATH.
  export MPI4PY_LIBMPI=$LIBMPI
  LD_LIBRARY_PATH="$(dirname "$LIBMPI")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi
# Should the fallback be a system Open MPI: it refuses root without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "PYTHONPATH=$PYTHONPATH"
echo "MPI4PY_LIBMPI=${MPI4PY_LIBMPI:-}"

# -- 2. MPI, environment, kernels -----------------------------------------------------

step "2a. an mpiexec whose ranks form one job"
# MPICH's own first: the one installed from the wheels, then the one next to
# this Python (a virtual environment with the mpich package), then the system's.
CANDIDATES=()
add_candidate() {
  local m=$1 c
  [ -x "$m" ] || return 0
  for c in ${CANDIDATES[@]+"${CANDIDATES[@]}"}; do [ "$c" = "$m" ] && return 0; done
  CANDIDATES+=("$m")
}
add_candidate "$SITE/mpich/bin/mpiexec"
add_candidate "$SITE/bin/mpiexec"
PYBIN=$(command -v "$PY" || true)
[ -n "$PYBIN" ] && add_candidate "$(dirname "$PYBIN")/mpiexec"
PYPREFIX=$(timeout 20 "$PY" -c 'import sys; print(sys.prefix)' 2>/dev/null || true)
[ -n "$PYPREFIX" ] && add_candidate "$PYPREFIX/bin/mpiexec"
SYSTEM_MPIEXEC=$(command -v mpiexec || true)
[ -n "$SYSTEM_MPIEXEC" ] && add_candidate "$SYSTEM_MPIEXEC"
# Only rank 0 prints, after a barrier: one line, which cannot interleave. Ranks
# of an mpiexec that does not match mpi4py's MPI are separate jobs of size 1,
# each its own rank 0: several lines saying "world 1".
JOBCHECK='from mpi4py import MPI
c = MPI.COMM_WORLD
c.Barrier()
if c.Get_rank() == 0:
    print("world", c.Get_size(), "|", MPI.Get_library_version().splitlines()[0].strip(), flush=True)'
MPIEXEC=""
for m in ${CANDIDATES[@]+"${CANDIDATES[@]}"}; do
  out=$(timed 30 0 "$m" -n 2 "$PY" -c "$JOBCHECK" 2>&1)
  echo "$m:"
  echo "$out" | tail -4 | sed 's/^/  /'
  worlds=$(echo "$out" | grep -c '^world ')
  if [ "$worlds" = 1 ] && echo "$out" | grep -q '^world 2 '; then
    MPIEXEC=$m
    break
  fi
done
if [ -n "$MPIEXEC" ]; then
  PATH="$(dirname "$MPIEXEC"):$PATH"
  export PATH
  record "mpiexec -n 2 forms one job" 0 "$MPIEXEC"
else
  record "mpiexec -n 2 forms one job" 1 "none of: ${CANDIDATES[*]:-no mpiexec found}"
fi

# mpi NAME WANT RESERVE ARGS...: run under $MPIEXEC, or NOT RUN without one.
mpi() {
  local name=$1 want=$2 reserve=$3
  shift 3
  if [ -z "$MPIEXEC" ]; then
    echo "(not run: no mpiexec forms one job)"
    record "$name" notrun "no mpiexec forms one job"
    return
  fi
  run "$name" "$want" "$reserve" "$MPIEXEC" "$@"
}

step "2b. python -m mpi_gradreducer.info (2 ranks)"
mpi "info (2 ranks)" 30 0 -n 2 "$PY" -m mpi_gradreducer.info

step "2c. cupy, and the batched-copy kernel once per dtype (1 process)"
run "cupy + batched_copy kernel" 45 0 "$PY" - <<'EOF'
import sys
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
from mpi_gradreducer import backend

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
        for m, o in zip(members, out):
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
EOF

# -- 3. tests -------------------------------------------------------------------------

step "3a. tests/test_kernel_source.py (1 process; no MPI, no GPU)"
# ok only when every test ran and passed: pytest's last line is then "N passed in ...".
out=$(timed 45 90 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_kernel_source.py 2>&1)
rc=$?
echo "$out" | tail -6
last=$(echo "$out" | grep -E '(passed|failed|skipped|error)' | tail -1)
if [ "$rc" = 0 ] && echo "$last" | grep -Eq '^[0-9]+ passed in '; then
  record "kernel-source tests (1 process)" 0 "${last% in *}"
else
  record "kernel-source tests (1 process)" "$([ "$rc" = 0 ] && echo 1 || echo "$rc")" "${last:-no pytest summary}"
fi

TESTS=(tests/test_gpu.py tests/test_staging.py)
step "3b. ${TESTS[*]} ($NP ranks)"
# Each rank writes $OUT/junit.RANK.xml; the verdict is read from those files.
PYTEST='import sys, pytest
from mpi4py import MPI
out = sys.argv[1]
sys.exit(pytest.main(sys.argv[2:] + [f"--junitxml={out}/junit.{MPI.COMM_WORLD.Get_rank()}.xml"]))'
if [ -n "$MPIEXEC" ]; then
  timed 150 75 "$MPIEXEC" -n "$NP" "$PY" -c "$PYTEST" "$OUT" -q -p no:cacheprovider --only-mpi -rs "${TESTS[@]}"
  TESTS_RC=$?
  echo "(pytest exit status: $TESTS_RC)"
  # One line per verdict: NAME<TAB>STATUS<TAB>NOTE (STATUS 0 ok, 1 failed, notrun).
  VERDICT='import glob, os, sys
import xml.etree.ElementTree as ET
out, np_, rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
NO_GPU = "needs cupy and a CUDA device"
files = sorted(glob.glob(os.path.join(out, "junit.*.xml")))
cases = {}  # (file, name) -> list of (outcome, message) over ranks
for path in files:
    for case in ET.parse(path).getroot().iter("testcase"):
        key = (case.get("classname", "").split(".")[-1], case.get("name"))
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome, message = tag, (child.get("message") or "").strip()
                break
        cases.setdefault(key, []).append((outcome, message))
def verdict(name, modules):
    mine = {k: v for k, v in cases.items() if k[0] in modules}
    if len(files) < np_:
        return name, "1", f"{len(files)} of {np_} ranks wrote results (pytest status {rc})"
    bad = [k[1] for k, v in mine.items() if any(o in ("failure", "error") for o, _ in v)]
    passed = sum(1 for v in mine.values() if all(o == "passed" for o, _ in v))
    no_gpu = [k[1] for k, v in mine.items() if any(o == "skipped" and NO_GPU in m for o, m in v)]
    if bad:
        return name, "1", f"{len(bad)} failed: " + ", ".join(bad[:4])
    if no_gpu:
        return name, "1", f"{len(no_gpu)} of {len(mine)} skipped: {NO_GPU} (nothing of the GPU path ran)"
    if passed == 0:
        return name, "1", "no test ran"
    return name, "0", f"{passed} passed, {len(mine) - passed} skipped"
for line in (verdict("GPU tests (test_gpu.py)", {"test_gpu"}),
             verdict("staging tests (CPU schedule)", {"test_staging"})):
    print("\t".join(line))
smoke = [v for k, v in cases.items() if k == ("test_gpu", "test_cuda_aware_branches_smoke")]
if not smoke:
    print("CUDA-aware branches\tnotrun\tno result for the smoke test")
else:
    outcome, message = smoke[0][0]
    if outcome == "passed" and all(o == "passed" for o, _ in smoke[0]):
        print("CUDA-aware branches\t0\tAllreduce on device buffers and scaling through cupy ran and passed")
    elif outcome == "skipped":
        print(f"CUDA-aware branches\tnotrun\tnot run: {message.replace(chr(9), chr(32))}")
    else:
        print(f"CUDA-aware branches\t1\t{outcome}: {message[:200]}")
for (module, test), v in sorted(cases.items()):
    outcome, message = v[0]
    if outcome == "skipped" and NO_GPU not in message and test != "test_cuda_aware_branches_smoke":
        print(f"  not run: {module}::{test}: {message[:160]}", file=sys.stderr)
'
  verdicts=$(timeout 30 "$PY" -c "$VERDICT" "$OUT" "$NP" "$TESTS_RC" 2>"$OUT/skips.txt") || verdicts=""
  cat "$OUT/skips.txt"
  if [ -z "$verdicts" ]; then
    record "GPU tests (test_gpu.py)" 1 "no junit results (pytest status $TESTS_RC)"
  fi
  while IFS=$'\t' read -r name status note; do
    [ -n "$name" ] && record "$name" "$status" "$note"
  done <<<"$verdicts"
else
  record "GPU tests (test_gpu.py)" notrun "no mpiexec forms one job"
  record "staging tests (CPU schedule)" notrun "no mpiexec forms one job"
  record "CUDA-aware branches" notrun "no mpiexec forms one job"
fi

# -- 4. benchmark ---------------------------------------------------------------------

# bench NAME JSON WORKLOAD WANT RESERVE: ok only if JSON holds the timed reducer for WORKLOAD.
BENCHCHECK='import json, sys
path, workload = sys.argv[1], sys.argv[2]
try:
    data = json.load(open(path))
except (OSError, ValueError) as exc:
    sys.exit(f"no result: {exc}")
if "skipped" in data:
    sys.exit("skipped: " + str(data["skipped"]))
methods = data.get("workloads", {}).get(workload, {}).get("methods", {})
staged = methods.get("reducer-staged", {}).get("median_ms")
if staged is None:
    sys.exit(f"no reducer-staged time for {workload} in {path}")
print(f"{workload}: reducer-staged {staged:.2f} ms")'
bench() {
  local name=$1 json=$2 workload=$3 want=$4 reserve=$5 rc note
  if [ -z "$MPIEXEC" ]; then
    record "$name" notrun "no mpiexec forms one job"
    return
  fi
  timed "$want" "$reserve" "$MPIEXEC" -n "$NP" "$PY" -m mpi_gradreducer.bench_gpu \
    --workload "$workload" --reps 5 --json "$json"
  rc=$?
  note=$(timeout 20 "$PY" -c "$BENCHCHECK" "$json" "$workload" 2>&1)
  if [ "$rc" = 0 ] && [ -f "$json" ] && timeout 20 "$PY" -c "$BENCHCHECK" "$json" "$workload" >/dev/null 2>&1; then
    record "$name" 0 "$note"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    record "$name" "$rc" "$note"
  else
    record "$name" 1 "status $rc; $note"
  fi
}

step "4a. bench_gpu resnet50 ($NP ranks)"
bench "bench_gpu resnet50" "$OUT/bench_gpu.json" resnet50 70 30

step "4b. bench_gpu many-small ($NP ranks)"
bench "bench_gpu many-small" "$OUT/bench_gpu_many_small.json" many-small 40 10

# -- 5. summary -----------------------------------------------------------------------

step "5. summary ($((SECONDS - START)) s of a budget of $BUDGET s)"
printf '%s\n' "${SUMMARY[@]}"
[ -s "$OUT/skips.txt" ] && { echo "tests not run, and why:"; cat "$OUT/skips.txt"; }
timeout 20 "$PY" - "$OUT/bench_gpu.json" "$OUT/bench_gpu_many_small.json" <<'EOF' || true
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    with open(path) as f:
        data = json.load(f)
    if "skipped" in data:
        print(f"{os.path.basename(path)}: skipped ({data['skipped']})")
        continue
    for name, w in data["workloads"].items():
        ms = ", ".join(f"{m} {v['median_ms']:.2f} ms" for m, v in w["methods"].items())
        print(f"{name}: {ms}")
        for m, e in w.get("efficiency", {}).items():
            parts = [f"{k} {e[k]:.2f}" for k in ("staging_efficiency", "copy_bound_over_staged") if k in e]
            print(f"  {m}: " + ", ".join(parts))
        for m, why in w.get("skipped", {}).items():
            print(f"  {m} skipped: {why}")
EOF
if [ $FAILED = 0 ]; then echo "result: every step ok"; else echo "result: NOT every step ok (exit status 1)"; fi
echo "log: $OUT/device_check.log"
exit $FAILED
