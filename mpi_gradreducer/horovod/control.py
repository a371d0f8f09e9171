"""Operations without data: ``join``, ``barrier``, and the agreement the package's own collective calls start with.

They go through the engine like any collective, so a rank in ``join()``
takes part in barriers (and answers the rest), and a bad argument on one
rank raises on every rank.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from mpi4py import MPI

from .session import SetInfo, current
from .submit import Prepared, submit, wait

__all__ = ["join", "barrier", "check", "join_optimizers"]


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
    with join_optimizers():
        return int(wait(submit("hvd.join", "join", None, None, lambda info: ({}, None, _last), True)))


def _last(response: Any, outputs: list[Any]) -> int:
    return int(outputs[0])


def barrier(process_set: Any = None) -> None:
    """Wait until every rank of the process set (default: the global one) has called it."""
    wait(submit("hvd.barrier", "barrier", process_set, None, lambda info: ({}, None, lambda r, o: None), True))


def check(what: str, agreed: Sequence[tuple[str, tuple[int, ...]]] = (), error: BaseException | None = None,
          process_set: Any = None) -> None:
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


@contextlib.contextmanager
def join_optimizers() -> Iterator[None]:
    """Within this block, this rank takes part in the steps of every live ``hvd.DistributedOptimizer``.

    ``hvd.join()`` runs in it: each optimizer's own ``join()`` (the wrapped
    class's: it takes part in the other ranks' reductions with nothing, and
    once every rank has joined copies the parameters and optimizer state of
    the rank that took the most steps into every rank's) runs on a thread of
    its own, while the engine serves the other collectives.
    """
    ctx = current("hvd.join")
    live = [opt for ref in ctx.optimizers if (opt := ref()) is not None and opt.reducer.comm != MPI.COMM_NULL]
    ctx.optimizers[:] = [weakref.ref(opt) for opt in live]
    errors: list[BaseException] = []

    def run(opt: Any) -> None:
        try:
            opt.join()
        except BaseException as exc:  # raised on the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(opt,), name="mpi_gradreducer-horovod-join", daemon=True)
               for opt in live]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
