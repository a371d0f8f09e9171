"""``python -m mpi_gradreducer.bench [NAME] [OPTIONS]``: run a benchmark subcommand under MPI."""

from __future__ import annotations

from . import main
from .cli import run_as_script

if __name__ == "__main__":
    run_as_script(main, "mpi_gradreducer.bench")
