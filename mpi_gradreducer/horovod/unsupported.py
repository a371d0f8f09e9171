"""Horovod's names that this package does not provide: each raises, naming what to use instead."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["run", "elastic"]


def _refuse(name: str, instead: str) -> NoReturn:
    raise NotImplementedError(f"{name} is not supported by mpi_gradreducer.horovod; {instead}")


def run(*args: Any, **kwargs: Any) -> NoReturn:
    """``horovod.run`` / ``horovodrun``: not supported.

    Raises:
        NotImplementedError: always.
    """
    _refuse("horovod.run (and horovodrun)", "start the script with mpiexec: mpiexec -n 4 python -m mpi4py train.py")


class _Elastic:
    """``hvd.elastic``: any attribute raises."""

    def __getattr__(self, attribute: str) -> NoReturn:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        _refuse(f"hvd.elastic.{attribute}", "elastic training (ranks joining and leaving) has no MPI-only "
                                            "equivalent here; restart the job with mpiexec from a checkpoint")

    def __repr__(self) -> str:
        return "<hvd.elastic: not supported>"


elastic = _Elastic()
