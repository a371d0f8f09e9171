"""Run documentation examples on every rank, in order, each in a fresh namespace.

``python tests/jobs/doc_examples.py IN.json OUT.json``: IN holds a list of
``{"id": ..., "code": ...}``; OUT (written by rank 0) maps each id to the
errors of the ranks where it raised ("" when it ran everywhere). Every
reducer or optimizer an example leaves alive is freed after it, in the same
order on every rank. A line "example <id>" on stdout marks the start of each:
when an example hangs, the test names the last one started.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback

from mpi4py import MPI


def _free_leftovers(namespace: dict) -> None:
    from mpi_gradreducer import DistributedGradReducer

    for name in sorted(namespace):
        value = namespace[name]
        free = getattr(value, "free", None)
        if isinstance(value, DistributedGradReducer) or type(value).__name__ == "DistributedOptimizer":
            free()


def main() -> None:
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as f:
        blocks = json.load(f)
    results = {}
    for block in blocks:
        if comm.rank == 0:
            print(f"example {block['id']}", flush=True)
        namespace = {"__name__": "__main__"}
        error = ""
        try:
            exec(compile(block["code"], block["id"], "exec"), namespace)
            _free_leftovers(namespace)
        except BaseException:
            error = traceback.format_exc(limit=-3)
        del namespace
        gc.collect()
        errors = comm.gather(error, root=0)
        if comm.rank == 0:
            results[block["id"]] = "".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        comm.Barrier()
    if comm.rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
