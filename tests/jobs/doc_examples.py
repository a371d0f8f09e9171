"""Run documentation examples on every rank, in order, each in a fresh namespace, then check what it claims.

``python tests/jobs/doc_examples.py IN.json OUT.json``: IN holds a list of
``{"id": ..., "path": ..., "code": ...}``; OUT (written by rank 0) maps
each id to the errors of the ranks where it raised or where its check
(``tests/docclaims.py``) failed ("" when it ran and held everywhere).
Before each example numpy's and torch's global generators are seeded
differently on every rank; what it prints is captured per rank for its
check. Every reducer or optimizer an example leaves alive is freed after
it, in the same order on every rank. A line "example <id>" on stdout marks
the start of each: when an example hangs, the test names the last one
started.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for docclaims
from docclaims import Spy, claims_of  # noqa: E402


def _free_leftovers(namespace: dict) -> None:
    from mpi_gradreducer import DistributedGradReducer

    for name in sorted(namespace):
        value = namespace[name]
        free = getattr(value, "free", None)
        if isinstance(value, DistributedGradReducer) or type(value).__name__ == "DistributedOptimizer":
            free()


def _seed(code: str, rank: int) -> None:
    """Different global random streams on every rank, as a real job's ranks would have."""
    np.random.seed(1000 + rank)
    if "import torch" in code:
        import torch

        torch.manual_seed(1000 + rank)


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
        printed = io.StringIO()
        spy = Spy()
        try:
            _seed(block["code"], comm.rank)
            with spy.watching(), contextlib.redirect_stdout(printed):
                exec(compile(block["code"], block["id"], "exec"), namespace)
        except BaseException:
            error = traceback.format_exc(limit=-3)
        if comm.allreduce(int(not error), op=MPI.MIN):  # ran everywhere: every rank checks (collectives)
            claims = claims_of(block["path"], block["code"])
            try:
                assert len(claims) == 1, f"{len(claims)} checks for this example (tests/docclaims.py)"
                claims[0].check(namespace, printed.getvalue(), spy)
            except BaseException:
                error = f"its check ({claims[0].what if len(claims) == 1 else 'none'}) failed:\n" + \
                    traceback.format_exc(limit=-2)
        try:
            _free_leftovers(namespace)
        except BaseException:
            error += traceback.format_exc(limit=-3)
        del namespace, spy
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
