"""Benchmarks of the reducer: shared workloads, timing and output; one module per benchmark.

Run under MPI; only rank 0 prints::

    mpiexec -n 4 python -m mpi_gradreducer.bench [host] [OPTIONS]   # the host benchmark (the default)
    mpiexec -n 4 python -m mpi_gradreducer.bench gpu [OPTIONS]      # cupy gradients
    mpiexec -n 4 python -m mpi_gradreducer.bench compression [OPTIONS]
    mpiexec -n 4 python -m mpi_gradreducer.bench torch-optimizer [OPTIONS]
    mpiexec -n 2 python -m mpi_gradreducer.bench horovod [OPTIONS]

Each subcommand's module is imported only when it runs. The parts they share:
:mod:`.workloads` (gradient shapes), :mod:`.timing` (interleaved cases,
medians), :mod:`.limit` (the raw-MPI limit), :mod:`.environment`,
:mod:`.output` and :mod:`.cli` (options under MPI), and :mod:`.network`
(across hosts: the host count, the wire bound of ``--link-rate``, each
host's NIC bytes per call). ``scripts/bench_hosts.py`` runs the host
benchmark across a cluster of ``scripts/cluster.py`` at several link rates.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from mpi4py import MPI

from .timing import Case, summary, time_cases
from .workloads import Workload, bert_base, make_workload, many_small, mixed, resnet50, small

__all__ = [
    "COMMANDS",
    "Case",
    "DEFAULT_COMMAND",
    "Workload",
    "bert_base",
    "describe_commands",
    "main",
    "make_workload",
    "many_small",
    "mixed",
    "resnet50",
    "small",
    "summary",
    "time_cases",
]

#: Subcommand name -> (module below this package, one line about it).
COMMANDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "host": ("host", "numpy gradients: the reducer against the raw-MPI limit, a per-tensor loop, torch"),
    "gpu": ("gpu", "cupy gradients: the staged and CUDA-aware reducer against the pinned-copy bound"),
    "compression": ("compression", "one large float32 gradient: fp16/bf16 wire compression against none"),
    "torch-optimizer": ("torch_optimizer", "a torch MLP's training step: DistributedOptimizer against DDP over gloo"),
    "horovod": ("horovod", "many small torch tensors: hvd.grouped_allreduce and allreduce_async_ against the reducer"),
})
#: What runs when the first argument names no subcommand.
DEFAULT_COMMAND = "host"


def describe_commands() -> str:
    """The subcommands, one line each, for a help text."""
    width = max(len(name) for name in COMMANDS)
    rows = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return ("subcommands (python -m mpi_gradreducer.bench NAME --help), the first is the default:\n"
            + "\n".join(rows))


def _command(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The subcommand named by ``argv[0]`` (else the default), and its own arguments."""
    if argv and argv[0] in COMMANDS:
        return argv[0], list(argv[1:])
    return DEFAULT_COMMAND, list(argv)


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> Any:
    """Run the subcommand that ``argv`` names (default: the host benchmark) over ``comm``.

    Args:
        argv: ``[NAME] OPTIONS...`` (default ``sys.argv[1:]``); without a
            leading subcommand name, all of it goes to the host benchmark.
        comm: the communicator (default ``MPI.COMM_WORLD``).

    Returns:
        What the subcommand's ``main`` returns: its results.
    """
    name, rest = _command(list(sys.argv[1:] if argv is None else argv))
    module = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
    return module.main(rest, comm)
