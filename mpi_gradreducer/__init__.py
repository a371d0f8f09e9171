"""Framework-agnostic fused MPI gradient reduction for numpy and cupy arrays.

Example::

    from mpi_gradreducer import DistributedGradReducer, broadcast_parameters

    broadcast_parameters(params)
    reducer = DistributedGradReducer(params)
    ...
    reducer(grads)  # averaged across ranks, in place
"""

from ._core.groups import broadcast_parameters, create_group, local_rank, select_device
from ._core.options import Options
from ._core.planning import Bucket
from ._core.powersgd import PowerSGD
from ._core.shard import Piece, Shard
from ._core.sparse import RowSparse
from ._core.steps import ReductionStep
from .reducer import DistributedGradReducer, ReducerStats

#: This version of the package, written only here (setup.cfg and the docs read it).
#: A string such as "0.5.0".
__version__ = "0.6.0"

__all__ = [
    "Bucket",
    "DistributedGradReducer",
    "Options",
    "Piece",
    "PowerSGD",
    "ReducerStats",
    "ReductionStep",
    "RowSparse",
    "Shard",
    "broadcast_parameters",
    "create_group",
    "local_rank",
    "select_device",
    "__version__",
]
