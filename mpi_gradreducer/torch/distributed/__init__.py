"""A ``torch.distributed`` backend over MPI: ``ProcessGroup`` calls translated onto the package's collectives.

``import mpi_gradreducer.torch`` registers the backend ``"mpi_gradreducer"``
(CPU and CUDA tensors) and the rendezvous ``mpi://``. Under ``mpiexec``::

    import torch.distributed as dist
    import mpi_gradreducer.torch  # registers the backend

    dist.init_process_group("mpi_gradreducer", init_method="mpi://")  # rank and size from MPI

``init_method="mpi://"`` is needed because ``init_process_group`` skips its
rendezvous only for torch's own MPI backend: every other backend gets a
store, by default from ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``), which works as well, as torchrun, Lightning's
``MPIEnvironment`` and Accelerate set it. ``mpi://`` makes that store (a
``TCPStore`` on an address of rank 0 that every rank reaches) from MPI alone.

How a call runs. Every process group owns a duplicate of its communicator
(the world's, or an MPI sub-communicator for ``new_group``), a
communication thread and the package's watchdog. A collective is checked
and staged on the caller's thread (a contiguous host tensor for a strided
or CUDA one), queued, and returns an ``MPIWork`` (torch's ``Work``) at once; the thread
runs the queue in order: the ranks agree (``_core.agreement``:
one small ``Allreduce``; a shape, dtype or operation that differs on one
rank raises the same ``ValueError`` on every rank, naming both ranks), then
nonblocking MPI calls move the bytes, completed by MPI's own wait (DDP
waits on the future in C++, where no nap could see it). float16 and
bfloat16 sums go through the package's 16-bit summer
(``_core.halves.SliceSum``: float32 sums, rounded once).
Point-to-point calls are posted at once on a second duplicate and completed
by a thread of their own, the package's way (``_core.polling.Polling``:
tests with naps while no caller waits, MPI's own wait while one does).

Options: ``init_process_group(..., pg_options=mpi_gradreducer.Options(...))``
(or ``new_group(..., pg_options=...)``) reads ``validate`` (``"never"``:
no agreement before each collective, the fastest, but a mismatch then hangs
or corrupts as with any MPI program), ``timeout`` (the watchdog's; default:
the process group's own timeout) and ``stall_warning``.
"""

from .basics import BACKEND, RENDEZVOUS
from .elastic import ElasticGroup
from .group import ACROSS_HOSTS_IN_FLIGHT, MPIProcessGroup
from .registry import init_process_group, register
from .work import NAP_SECONDS, MPIWork

__all__ = ["ACROSS_HOSTS_IN_FLIGHT", "BACKEND", "NAP_SECONDS", "RENDEZVOUS", "ElasticGroup", "MPIProcessGroup",
           "MPIWork", "init_process_group", "register"]
