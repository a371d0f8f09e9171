"""``python -m mpi_gradreducer.bench_gpu``: the GPU benchmark, :mod:`mpi_gradreducer.bench.gpu`.

The same as ``python -m mpi_gradreducer.bench gpu``; kept so that existing
command lines go on working.
"""

from __future__ import annotations

from .bench.cli import run_as_script
from .bench.gpu import METHODS, TARGET, WORKLOADS, gpu_available, main

__all__ = ["METHODS", "TARGET", "WORKLOADS", "gpu_available", "main"]

if __name__ == "__main__":
    run_as_script(main, "bench_gpu")
