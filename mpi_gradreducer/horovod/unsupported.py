"""Horovod's names that this package does not provide: each raises, naming what to use instead."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["SyncBatchNorm", "sparse_allreduce_async", "start_timeline", "stop_timeline", "run"]


def _refuse(name: str, instead: str) -> NoReturn:
    raise NotImplementedError(f"{name} is not supported by mpi_gradreducer.horovod; {instead}")


def SyncBatchNorm(*args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802 (Horovod's name)
    """Not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("hvd.SyncBatchNorm", "use torch.nn.BatchNorm (statistics per rank) or torch.nn.SyncBatchNorm with "
                                 "torch.distributed")


def sparse_allreduce_async(tensor: Any, name: Any, op: Any, process_set: Any = None) -> NoReturn:
    """Not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("hvd.sparse_allreduce_async", "pass sparse_as_dense=True to DistributedOptimizer, or allreduce "
                                          "tensor.to_dense()")


def start_timeline(file_path: Any, mark_cycles: bool = False) -> NoReturn:
    """Not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("hvd.start_timeline", "use the reducer's timeline (mpi_gradreducer.torch.DistributedOptimizer(..., "
                                  "timeline='trace.json'))")


def stop_timeline() -> NoReturn:
    """Not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("hvd.stop_timeline", "use the reducer's timeline (mpi_gradreducer.torch.DistributedOptimizer(..., "
                                 "timeline='trace.json'))")


def run(*args: Any, **kwargs: Any) -> NoReturn:
    """``horovod.run`` / ``horovodrun``: not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("horovod.run (and horovodrun)", "start the script with mpiexec: mpiexec -n 4 python -m mpi4py train.py")
