"""A job for the stall inspector and lost peers of ``mpi_gradreducer.horovod`` (2 ranks; see test_horovod_stall.py).

``python horovod_stall.py MODE``; every rank prints ``rank R: ...`` lines:

- ``warn``: rank 0 submits ``only_rank0``; rank 1 submits it 4 s later (the
  stall warning, after HOROVOD_STALL_CHECK_TIME_SECONDS, names rank 1 and the tensor).
- ``shutdown``: rank 0 submits ``only_rank0``, rank 1 never does; after
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS rank 0's call raises, and rank 1's next call does too.
- ``exit``: every other rank's operation is in flight when the last rank
  leaves the process (no ``hvd.shutdown()``, no call): their ``synchronize``
  raises (at 3 ranks and more, as the first rank's verdict says).
- ``peer-shutdown``: the same, but the last rank calls ``hvd.shutdown()`` and stays.
- ``join-left``: every other rank waits in ``hvd.join()`` when the last rank
  shuts down: their ``join`` raises.
- ``crossed``: two ranks in different operations: rank 0 in ``hvd.allreduce``
  of ``metric``, rank 1 in its ``DistributedOptimizer``'s reduction (set
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: the stall shutdown ends rank 0's
  ``metric``, which then steps too, and rank 1's ``metric`` raises).
"""

from __future__ import annotations

import sys
import time

import torch
from mpi4py import MPI

import mpi_gradreducer.horovod as hvd

mode = sys.argv[1]
hvd.init()
me = hvd.rank()
x = torch.ones(8)


def report(what: str, call) -> None:
    t0 = time.monotonic()
    try:
        out = call()
        print(f"rank {me}: {what} returned {out.tolist()} after {time.monotonic() - t0:.1f} s", flush=True)
    except Exception as exc:
        print(f"rank {me}: {what} raised {type(exc).__name__} after {time.monotonic() - t0:.1f} s: {exc}",
              flush=True)


if mode == "warn":
    if me == 0:
        report("only_rank0", lambda: hvd.allreduce(x, name="only_rank0", op=hvd.Sum))
    else:
        time.sleep(4.0)
        report("only_rank0", lambda: hvd.allreduce(x, name="only_rank0", op=hvd.Sum))
    hvd.shutdown()
elif mode == "shutdown":
    if me == 0:
        report("only_rank0", lambda: hvd.allreduce(x, name="only_rank0"))
    else:
        time.sleep(6.0)
        report("later", lambda: hvd.allreduce(x, name="later"))
    hvd.shutdown()
elif mode in ("exit", "peer-shutdown"):
    leaver = hvd.size() - 1
    if me != leaver:  # the operation is in flight on every other rank before the last rank leaves
        handle = hvd.allreduce_async(x, name="only_rank0")
        MPI.COMM_WORLD.gather(None, root=leaver)
        report("only_rank0", lambda: hvd.synchronize(handle))
        hvd.shutdown()
    else:
        MPI.COMM_WORLD.gather(None, root=leaver)
        time.sleep(0.5)
        if mode == "exit":
            print(f"rank {me}: leaving", flush=True)
            sys.exit(0)
        hvd.shutdown()
        print(f"rank {me}: shut down", flush=True)
        time.sleep(3.0)
elif mode == "join-left":  # every other rank waits in hvd.join() when the last rank leaves
    leaver = hvd.size() - 1
    if me != leaver:
        MPI.COMM_WORLD.gather(None, root=leaver)
        report("join", lambda: torch.tensor([hvd.join()]))
        hvd.shutdown()
    else:
        MPI.COMM_WORLD.gather(None, root=leaver)
        time.sleep(0.5)
        hvd.shutdown()
        print(f"rank {me}: shut down", flush=True)
        time.sleep(3.0)
elif mode == "crossed":
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def step() -> torch.Tensor:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return model.bias.detach()

    calls = [("metric", lambda: hvd.allreduce(x, name="metric")), ("step", step)]
    for what, call in calls if me == 0 else reversed(calls):
        report(what, call)
    hvd.shutdown()
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {me}: done", flush=True)
