#!/usr/bin/env bash
# Run on a machine with internet: downloads into .whl/ the wheels that
# scripts/device_check.sh installs on a GPU machine that has none (CPython 3.12,
# x86_64 Linux, with CuPy, numpy and mpi4py already there):
#
#   mpich              the MPI library, mpiexec and its process manager
#   pytest, pytest-mpi and pytest's dependencies (iniconfig, pluggy, packaging, pygments)
#   ml_dtypes          bfloat16 (0.5.x: works with numpy 1.26 as well as 2.x)
#
# .whl/ is ignored by git: copy it to the GPU machine along with the working
# tree explicitly (see docs/gpu.rst, "Checking it on a GPU machine").
#
# Versions are pinned; any wheel already in the folder is removed first, so that
# only these are installed there. About 20 MB in all.
#
# Environment (optional): WHEELS (default .whl), PYTHON (default python3),
# PYTHON_VERSION (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEELS:-.whl}
PY=${PYTHON:-python3}
PYVER=${PYTHON_VERSION:-3.12}
PINNED=(
  mpich==5.0.2
  pytest==9.2.0
  pytest-mpi==0.6
  iniconfig==2.3.1
  pluggy==1.7.0
  packaging==26.4
  pygments==2.21.0
  ml_dtypes==0.5.4
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${PINNED[@]}"
count=0
for w in "$DEST"/*.whl; do
  printf '%10d  %s\n' "$(stat -c %s "$w")" "$(basename "$w")"
  count=$((count + 1))
done
echo "$count wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
if [ "$count" -ne ${#PINNED[@]} ]; then
  echo "expected ${#PINNED[@]} wheels" >&2
  exit 1
fi
