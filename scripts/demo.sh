#!/usr/bin/env bash
# The main job, on a fresh machine with only Python 3 and pip: installs the
# package with MPICH from PyPI into .venv and trains a numpy MLP on the digits
# dataset (shipped inside scikit-learn) with 4 data-parallel ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPI_GRADREDUCER_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[mpich,examples]"
export PATH="$PWD/$venv/bin:$PATH"
exec mpiexec -n "${NPROCS:-4}" python scripts/train_digits.py "$@"
