"""A process that checks it is no singleton of a larger job, then trains; for ``tests/test_singleton.py``.

Started N times without ``mpiexec`` (each its own world of size 1), with a
launcher's variables set, it must stop with the singleton error before it
trains; started by a launcher the MPI library understands, every rank trains.
``--via`` picks who checks: ``check`` (``check_not_singleton``, called here),
``reducer`` (the first ``DistributedGradReducer``), ``hvd`` (``hvd.init``),
``torch`` (``mpi_gradreducer.torch.init_gloo``, a gloo process group) or
``torch-backend`` (``init_process_group("mpi_gradreducer", init_method="mpi://")``). Output lines::

    probe RANK of SIZE | task TASK | host HOST    # started; TASK: the launcher's task id, if any
    trained RANK of SIZE | mean M                 # trained: M is the mean of the ranks, on every rank
    singleton error RANK | MESSAGE                # the error (printed, then exit status 3)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

from mpi_gradreducer._core.singleton import check_not_singleton


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", choices=["check", "reducer", "hvd", "torch", "torch-backend"], default="check")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    task = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
                 if v in os.environ), "-")
    print(f"probe {rank} of {size} | task {task} | host {MPI.Get_processor_name()}", flush=True)
    grads = [np.full(3, float(rank), np.float32)]
    try:
        if args.via == "check":
            check_not_singleton()
            from mpi_gradreducer import DistributedGradReducer

            reducer = DistributedGradReducer(grads)
        elif args.via == "reducer":
            from mpi_gradreducer import DistributedGradReducer

            reducer = DistributedGradReducer(grads)
        elif args.via == "hvd":
            import mpi_gradreducer.horovod as hvd

            hvd.init()
            hvd.shutdown()
            from mpi_gradreducer import DistributedGradReducer

            reducer = DistributedGradReducer(grads)
        elif args.via == "torch-backend":
            import torch.distributed as dist

            import mpi_gradreducer.torch  # noqa: F401 (registers the backend)

            dist.init_process_group("mpi_gradreducer", init_method="mpi://")
            dist.destroy_process_group()
            from mpi_gradreducer import DistributedGradReducer

            reducer = DistributedGradReducer(grads)
        else:
            import torch.distributed as dist

            from mpi_gradreducer.torch import init_gloo

            init_gloo()
            dist.destroy_process_group()
            from mpi_gradreducer import DistributedGradReducer

            reducer = DistributedGradReducer(grads)
    except RuntimeError as exc:
        if "singleton" not in str(exc):
            raise
        print(f"singleton error {rank} | {exc}", flush=True)
        return 3
    reducer(grads)
    reducer.free()
    print(f"trained {rank} of {size} | mean {float(grads[0][0]):g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
