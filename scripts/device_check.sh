#!/usr/bin/env bash
# The one check of the GPU path, run once from the repository root on a machine
# with an NVIDIA GPU, CuPy, numpy and mpi4py but no internet:
#
#   scripts/device_check.sh
#
# It runs scripts/device_check.py (what each step does, and the environment
# variables WHEELS, OUT, PYTHON, SITE, NP and BUDGET, are described there)
# with $PYTHON (default python3), the Python that has cupy. Exit status 0 only
# when every step is ok.
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python3}" scripts/device_check.py "$@"
