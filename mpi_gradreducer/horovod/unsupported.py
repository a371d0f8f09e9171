"""Horovod's names that this package does not provide: each raises, naming what to use instead."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["run"]


def _refuse(name: str, instead: str) -> NoReturn:
    raise NotImplementedError(f"{name} is not supported by mpi_gradreducer.horovod; {instead}")


def run(*args: Any, **kwargs: Any) -> NoReturn:
    """``horovod.run`` / ``horovodrun``: not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("horovod.run (and horovodrun)", "start the script with mpiexec: mpiexec -n 4 python -m mpi4py train.py")
