#!/usr/bin/env bash
# Build the documentation site into docs/_build/html, with every warning an
# error (-W) and every cross-reference checked (-n). Installs the docs extra
# (and the test extra: the API reference imports mpi_gradreducer.torch) into
# .venv first, as scripts/test.sh does; --no-install skips that (test.sh has
# installed them already).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPI_GRADREDUCER_VENV:-.venv}
if [ "${1:-}" != "--no-install" ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[mpich,test,docs]"
fi
rm -rf docs/_build/doctrees
timeout --kill-after=10 300 "$venv/bin/python" -m sphinx -W --keep-going -n -q -b html \
    -d docs/_build/doctrees docs docs/_build/html
echo "docs: docs/_build/html/index.html"
