"""Horovod's process sets: only the global one (every rank given to ``init``) is supported."""

from __future__ import annotations

from typing import Any

from .context import current

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "check_global"]

_ALTERNATIVE = ("process sets beyond the global one are not supported by mpi_gradreducer.horovod; give init() a "
                "communicator (or a list of ranks) of the ranks you need, or use mpi_gradreducer.create_group with "
                "the package's own API")


class ProcessSet:
    """Horovod's process set. Only :data:`global_process_set` exists; making another raises.

    Raises:
        NotImplementedError: always, when constructed.
    """

    def __init__(self, ranks_or_comm: Any) -> None:
        raise NotImplementedError(f"ProcessSet({ranks_or_comm!r}): {_ALTERNATIVE}")

    @classmethod
    def _global(cls) -> ProcessSet:
        return cls.__new__(cls)

    process_set_id = 0

    def size(self) -> int:
        """The number of ranks."""
        return current("global_process_set.size()").comm.Get_size()

    def rank(self) -> int:
        """This rank."""
        return current("global_process_set.rank()").comm.Get_rank()

    def included(self) -> bool:
        """True: every initialized rank is in the global process set."""
        current("global_process_set.included()")
        return True

    def __repr__(self) -> str:
        return "global_process_set"


#: Every rank given to ``init()``: the only process set.
global_process_set = ProcessSet._global()


def add_process_set(process_set: Any) -> ProcessSet:
    """Not supported.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError(f"add_process_set: {_ALTERNATIVE}")


def remove_process_set(process_set: Any) -> bool:
    """Not supported.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError(f"remove_process_set: {_ALTERNATIVE}")


def check_global(process_set: Any, what: str) -> None:
    """Raise unless ``process_set`` is the global one (or None).

    Raises:
        NotImplementedError: another process set.
    """
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"{what}: process_set: expected global_process_set, got {process_set!r}; "
                                  f"{_ALTERNATIVE}")
