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
# 2. checks that ranks started by that mpiexec form one job, prints
#    `python -m mpi_gradreducer.info`, and compiles and runs the batched-copy
#    kernel once per dtype in a single process;
# 3. runs the GPU and staging tests under mpiexec -n 4;
# 4. runs the GPU benchmark on ResNet-50 and on 1000 small tensors;
# 5. prints a summary: one line per step, and the benchmark's key ratios.
#
# A failed step is reported and the next one still runs. Every step has a time
# limit, and the limits are cut so that the whole script ends within BUDGET
# seconds. Output is also written to $OUT/device_check.log.
#
# Environment (all optional):
#   WHEELS  folder of wheels (default: .whl in the repository root)
#   OUT     folder for the log and the benchmark's JSON (default: out)
#   PYTHON  the Python that has cupy (default: python3)
#   SITE    scratch install folder (default: /tmp/site)
#   NP      ranks for the tests and the benchmark (default: 4)
#   BUDGET  seconds for the whole script (default: 460)
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
OUT=${OUT:-out}
SITE=${SITE:-/tmp/site}
NP=${NP:-4}
BUDGET=${BUDGET:-460}
mkdir -p "$OUT"
rm -f "$OUT/bench_gpu.json" "$OUT/bench_gpu_many_small.json"
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

# run NAME WANT RESERVE COMMAND...: the command under a time limit, recorded.
run() {
  local name=$1 want=$2 reserve=$3 secs rc
  shift 3
  secs=$(limit "$want" "$reserve")
  if [ "$secs" -lt 10 ]; then
    echo "(no time left in the budget of $BUDGET s)"
    record "$name" skip "no time left"
    return
  fi
  timeout --kill-after=5 "$secs" "$@"
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
    timeout 120 "$PY" -c "$UNPACK" "$SITE" "$WHEELS"/*.whl || return 1
    return 0
  fi
  local pip=(timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check)
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
  echo "no wheels in $WHEELS: using what this Python already has"
  record "install wheels" skip "no wheels"
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
CANDIDATES=()
for d in "$SITE/mpich/bin" "$SITE/bin"; do
  [ -x "$d/mpiexec" ] && CANDIDATES+=("$d/mpiexec")
done
SYSTEM_MPIEXEC=$(command -v mpiexec || true)
[ -n "$SYSTEM_MPIEXEC" ] && CANDIDATES+=("$SYSTEM_MPIEXEC")
MPIEXEC=""
for m in ${CANDIDATES[@]+"${CANDIDATES[@]}"}; do
  secs=$(limit 30)
  [ "$secs" -ge 10 ] || break
  sizes=$(timeout --kill-after=5 "$secs" "$m" -n 2 "$PY" -c \
    "from mpi4py import MPI; print('size', MPI.COMM_WORLD.Get_size(), '|', MPI.Get_library_version().splitlines()[0])" 2>&1)
  echo "$m:"
  echo "$sizes" | tail -4 | sed 's/^/  /'
  if [ "$(echo "$sizes" | grep -c '^size 2 ')" = 2 ]; then
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
  MPIEXEC=mpiexec
fi

step "2b. python -m mpi_gradreducer.info (2 ranks)"
run "info (2 ranks)" 45 0 "$MPIEXEC" -n 2 "$PY" -m mpi_gradreducer.info

step "2c. cupy, and the batched-copy kernel once per dtype (1 process)"
run "cupy + batched_copy kernel" 90 0 "$PY" - <<'EOF'
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

failed = 0
for item, wire in (("float32", "float32"), ("float16", "float32"), ("float64", "float64"), ("complex64", "complex64")):
    try:
        members = [cupy.arange(5, dtype=item), cupy.arange(7, dtype=item) + 1]
        buf = cupy.zeros(12, dtype=wire)
        backend.batched_copy(members, buf, [0, 5], 2.0, False)
        want = np.concatenate([np.arange(5), np.arange(7) + 1]) * 2.0
        assert np.allclose(cupy.asnumpy(buf), want), ("pack", cupy.asnumpy(buf))
        out = [cupy.zeros_like(m) for m in members]
        backend.batched_copy(out, buf, [0, 5], 0.5, True)
        for m, o in zip(members, out):
            assert np.allclose(cupy.asnumpy(o), cupy.asnumpy(m)), ("unpack", cupy.asnumpy(o))
        print(f"  {item} via {wire}: ok")
    except Exception as exc:
        failed += 1
        print(f"  {item} via {wire}: FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:600]}")
sys.exit(1 if failed else 0)
EOF

# -- 3. tests -------------------------------------------------------------------------

step "3. tests/test_gpu.py tests/test_staging.py ($NP ranks)"
run "pytest gpu + staging ($NP ranks)" 300 120 "$MPIEXEC" -n "$NP" "$PY" -m pytest -q -p no:cacheprovider \
  --only-mpi -rs tests/test_gpu.py tests/test_staging.py

# -- 4. benchmark ---------------------------------------------------------------------

step "4a. bench_gpu resnet50 ($NP ranks)"
run "bench_gpu resnet50" 180 45 "$MPIEXEC" -n "$NP" "$PY" -m mpi_gradreducer.bench_gpu \
  --workload resnet50 --reps 5 --json "$OUT/bench_gpu.json"

step "4b. bench_gpu many-small ($NP ranks)"
run "bench_gpu many-small" 90 0 "$MPIEXEC" -n "$NP" "$PY" -m mpi_gradreducer.bench_gpu \
  --workload many-small --reps 5 --json "$OUT/bench_gpu_many_small.json"

# -- 5. summary -----------------------------------------------------------------------

step "5. summary ($((SECONDS - START)) s)"
printf '%s\n' "${SUMMARY[@]}"
timeout 30 "$PY" - "$OUT/bench_gpu.json" "$OUT/bench_gpu_many_small.json" <<'EOF' || true
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
echo "log: $OUT/device_check.log"
exit $FAILED
