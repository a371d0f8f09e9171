"""Horovod's torch API (``horovod.torch`` 0.28) on this package: change the import, keep the script.

::

    import mpi_gradreducer.horovod as hvd     # was: import horovod.torch as hvd

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Run it with ``mpiexec -n 4 python -m mpi4py train.py``. Every name of
``horovod.torch`` is here; those listed in :data:`UNSUPPORTED` raise
``NotImplementedError`` naming what to use instead. ``docs/horovod.rst``
lists the differences. Importing this module imports torch.

The parts: :mod:`.session` (``init`` and topology, in one context object),
:mod:`.negotiation` (how the ranks agree on an operation, pure),
:mod:`.engine` (the thread every operation goes through),
:mod:`.execute` (how each kind moves its data), :mod:`.submit` (a call
becomes an operation), :mod:`.collectives` (the collectives on tensors),
:mod:`.control` (``join``, ``barrier``: operations without data),
:mod:`.autograd`, :mod:`.ops` (reduction operations, compression),
:mod:`.optimizer` (``DistributedOptimizer``), :mod:`.functions`
(parameters, optimizer state, objects), :mod:`.process_sets`,
:mod:`.sparse`, :mod:`.sync_batch_norm`, :mod:`.timeline`,
:mod:`.exceptions` (Horovod's errors), :mod:`.elastic` (``hvd.elastic``:
training that survives lost ranks, under Open MPI's ULFM) and
:mod:`.unsupported`.
"""

from . import elastic
from .collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from .control import barrier, join
from .exceptions import HorovodInternalError
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .ops import Adasum, Average, Compression, Max, Min, Product, Sum
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, init, remove_process_set
from .session import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm
from .timeline import start_timeline, stop_timeline
from .unsupported import run

#: Names that exist for compatibility but raise ``NotImplementedError`` (``Adasum``: when used).
UNSUPPORTED = ("Adasum", "run")

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "Product",
    "ProcessSet", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "run", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize",
]
