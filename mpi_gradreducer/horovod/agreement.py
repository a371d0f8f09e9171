"""Operations without data: ``join``, ``barrier``, and the agreement the package's own collective calls start with.

They go through the engine like any collective, so a rank in ``join()``
takes part in barriers (and answers the rest), and a bad argument on one
rank raises on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .context import SetInfo
from .process_sets import global_process_set
from .submit import Prepared, submit, wait

__all__ = ["join", "barrier", "check"]


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' collectives until every rank has joined.

    Meanwhile this rank takes part in every allreduce (with the operation's
    identity: zero for sums and averages, which still divide by every rank,
    as in Horovod) and barrier of every process set it is in; the other
    kinds raise on the ranks that call them, as in Horovod. It also takes
    part in the steps of every ``hvd.DistributedOptimizer`` of this process
    (see :meth:`~.optimizer.DistributedOptimizer.join`).

    Args:
        device: accepted for compatibility (the identities are made on the host).

    Returns:
        The rank that joined last.
    """
    from .optimizer import join_optimizers

    with join_optimizers():
        return int(wait(submit("hvd.join", "join", None, None, lambda info: ({}, None, _last), True)))


def _last(response: Any, outputs: list[Any]) -> int:
    return int(outputs[0])


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank of the process set has called it."""
    wait(submit("hvd.barrier", "barrier", process_set, None, lambda info: ({}, None, lambda r, o: None), True))


def check(what: str, agreed: Sequence[tuple[str, tuple[int, ...]]] = (), error: BaseException | None = None,
          process_set: Any = global_process_set) -> None:
    """An operation without data: every rank of the set gets there, with the same ``agreed`` values, or raises.

    The calls of this package that move data themselves (making process
    sets, writing the timeline) start with one, so that a bad argument on
    one rank, values that differ between ranks, or a rank in ``join()``
    raise on every rank instead of leaving the others waiting.

    Args:
        what: the call, for messages.
        agreed: ``(label, ints)`` pairs that must be equal on every rank.
        error: this rank's error, raised on every rank.
        process_set: the ranks.
    """
    def prepare(info: SetInfo) -> Prepared:
        if error is not None:
            raise error
        return {"entries": tuple(agreed)}, None, lambda r, o: None

    wait(submit(what, "check", process_set, None, prepare, True))
