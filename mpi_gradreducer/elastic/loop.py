"""The run loop: call the training function; on a lost rank, recover and call it again from the last commit."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .._core import faults
from . import _ulfm
from .discovery import Discovery
from .errors import ElasticError, HostsUpdated, RanksLost
from .state import State
from .world import JoinFailed, Settings, World

__all__ = ["run"]

def run(func: Callable[..., Any] | None = None, *, discovery: Discovery | None = None, min_size: int | None = None,
        max_size: int | None = None, timeout: float | None = None,
        failure: Callable[[BaseException], bool] | None = None) -> Any:
    """Make ``func(state, ...)`` survive lost ranks and take in new ones (a decorator, with or without options).

    The wrapped function is called with the state first. Before the call,
    every rank takes the newest commit (``state.sync()``). When a rank is
    lost while it runs, on every survivor: the MPI error is caught, the
    state goes back to its last commit, the communicators are revoked and
    shrunk to the survivors, the reducers and optimizers that the state
    tracks are rebuilt on the new communicator with their own options,
    the state is taken from the lowest rank that holds the newest commit,
    the reset callbacks run, and ``func`` is called again. When a commit
    finds new ranks ready (started in free slots that the discovery lists),
    they join the same way, without a restore. A process started as a
    replacement joins the running ranks on entering the wrapped function.

    Where MPI cannot survive a lost process (not Open MPI 5 with ``mpiexec
    --with-ft ulfm``), rank 0 says so once, naming the fix, and a lost rank
    ends the job as without elastic mode.

    Args:
        func: the training function, ``func(state, *args, **kwargs)``.
        discovery: where new ranks may start (default: the environment's
            ``MPI_GRADREDUCER_ELASTIC_DISCOVERY`` or ``..._HOSTFILE``; none: never).
        min_size: with fewer ranks left, wait for replacements up to
            ``timeout``, then raise :class:`~.errors.ElasticError` on every
            rank (default ``MPI_GRADREDUCER_ELASTIC_MIN_SIZE``, else 1).
        max_size: never grow beyond this (default ``..._MAX_SIZE``, else what the discovery lists).
        timeout: seconds to wait below ``min_size`` (default ``..._TIMEOUT``, else 600).
        failure: also treat an exception for which this returns True as a
            failure to recover from (Horovod's ``HorovodInternalError``).

    Returns:
        The wrapped function (or a decorator, when called with options only).
    """
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
            return _loop(fn, state, args, kwargs, Settings(discovery, min_size, max_size, timeout), failure)

        return wrapper

    return decorate if func is None else decorate(func)


def _loop(fn: Callable[..., Any], state: State, args: tuple[Any, ...], kwargs: dict[str, Any], settings: Settings,
          failure: Callable[[BaseException], bool] | None) -> Any:
    world = state.world
    world.settings = settings
    why = faults.why_no_ulfm()
    if why is not None and world.comm.Get_rank() == 0:
        _say(f"mpi_gradreducer.elastic: a lost rank will end this job: {why}.")

    def lost(exc: BaseException) -> bool:
        """Whether ``exc`` means a lost rank that this job can survive (never elastic mode's own verdict, such
        as too few ranks left, though it was raised while handling a loss)."""
        if isinstance(exc, ElasticError):
            return False
        return why is None and (faults.failure_of(exc) is not None or isinstance(exc, RanksLost)
                                or (failure is not None and failure(exc)) or _ulfm.failed_meanwhile(exc, world.comm))

    try:
        reset = world.join_if_new()
    except JoinFailed as exc:  # never one of the ranks: this process ends as a lost process does
        _say(f"mpi_gradreducer.elastic: {exc}; this process ends, the running ranks go on")
        sys.stdout.flush()
        # Under Open MPI 5.0.11 every other way out ends the whole job: an exit without MPI_Finalize, or with a
        # failed status, and MPI_Finalize itself crashes after a failed merge. A process killed by a signal is a
        # lost process, which fault tolerance survives: the running ranks go on without it.
        os.kill(os.getpid(), signal.SIGKILL)
        raise  # not reached
    except BaseException as exc:  # joined, then a rank was lost in the rebuild: recover like the others
        if not lost(exc):
            raise
        _recover(state, world, exc, lost)
        reset = True
    sync = True
    while True:
        try:
            if sync:
                state.sync()
            if reset:
                state.on_reset()
            result = fn(state, *args, **kwargs)
            if not world.wind_down():
                return result
            sync = True
        except HostsUpdated as exc:
            if why is not None:
                raise
            sync = not exc.skip_sync
            t0 = time.perf_counter()
            before, rank = world.comm.Get_size(), world.comm.Get_rank()
            try:
                stays = world.update()
            except BaseException as again:  # a rank lost while the ranks change: recover from the survivors
                if not lost(again):
                    raise
                _recover(state, world, again, lost)
                sync = True
            else:
                if not stays:
                    _say(f"mpi_gradreducer.elastic: rank {rank} of {before} leaves at the commit of {state.commits}: "
                         f"{world.settings.discovery.describe()} no longer lists a slot for it on its host")
                    raise SystemExit(0)
                change = world.comm.Get_size() - before
                if world.comm.Get_rank() == 0:
                    what = f"{change} new rank(s) joined" if change > 0 else f"{-change} drained rank(s) left"
                    _say(f"mpi_gradreducer.elastic: {what}; {world.comm.Get_size()} ranks go on from the commit "
                         f"of {state.commits} ({time.perf_counter() - t0:.2f} s to change and rebuild)")
        except BaseException as exc:
            if not lost(exc):
                raise
            _recover(state, world, exc, lost)
            sync = True
        reset = True


def _recover(state: State, world: World, error: BaseException, lost: Callable[[BaseException], bool]) -> None:
    """Back to the last commit, then shrink and rebuild; again, from the new survivors, while ranks are lost
    during the recovery itself (a loss in the shrink, the rebuild, a spawn or a merge)."""
    state.rollback()
    earlier: list[str] = []  # the losses of recoveries cut short by another one
    tries = world.comm.Get_size()  # each try after the first follows another loss: no more than there are ranks
    while True:
        world.shrunk = None
        try:
            state.failure = world.recover(error)
            break
        except BaseException as again:
            tries -= 1
            if not lost(again) or tries <= 0:
                raise
            if world.shrunk is not None:
                earlier.append(f"{world.shrunk}, then during the recovery: ")
            error = again
    if world.comm.Get_rank() == 0:
        _say(f"mpi_gradreducer.elastic: {''.join(earlier)}{state.failure} ({world.recovery_seconds:.2f} s to shrink "
             "and rebuild)")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
