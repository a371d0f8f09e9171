"""Framework-agnostic fused MPI gradient reduction for numpy and cupy arrays.

Example::

    from mpi_gradreducer import DistributedGradReducer, broadcast_parameters

    broadcast_parameters(params)
    reducer = DistributedGradReducer(params)
    ...
    reducer(grads)  # averaged across ranks, in place
"""

import os as _os
import sys as _sys

from ._core.faults import detector_settings as _detector_settings, ft_requested as _ft_requested

if _ft_requested() and "mpi4py.MPI" not in _sys.modules:
    # Open MPI with ULFM (elastic mode): MPI_Finalize's closing fence was seen to hang for good after a rank was
    # lost (3 survivors of 4, every communicator freed); without the fence every process exits at once.
    _os.environ.setdefault("OMPI_MCA_mpi_async_mpi_finalize", "1")
    # MPI_GRADREDUCER_ELASTIC_DETECT: ULFM's heartbeat detector, for processes that stop answering without dying
    _os.environ.update({k: v for k, v in _detector_settings().items() if k not in _os.environ})

from ._core.groups import broadcast_parameters, create_group, local_rank, local_size, select_device
from ._core.hooks import GradBucket
from ._core.options import Options
from ._core.planning import Bucket
from ._core.powersgd import PowerSGD
from ._core.shard import Piece, Shard
from ._core.singleton import check_not_singleton
from ._core.sparse import RowSparse
from ._core.steps import ReductionStep
from ._core.timeline import Timeline
from .reducer import DistributedGradReducer, ReducerStats

#: This version of the package, written only here (setup.cfg and the docs read it).
#: A string such as "0.5.0".
__version__ = "0.8.0"

__all__ = [
    "Bucket",
    "DistributedGradReducer",
    "GradBucket",
    "Options",
    "Piece",
    "PowerSGD",
    "ReducerStats",
    "ReductionStep",
    "RowSparse",
    "Shard",
    "Timeline",
    "broadcast_parameters",
    "check_not_singleton",
    "create_group",
    "local_rank",
    "local_size",
    "select_device",
    "__version__",
]
