"""Elastic training: a lost rank or host no longer ends the job; the survivors go on from the last commit.

Under Open MPI 5 started with ``mpiexec --with-ft ulfm`` (fault tolerance,
ULFM)::

    from mpi_gradreducer import DistributedGradReducer, elastic

    state = elastic.ArrayState(params, step=0)          # arrays changed in place, plain values
    reducer = DistributedGradReducer(params, group=state.comm)
    state.world.track(reducer)                           # rebuilt on every new communicator

    @elastic.run
    def train(state):
        while state.step < steps:
            grads = backward(params, my_shard(state.rank, state.size, state.step))
            reducer(grads)
            sgd(params, grads)
            state.step += 1
            state.commit()                               # copied aside: a loss goes back here

    train(state)

The parts: ``state`` (what is committed, restored and shared),
``world`` (the ranks now: shrink after a loss, spawn and merge to grow
back), ``rebuild`` (what a tracked object offers: ``communicators()``, ``abandon()``, ``rebuild(comm)``),
``discovery`` (where new ranks may start), ``loop`` (``run``) and
``errors``. ``docs/elastic.rst`` tells the whole story.
"""

from .._core.faults import ulfm_available, why_no_ulfm
from .batch import GlobalBatch
from .discovery import Discovery
from .errors import ElasticError, HostsUpdated, RanksLost
from .loop import run
from .rebuild import Rebuildable
from .state import ArrayState, State
from .world import Settings, World, joining, joining_hosts

__all__ = ["ArrayState", "Discovery", "ElasticError", "GlobalBatch", "HostsUpdated", "RanksLost", "Rebuildable",
           "Settings", "State", "World", "joining", "joining_hosts", "run", "ulfm_available", "why_no_ulfm"]
